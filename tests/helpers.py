"""Helpers shared by tests: free ports, ranks spawned inside pytest, a one-rank megatron world,
and the parity set-up of the model-family tests (megatron vs transformers logits and weights)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.multiprocessing as mp

from rlx.ports import free_port

__all__ = [
    "TINY_SHAPE", "assert_same_tensors", "bench_module", "free_port", "hf_logits", "load_megatron", "megatron_logits", "megatron_world",
    "spawn_ranks", "token_batch",
]  # fmt: skip


BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str):
    """bench/`name`.py imported, with bench/ on the path while it loads (a bench imports its
    siblings by name: `from rollout_throughput import ...`)."""
    import importlib
    import sys

    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


def _tiny_shape() -> dict[str, int]:
    """The toy models' shape, written once in conf/model/base/tiny.yaml (Megatron's key names), in
    the names of an HF config.json: every test's tiny transformers config starts from it."""
    import yaml

    m = yaml.safe_load((Path(__file__).parents[1] / "conf/model/base/tiny.yaml").read_text())
    return dict(
        vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
        num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_query_groups"], head_dim=m["kv_channels"],
        max_position_embeddings=m["max_position_embeddings"],
    )  # fmt: skip


TINY_SHAPE = _tiny_shape()


# What every rank imports, loaded once per test process by its fork server (rlx first: it sets
# megatron's import up, rlx/compat/megatron_jit.py); a rank forked from it starts in well under a
# second instead of spending 5-7 s of CPU on these imports, as a spawned interpreter does.
RANK_PRELOAD = ["rlx", "torch", "megatron.core", "rlx.trainer.parallel", "transformers", "pytest", "helpers"]


def spawn_ranks(fn: Callable, world_size: int, *args) -> None:
    """Run `fn(rank, world_size, port, *args)` in `world_size` fresh processes and wait.

    The processes are forked from this test process's fork server (multiprocessing's
    "forkserver", started on first use with RANK_PRELOAD imported and nothing else done: no
    thread, no torch.distributed, no model), so each starts as a new interpreter would, without
    paying for the imports again. `fn` must be a module-level function (it is pickled by name).
    A failing rank raises here with its traceback. The port is picked here and bound by rank 0
    later: where another process took it meanwhile (the other pytest worker's connections draw
    from the same ephemeral range), the ranks start again on a new one, at most PORT_TRIES times.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts (once per process)
    for attempt in range(PORT_TRIES):
        try:
            mp.start_processes(
                fn,
                args=(world_size, free_port(), *args),
                nprocs=world_size,
                join=True,
                start_method="forkserver",
            )
            return
        except mp.ProcessRaisedException as e:
            if "Address already in use" not in str(e) or attempt == PORT_TRIES - 1:
                raise


PORT_TRIES = 3


@contextlib.contextmanager
def megatron_world(rank: int = 0, world_size: int = 1, port: int | None = None, **parallel) -> Iterator[None]:
    """Megatron's parallel state over gloo (one rank in-process by default), torn down after."""
    from rlx.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(rank, world_size, "127.0.0.1", port or free_port(), **parallel)
    try:
        yield
    finally:
        destroy_distributed()


