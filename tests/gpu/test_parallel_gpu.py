"""Model parallelism on two GPUs (NCCL) takes the steps one GPU takes: the batches a bf16 run on one
GPU dumped are trained again with `debug.train_only` under TP=2, PP=2 and CP=2, and the per-step
losses, entropies and gradient norms agree with the one-GPU run's within bf16 tolerance. Skipped without
two GPUs.

Run on a CUDA machine (docs/gpu.md):  python -m pytest tests/gpu/test_parallel_gpu.py -q -s
(-s prints each layout's train time per step, for docs/benchmarks.md).
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from rlx.config.compose import compose
from rlx.runtime import run

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    pytest.mark.usefixtures("gpu_ray"),  # the runs share the directory's Ray (tests/gpu/conftest.py)
]

STEPS = 3
# tiny Qwen3 (2 layers, 4 heads, 2 KV groups): PP=2 holds a layer per stage, TP=2 a KV group per rank
COMMON = ["model=tiny_qwen3", "train.precision=bf16", f"run.num_rollout={STEPS}", "rollout.batch_size=16",
          "rollout.n_samples_per_prompt=8", "train.micro_batch_size=32", "run.progress=false",
          "run.loggers=[jsonl]"]  # fmt: skip
LAYOUTS = {
    "TP=2": ["cluster.tensor_parallel_size=2"],
    "PP=2": ["cluster.pipeline_parallel_size=2"],
    "CP=2": ["cluster.context_parallel_size=2"],
}
# bf16 arithmetic in another order (TP all-reduces, stage boundaries, the CP gathers): a few ulps of
# bf16 (2^-8 relative) in each log-prob, averaged over the batch
TOLERANCE = {"train/entropy": 5e-3, "train/grad_norm": 3e-2}
LOSS_ABS = 2e-3  # the GRPO loss is near 0: absolute


def train_only(out, dumped, gpus: int, layout: list[str]) -> list[dict]:
    cluster = [f"cluster.gpus_per_node={gpus}", f"cluster.num_trainer_procs={gpus}", "cluster.num_rollout_gpus=0",
               "cluster.colocate=false"]  # fmt: skip
    return run(compose([f"run.output_dir={out}", "debug.train_only=true", f"debug.load_rollouts={dumped}",
                        *cluster, *COMMON, *layout]))  # fmt: skip


def test_tp_pp_cp_take_the_one_gpu_steps(tmp_path):
    """The one-GPU steps are those of the run that dumped the batches (trainer and engine colocated):
    trained again from its dumps, a run takes the steps it took (tests/integration/test_run_modes.py
    checks this replay on the CPU)."""
    dumped = tmp_path / "one_gpu"
    one = run(compose([f"run.output_dir={dumped}", "cluster=1gpu", *COMMON]))
    times = {"1 GPU": statistics.median(h["time/train_s"] for h in one[1:])}
    failures = []
    for name, layout in LAYOUTS.items():
        two = train_only(tmp_path / name.replace("=", ""), dumped, 2, layout)
        times[name] = statistics.median(h["time/train_s"] for h in two[1:])
        for step, (a, b) in enumerate(zip(one, two, strict=True)):
            if abs(a["train/loss"] - b["train/loss"]) > LOSS_ABS:
                failures.append((name, step, "train/loss", a["train/loss"], b["train/loss"]))
            for key, rel in TOLERANCE.items():
                if b[key] != pytest.approx(a[key], rel=rel):
                    failures.append((name, step, key, a[key], b[key]))
    print(json.dumps({"median_train_s": times, "steps": STEPS, "device": torch.cuda.get_device_name()}))
    assert not failures, failures
