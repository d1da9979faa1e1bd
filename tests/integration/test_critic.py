"""PPO's critic on megatron-core (CPU, gloo): the policy's trunk under a fresh value head,
values aligned like log-probs, the clipped value loss normalised by global token counts, dist
checkpoints, and TP=2 / DP=2 / sequence-parallel MoE giving the one-rank values and update.

The tiny checkpoints are real HF directories written by the family on first use (under a
temporary RLX_CACHE), with tied embeddings and with a separate lm_head.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import megatron_world, spawn_ranks  # tests/ is on sys.path (conftest)

from rlx.algo.config import AlgoConfig
from rlx.config import build
from rlx.config.compose import compose, to_object
from rlx.runtime import run
from rlx.sample import Sample
from rlx.trainer.batch import make_micro_batch
from rlx.trainer.config import TrainConfig
from rlx.trainer.critic import Critic, ValueHead
from rlx.trainer.megatron import critic_dir
from rlx.trainer.offload import Offloader


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Name -> tiny checkpoint dir: "tied" and "untied" Qwen3, "moe" Qwen3-MoE."""
    cache = tmp_path_factory.mktemp("rlx_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLX_CACHE", str(cache))
        return {name: _family(name, None).checkpoint_dir() for name in ("tied", "untied", "moe")}


@pytest.fixture(scope="module")
def world():
    """One gloo rank with megatron's parallel state (TP=1) for this module."""
    with megatron_world():
        yield


def _family(name: str, hf_dir: Path | None):
    """The model family of checkpoint `name`, as the shipped model configs build it."""
    if name == "moe":
        overrides = ["model=tiny_qwen3_moe"]
    else:
        overrides = [f"model.name=tiny_qwen3_{name}", f"model.tie_word_embeddings={name == 'tied'}"]
    model_cfg = to_object(compose(overrides)).model
    model_cfg.hf_checkpoint = None if hf_dir is None else str(hf_dir)
    return build(model_cfg)


def make_critic(hf_dir: Path, name: str = "tied", seed: int = 1, pad_multiple: int = 1, **algo) -> Critic:
    # adam_eps = 1: the first Adam step is ~lr * g rather than lr * sign(g), so comparing weights
    # (values) after a step compares gradients, not the signs of near-zero ones
    train = TrainConfig(global_batch_size=4, micro_batch_size=2, adam_eps=1.0)
    algo_cfg = AlgoConfig(_target_="rlx.algo.ppo.PPO", **({"critic_lr": 0.1} | algo))
    return Critic(_family(name, hf_dir), hf_dir, algo_cfg, train, total_steps=1, device=torch.device("cpu"),
                  params_dtype=torch.float32, pad_multiple=pad_multiple, seed=seed)  # fmt: skip


def batch() -> list[Sample]:
    """4 samples: prompts of 2-4 tokens, responses of 1-4 tokens, one with a masked token."""
    shapes = [([3, 4], [5, 6, 7, 1], [1, 1, 0, 1]), ([2, 3, 4, 5], [6], [1]),
              ([9, 8, 7], [6, 5], [1, 1]), ([4, 4], [2, 3, 1], [1, 1, 1])]  # fmt: skip
    return [Sample(prompt="", prompt_ids=p, response_ids=r, loss_mask=m, group=i, index=0)
            for i, (p, r, m) in enumerate(shapes)]  # fmt: skip


