"""Each weight path (rollout.weight_sync) through the real loop on CPU: after every sync the
engine serves exactly the trainer's weights, so the trainer's fp32 log-probs of the sampled
tokens equal the engine's (train/logprob_abs_diff <= 1e-5 at every step), and every engine
reports the new version. `tensor` goes over shared memory here (CUDA IPC on a GPU),
`distributed` over gloo (NCCL on a GPU); `disk` is what every other loop test uses."""

from __future__ import annotations

import pytest

from rlx.config.compose import compose
from rlx.runtime import run

SHORT = [
    "run.num_rollout=3",
    "rollout.batch_size=8",
    "rollout.n_samples_per_prompt=4",
    "train.micro_batch_size=16",
    "run.progress=false",
    "run.loggers=[jsonl]",
    "rollout.weight_bucket_mb=1",
    "algo.entropy_coef=0.01",
]  # fmt: skip
# 1 MiB buckets: the tiny models need several. The entropy bonus makes every step's gradient
# non-zero whatever the rewards: a step whose groups all scored alike (a tiny model's rewards are
# mostly 0) had no gradient, so its sync sent unchanged weights and the test could not tell.

CASES = {
    "tensor": ["rollout.weight_sync=tensor"],
    "distributed": ["rollout.weight_sync=distributed"],
    "tensor, TP=2": ["rollout.weight_sync=tensor", "cluster.num_trainer_procs=2", "cluster.tensor_parallel_size=2"],
    "distributed, MoE EP=2, two engines": [
        "rollout.weight_sync=distributed", "model=tiny_qwen3_moe", "cluster.num_trainer_procs=2",
        "cluster.expert_parallel_size=2", "rollout.num_engines=2",
    ],
}  # fmt: skip


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_engines_serve_the_trainers_weights_after_every_sync(overrides, tmp_path):
    history = run(compose([f"run.output_dir={tmp_path}", *SHORT, *overrides]))
    assert [h["version"] for h in history] == [1, 2, 3]
    gaps = [h["train/logprob_abs_diff"] for h in history]
    assert all(gap <= 1e-5 for gap in gaps), gaps
    assert all(h["train/grad_norm"] > 0 for h in history)  # the weights did change between syncs