@contextlib.contextmanager
def tiny_bf16_trainable(train_cfg, lr: float = 1e-2) -> Iterator[tuple]:
    """`(gpt, ddp, optimizer, step)` in a one-rank megatron world: the tiny Qwen3 in bf16 from its
    checkpoint under `wrap_for_training(train_cfg)` (fp32 masters); `step()` runs one Adam step of
    the LM loss on a fixed batch of 4 x 16 tokens (seed 0)."""
    from rlx.config import build
    from rlx.config.compose import compose
    from rlx.trainer.trainable import wrap_for_training

    family = build(compose(["model=tiny_qwen3"]).model)
    hf_dir = family.checkpoint_dir()
    ids_BL = torch.randint(0, family.cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    with megatron_world():
        gpt = family.build_model(params_dtype=torch.bfloat16)
        family.load_hf_weights(gpt, hf_dir)
        (ddp,), optimizer = wrap_for_training([gpt], train_cfg, lr, torch.bfloat16)

        def step() -> tuple:
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            loss = ddp(input_ids=ids_BL[:, :-1], position_ids=None, attention_mask=None, labels=ids_BL[:, 1:])
            loss.mean().backward()
            return optimizer.step()  # (success, gradient norm, zeros)

        yield gpt, ddp, optimizer, step


def fp32_masters(optimizer) -> list[torch.Tensor]:
    """Copies of a bf16 megatron optimizer's fp32 master weights."""
    return [m.detach().clone() for inner in optimizer.chained_optimizers
            for group in inner.fp32_from_float16_groups for m in group]  # fmt: skip


@contextlib.contextmanager
def own_ray(loopback: bool = True, **init_kwargs) -> Iterator[None]:
    """A local Ray of this shape (`num_gpus=4`, say) for the block, started as a run starts its own
    (`rlx.launcher.ray_start`: on loopback). `loopback=False`: its node takes the machine's routable
    address instead, as a node of a multi-node run does (Ray then listens on every interface). The
    process's shared Ray (conftest's `ray_session`), if up, is shut down first; the next module
    starts it again."""
    import ray

    from rlx.launcher import ray_start

    ray.shutdown()
    init_kwargs = {"logging_level": "ERROR"} | init_kwargs
    if loopback:
        ray_start.start_local(**init_kwargs)
    else:
        ray.init(**ray_start.local_init_args(**init_kwargs))
    try:
        yield
    finally:
        ray.shutdown()


# ---- parity set-up shared by the model-family tests ------------------------------------------


def token_batch(seq_len: int = 12, vocab_size: int = 16) -> torch.Tensor:
    """Batch 2 x `seq_len` of random token ids over the whole (tiny) vocabulary, fixed."""
    return torch.randint(0, vocab_size, (2, seq_len), generator=torch.Generator().manual_seed(0))


def load_megatron(family, hf_dir) -> torch.nn.Module:
    """`family`'s megatron model with the HF weights of `hf_dir`, in eval mode."""
    model = family.build_model()
    family.load_hf_weights(model, hf_dir)
    return model.eval()


def megatron_logits(model, ids: torch.Tensor, grad: bool = False) -> torch.Tensor:
    """Full-vocabulary logits [b, s, V]: the model's vocab-parallel shards gathered over TP."""
    from megatron.core import tensor_parallel

    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, position_ids=positions, attention_mask=None)
        return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def hf_logits(hf_dir, ids: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits of `ids` for the checkpoint at `hf_dir`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_same_tensors(exported: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes and values, bit for bit."""
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


def digit_share(sample) -> float:
    """A dense reward for tests on a real model (`reward.fn=helpers.digit_share`): the share of the
    response's characters that are digits, so that a group's samples almost surely differ and the
    policy gets a gradient even where no answer is right yet."""
    text = sample.response_text
    return sum(c.isdigit() for c in text) / max(len(text), 1)


TINY_QWEN3 = dict(**TINY_SHAPE, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1)


def tiny_qwen3_config():
    """The tiny Qwen3 architecture the rollout tests load (vocabulary = the toy tasks' 16 words)."""
    from transformers import Qwen3Config

    return Qwen3Config(**TINY_QWEN3)


def write_tiny_qwen3(path: Path, seed: int = 0) -> Path:
    """A random tiny Qwen3 HF checkpoint directory at `path`, initialised from `seed` (a test module
    imports it from here, not from conftest: tests/gpu has a conftest of its own, and which one
    `import conftest` finds depends on what a worker collected first)."""
    from rlx.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tiny_qwen3_config(), path, seed=seed)


def all_ones_draws(vocab: int, count: int) -> list[tuple[int, int, int]]:
    """(seed, step, token) whose token's 24 bits of the engine's sampling hash are all ones (the
    draw where the seeded noise's uniform once rounded to 1: tests/unit/test_seeded_noise.py),
    found by search over seeds at step 5."""
    from rlx.engine.sampler import seeded_bits

    found, start = [], 0
    while len(found) < count:
        seeds = torch.arange(start, start + 256, dtype=torch.int64) * 7919 + 1
        bits = seeded_bits(seeds, torch.full_like(seeds, 5), vocab)
        found += [(int(seeds[r]), 5, t) for r, t in (bits == (1 << 24) - 1).nonzero().tolist()]
        start += 256
    return found[:count]


def fused_uniform(seed_R: torch.Tensor, step_R: torch.Tensor) -> torch.Tensor:
    """The fused sampler's uniform u (rlx.engine.triton_sample): (b + 0.5) / 2^23 for the top 23
    bits b of the row's hash (`rlx.engine.sampler.row_hash`), exact in fp32, in [2^-24, 1 - 2^-24]."""
    from rlx.engine.sampler import row_hash

    return (((row_hash(seed_R, step_R) >> 41) & ((1 << 23) - 1)).float() + 0.5) * (1.0 / (1 << 23))


def inverse_cdf(probs_RV: torch.Tensor, uniform_R: torch.Tensor) -> torch.Tensor:
    """The fused sampler's draw, in fp64: the first token, in id order, whose cumulative
    probability passes u times the row's total (probabilities need not be normalised)."""
    cum_RV = probs_RV.double().cumsum(-1)
    target_R = uniform_R.double().to(cum_RV.device) * cum_RV[:, -1]
    return torch.searchsorted(cum_RV, target_R[:, None], right=True)[:, 0].clamp_(max=probs_RV.shape[-1] - 1)


def truncation_keys(logits_RV: torch.Tensor) -> torch.Tensor:
    """rlx.engine.triton_truncate's keys (int64): integers in the order of the logits' values,
    from their bits (2-byte or fp32), negatives' magnitude bits flipped (-0 below +0)."""
    wide = logits_RV.element_size() == 4
    bits = logits_RV.view(torch.int32 if wide else torch.int16).long()
    return torch.where(bits >= 0, bits, bits ^ (0x7FFFFFFF if wide else 0x7FFF))


def truncation_kept(
    logits_RV: torch.Tensor,
    inv_t_R: torch.Tensor,
    top_k_R: torch.Tensor,
    top_p_R: torch.Tensor,
    min_p_R: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the truncating sampler (rlx.engine.triton_truncate) keeps, and each token's mass
    exp(s - m) (s = logit * inv_t in fp32, m its maximum): in the order of `truncation_keys`
    descending, ties by id (a stable sort), the prefix of tokens ranked below top_k, whose mass
    summed over the tokens before them (in fp64) is at most top_p times the row's, and with mass
    >= min_p: SGLang's rule (`sampler.truncate`)."""
    s = logits_RV.float() * inv_t_R.float()[:, None]
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    order = torch.sort(truncation_keys(logits_RV), dim=-1, descending=True, stable=True).indices
    sorted_e = e.gather(-1, order).double()
    exclusive = sorted_e.cumsum(-1) - sorted_e
    rank = torch.arange(logits_RV.shape[-1], device=logits_RV.device)[None, :]
    keep = (rank < top_k_R[:, None]) & (
        exclusive <= top_p_R.double()[:, None] * sorted_e.sum(-1, keepdim=True)
    )
    keep &= sorted_e >= min_p_R.double()[:, None]
    return torch.zeros_like(keep).scatter_(-1, order, keep), e


def truncated_inverse_cdf(
    logits_RV: torch.Tensor,
    inv_t_R: torch.Tensor,
    top_k_R: torch.Tensor,
    top_p_R: torch.Tensor,
    min_p_R: torch.Tensor,
    uniform_R: torch.Tensor,
) -> torch.Tensor:
    """The truncating sampler's draw: `inverse_cdf` over the mass `truncation_kept` keeps."""
    kept, e = truncation_kept(logits_RV, inv_t_R, top_k_R, top_p_R, min_p_R)
    return inverse_cdf(torch.where(kept, e.double(), 0.0), uniform_R)


# Seeds whose fused-sampler uniform at output index 5 (`fused_uniform`) is its largest,
# 1 - 2^-24, or its smallest, 2^-24 (23 hash bits all ones or all zeros): found by a search over
# seeds 7919 * i + 1 (about 2^23 hashes a find, 10 s on the CPU: too slow for each run);
# tests/unit/test_fused_draw_rule.py checks that they still hit the extremes.
EXTREME_UNIFORM_SEEDS = [
    (39808828839, 1 - 2.0**-24),
    (72185573230, 2.0**-24),
    (222803195212, 1 - 2.0**-24),
    (681235593984, 2.0**-24),
]


def close(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype, roundings: float = 2.0) -> None:
    """`got` within `roundings` of `dtype`'s rounding of `exact`'s largest value (bf16), or within
    fp32 reduction-order noise (fp32): the Triton kernels' tests (tests/kernels)."""
    step = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-20
    assert (got.float() - exact.float()).abs().max().item() <= roundings * step * exact.abs().max().item()


def chat_built_and_rendered(
    tokenizer, question: str, turns: list[tuple[str, str | None]], end_id: int, ends_turn: bool
) -> tuple[list[int], list[int]]:
    """A conversation built turn by turn as a generate_fn builds it (each model answer's ids, its
    end-of-turn `end_id` when `ends_turn`, then `rlx.agent.chat.chat_message_ids` of the tool's
    message where a turn has one), and the chat template's rendering of the whole with the
    generation prompt (what the next model turn continues), as ids."""
    from rlx.agent.chat import chat_message_ids

    def render(messages, prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    messages = [{"role": "user", "content": question}]
    tokens = render(messages, prompt=True)
    for answer, tool in turns:
        model = tokenizer(answer, add_special_tokens=False)["input_ids"] + [end_id] * ends_turn
        tokens += model
        messages.append({"role": "assistant", "content": answer})
        if tool is not None:
            tokens += chat_message_ids(tokenizer, "tool", tool, last_token=model[-1])
            messages.append({"role": "tool", "content": tool})
    return tokens, render(messages, prompt=True)