def capture_head_input(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every input [S, B, H] that `module.output_layer` receives from now on."""
    seen: list[torch.Tensor] = []
    module.output_layer.register_forward_pre_hook(lambda _, args: seen.append(args[0].detach()))
    return seen


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_value_head_is_the_only_fresh_part_and_values_align_like_logprobs(world, checkpoints, name):
    hf_dir = checkpoints[name]
    critic = make_critic(hf_dir, name)
    family = _family(name, hf_dir)
    policy = family.build_model()
    family.load_hf_weights(policy, hf_dir)
    policy.eval()

    # the trunk is the policy's, parameter for parameter; the head is new: hidden -> 1 with a bias
    module = critic.model.module
    trunk = {k: v for k, v in module.named_parameters() if not k.startswith("output_layer.")}
    policy_trunk = {k: v for k, v in policy.named_parameters() if not k.startswith("output_layer.")}
    assert trunk.keys() == policy_trunk.keys()
    for key, param in trunk.items():
        assert torch.equal(param, policy_trunk[key]), key
    assert isinstance(module.output_layer, ValueHead)
    assert {k: tuple(v.shape) for k, v in module.output_layer.named_parameters()} == {
        "weight": (1, 64),
        "bias": (1,),
    }

    samples = batch()
    critic_hidden, policy_hidden = capture_head_input(module), capture_head_input(policy)
    values = critic.values(samples)  # 2 micro-batches of 2
    assert [v.shape for v in values] == [torch.Size([s.response_len]) for s in samples]
    for i in (0, 2):
        mb = make_micro_batch(samples[i : i + 2], {})
        with torch.no_grad():
            policy(input_ids=mb.tokens_BL, position_ids=mb.position_ids_BL, attention_mask=None)
    # the head reads exactly the policy's final hidden state (after the final norm)
    for ours, theirs in zip(critic_hidden, policy_hidden, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    # value t of a sample is the head at position prompt_len + t - 1: where log p(token t) is read
    head = module.output_layer
    for i, s in enumerate(samples):
        hidden_SH = policy_hidden[i // 2][:, i % 2]
        positions = [len(s.prompt_ids) + t - 1 for t in range(s.response_len)]
        expected = (hidden_SH[positions] @ head.weight[0] + head.bias).detach()
        torch.testing.assert_close(values[i], expected, rtol=0, atol=1e-6)


def test_value_loss_warmup_and_checkpoint_round_trip(world, checkpoints, tmp_path):
    samples = batch()
    critic = make_critic(checkpoints["tied"], critic_warmup_steps=1)
    old = critic.values(samples)
    assert critic.warming_up
    # every target 0.5 above the old value: V = V_old at the step, so clipping changes nothing and
    # each loss token's loss is 0.5^2 / 2 = 0.125; the token mean over the 9 loss tokens of the
    # global batch (micro-batches of 5 and 4 loss tokens) is 0.125
    returns = [v + 0.5 for v in old]
    metrics = critic.train(samples, returns, old)
    assert metrics["train/value_loss"] == pytest.approx(0.125, abs=1e-6)
    assert metrics["train/value_clipfrac"] == 0.0
    assert metrics["train/critic_grad_norm"] > 0 and metrics["train/critic_lr"] == pytest.approx(0.1)
    assert not critic.warming_up and critic.num_trained_rollouts == 1
    trained = critic.values(samples)
    assert all((t - o).abs().max() > 1e-3 for t, o in zip(trained, old, strict=True))

    path = critic_dir(tmp_path / "megatron")
    assert path == tmp_path / "megatron_critic"
    critic.save(path)
    restored = make_critic(checkpoints["tied"], seed=7, critic_warmup_steps=1)  # another fresh head
    assert not torch.equal(restored.values(samples)[0], trained[0])
    restored.load(path)
    assert restored.num_trained_rollouts == 1 and not restored.warming_up
    for ours, theirs in zip(restored.values(samples), trained, strict=True):
        assert torch.equal(ours, theirs)
    # the optimizer state came back too: the next step is the same step
    critic.train(samples, returns, trained)
    restored.train(samples, returns, trained)
    for ours, theirs in zip(restored.values(samples), critic.values(samples), strict=True):
        assert torch.equal(ours, theirs)


def _values_and_step(critic: Critic) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    samples = batch()
    old = critic.values(samples)
    metrics = critic.train(samples, [v + 0.5 for v in old], old)
    return old, critic.values(samples), metrics


def _parallel_rank(
    rank: int, world_size: int, port: int, hf_dir: Path, name: str, tp: int, out: Path
) -> None:
    with megatron_world(rank, world_size, port, tp=tp):
        critic = make_critic(hf_dir, name, pad_multiple=tp)
        result = _values_and_step(critic)
        if rank == 0:
            torch.save(result, out)


@pytest.mark.parametrize(
    ("name", "tp"), [("tied", 2), ("tied", 1), ("moe", 2)], ids=["tp2", "dp2", "moe-tp2-sp"]
)
def test_parallel_critic_matches_one_rank(world, checkpoints, tmp_path, name, tp):
    """TP=2 (the head replicated on full hidden states), DP=2 (loss normalised by global counts),
    and MoE under TP=2 (sequence parallel: the head gathers the sequence) give the values and
    the update of one rank."""
    base = _values_and_step(make_critic(checkpoints[name], name))
    spawn_ranks(_parallel_rank, 2, checkpoints[name], name, tp, tmp_path / "rank0.pt")
    result = torch.load(tmp_path / "rank0.pt")
    for ours, theirs in zip(result[0] + result[1], base[0] + base[1], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=2e-5)
    for key in ("train/value_loss", "train/critic_grad_norm"):
        assert result[2][key] == pytest.approx(base[2][key], rel=1e-4), key


def test_ppo_loop_checkpoints_its_critic_and_resumes_its_warmup(tmp_path):
    """The loop saves the critic beside the policy; a resumed run restores it, warm-up count included."""
    short = ["algo=ppo", "algo.critic_warmup_steps=2", "rollout.batch_size=8", "rollout.n_samples_per_prompt=4",
             "train.micro_batch_size=16", "run.progress=false"]  # fmt: skip
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    history = run(compose([f"run.output_dir={first}", "run.num_rollout=2", "run.save=true", *short]))
    assert (first / "checkpoints" / "step_000001" / "megatron_critic").is_dir()
    for row in history:  # warm-up: the critic trains, the policy waits
        assert "train/value_loss" in row and "train/explained_variance" in row
        assert "train/pg_loss" not in row
    history = run(
        compose([f"run.output_dir={resumed}", "run.num_rollout=3", f"run.resume_from={first}", *short])
    )
    assert [h["step"] for h in history] == [2]
    assert "train/pg_loss" in history[0]  # the restored critic has trained on 2 rollouts: warm-up is over


def test_training_goes_on_unchanged_after_an_offload_round_trip(world, checkpoints):
    """Colocation frees every parameter, gradient buffer and Adam state and fills them again; the
    next step must be the one an untouched model takes, bit for bit. (On a GPU, moving
    `param.data` to the CPU instead cuts DDP's gradient hooks; tests/gpu/test_gpu_loop.py checks
    that gradients still flow there.)"""
    runs = []
    for round_trip in (False, True):
        critic = make_critic(checkpoints["tied"], value_clip=None)  # unclipped: the 2nd step has a gradient
        samples = batch()
        old = critic.values(samples)
        critic.train(samples, [v + 0.5 for v in old], old)  # Adam has state now
        if round_trip:
            offloader = Offloader(critic.model, critic.trainable.optimizer, on_cpu=True)
            offloader.offload()
            assert all(p.untyped_storage().nbytes() == 0 for p in critic.model.parameters())
            offloader.onload(torch.device("cpu"))
        metrics = critic.train(samples, [v + 0.5 for v in old], old)
        runs.append((metrics, {k: v.detach().clone() for k, v in critic.model.module.named_parameters()}))
    (before, weights), (after, weights_after) = runs
    assert after["train/critic_grad_norm"] > 0
    assert after["train/critic_grad_norm"] == before["train/critic_grad_norm"]
    for key, tensor in weights.items():
        assert torch.equal(weights_after[key], tensor), key
