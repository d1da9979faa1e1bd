"""The loop on one GPU, trainer and engine colocated (cluster=1gpu); skipped without a GPU. The runs
share the directory's Ray (tests/gpu/conftest.py).

Run on a CUDA machine (docs/gpu.md):  python -m pytest tests/gpu -q
"""

from __future__ import annotations

import pytest
import torch

from rlx.config.compose import compose
from rlx.runtime import run

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("gpu_ray"),
]

SHORT = [
    "rollout.batch_size=8",
    "rollout.n_samples_per_prompt=4",
    "train.micro_batch_size=16",
    "run.progress=false",
]
FP32_ENGINE = "+rollout.engine_args.dtype=float32"  # the trainer's precision, for exact logprobs


def test_colocated_loop_hands_the_gpu_back_and_forth_with_the_trainer_state_offloaded_or_kept(tmp_path):
    """Trainer and engine in fp32 on one GPU (TF32 off), 3 steps, the trainer's state offloaded to
    the CPU while the engine generates (`cluster.offload_trainer=true`), kept on the GPU with the
    engine's and the trainer's other memory released at each turn (`false`,
    `cluster.release_memory=true`), or nothing released (both false: what the default `auto`
    decides for a model this small; trainer and engine stay resident, the weight sync is the whole
    hand-over). Either way the engine serves exactly the trainer's weights at every step and the
    trainer takes optimizer steps; offloaded, the trainer leaves under 2 GiB behind while the
    engine generates. Kept, it keeps its state's bytes on the GPU: fp32 weights and Adam's two
    moments, 12 bytes a parameter, and not the 4 of its gradients: its live tensors (allocated
    memory) are the offloaded trainer's and the state's, to 1 MiB. The toy model's state (under
    1 MB) would hide in rounding: the layers are widened to 7.9M parameters (94.5 MB of state). The
    allocator's reserved segments are not compared: which 20 MiB segments a few live tensors keep
    mapped moves by tens of MiB between runs."""
    layers, width, ffn, heads, groups, d, vocab = 2, 512, 2048, 8, 4, 64, 16
    shape = [f"model.hidden_size={width}", f"model.ffn_hidden_size={ffn}", f"model.num_attention_heads={heads}",
             f"model.num_query_groups={groups}", f"model.kv_channels={d}"]  # fmt: skip
    qkv, proj, mlp = width * (heads + 2 * groups) * d, heads * d * width, 3 * width * ffn
    norms = 2 * width + 2 * d  # input and MLP norms, q and k norms
    params = layers * (qkv + proj + mlp + norms) + vocab * width + width  # tied embedding, final norm
    state_gib = 12 * params / 2**30
    reserved, live = {}, {}
    for mode, offload, release in (
        ("offloaded", "true", "true"),
        ("kept", "false", "true"),
        ("resident", "false", "auto"),
    ):
        history = run(compose([f"run.output_dir={tmp_path / mode}", "cluster=1gpu", FP32_ENGINE,
                               f"cluster.offload_trainer={offload}", f"cluster.release_memory={release}",
                               "run.num_rollout=3", *SHORT, *shape]))  # fmt: skip
        assert len(history) == 3
        # steps 1 and 2 are generated with weights the trainer changed and pushed to the engine
        assert all(h["train/logprob_abs_diff"] <= 1e-4 for h in history), [
            h["train/logprob_abs_diff"] for h in history
        ]
        assert all(h["train/grad_norm"] > 0 for h in history)
        # as training ends the device holds at least the trainer's peak (its allocator keeps it) and the engine's context
        assert all(h["perf/gpu_used_gib"] > h["perf/trainer_peak_mem_gib"] + 0.25 for h in history), history
        if mode == "resident":  # no turns: nothing released, offloaded or resumed, only the weight sync
            assert not [k for h in history for k in h if "colocate" in k], history[-1].keys()
            assert all(h["time/weight_sync_s"] > 0 for h in history)
            continue
        reserved[mode] = [h["colocate/trainer_offloaded_process_reserved_gib"] for h in history]
        live[mode] = [h["colocate/trainer_offloaded_process_allocated_gib"] for h in history]
    assert max(reserved["offloaded"]) < 2.0, reserved  # the trainer's leftovers while the engine generates
    more = min(live["kept"]) - max(live["offloaded"])
    assert abs(more - state_gib) <= 1 / 1024, (live, state_gib, reserved)


def test_bf16_colocated_loop_learns(tmp_path):
    history = run(
        compose([f"run.output_dir={tmp_path}", "cluster=1gpu", "train.precision=bf16", "run.progress=false"])
    )
    rewards = [h["rollout/reward_mean"] for h in history]
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + 0.4, rewards
    # bf16 trainer vs the engine's own numerics: close, not equal
    assert all(h["train/logprob_abs_diff"] < 0.05 for h in history)


def test_ppo_loop_trains_its_critic_on_gpu(tmp_path):
    history = run(compose([f"run.output_dir={tmp_path}", "cluster=1gpu", FP32_ENGINE, "run.num_rollout=3",
                           "algo=ppo", "run.save=true", *SHORT]))  # fmt: skip
    assert len(history) == 3
    for h in history:
        assert h["train/value_loss"] > 0 and h["train/critic_grad_norm"] > 0 and h["train/grad_norm"] > 0
        assert -10.0 < h["train/explained_variance"] < 1.0
    assert (tmp_path / "checkpoints" / "step_000002" / "megatron_critic").is_dir()
