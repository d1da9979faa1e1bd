"""Next tokens and their logprobs for a batch of rows, on the logits' device, in a few kernels.

SGLang's semantics (`sglang/srt/layers/sampler.py`): the logprob is
log_softmax(logits / temperature) in fp32 at the chosen token, before truncation; greedy rows
(temperature < 1e-6) take the argmax and report log_softmax(logits). A draw is the
exponential race argmax(p / E) with E ~ Exp(1), as vLLM and SGLang draw.

Randomness: a row with `sampling_seed` takes E from a counter-based hash of (seed, output
index, token id), so its stream is its own: the same draws alone or in any batch, and after a
preemption recomputes it. On CPU, rows without a seed take E from the engine's generator, one
kernel for the whole batch. On CUDA every row is seeded (the request's own seed where it set
none, drawn from the engine's seed when the request arrived), and rows without
top-k/top-p/min-p go through the fused Triton sampler (`triton_sample`, also captured in the
decode CUDA graphs), which draws the same distribution by another rule, cheaper a token: the
first token, in id order, whose cumulative probability passes one uniform from the row's hash
(`row_hash`). Truncating rows are drawn again after it, by the same rule over what they keep
(`triton_truncate`, no sort). The CPU takes the torch path below, which keeps the exponential
race (the CPU's recorded runs, tests/golden, drew so).
Nothing here reads a tensor back to the host or waits for the GPU (`upload`).

Legend: N rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlx.engine.sequence import Sequence
from rlx.engine.step_inputs import upload


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
UNIFORM_MAX = 1.0 - 2.0**-24  # the largest fp32 below 1: the seeded noise's uniform never reaches 1


@dataclass
class SamplingBatch:
    """Per-row parameters as device tensors, plus which work the batch needs at all."""

    temperature_N: torch.Tensor
    inv_temperature_N: torch.Tensor  # 1 / T rounded once on the host, as the graphs get it
    greedy_N: torch.Tensor
    top_k_N: torch.Tensor
    top_p_N: torch.Tensor
    min_p_N: torch.Tensor
    seed_N: torch.Tensor  # int64; rows without a seed hold 0
    step_N: torch.Tensor  # int64 output index of the token being drawn
    seeded_rows: torch.Tensor | None  # indices of rows with their own seed
    all_greedy: bool
    truncate: bool
    truncate_rows: list[int]  # rows that need top-k / top-p / min-p
    # what the truncating sampler's search sums over its rows (`search_sums`, `truncated_sample`)
    truncate_sums: int = 3

    @classmethod
    def build(cls, seqs: list[Sequence], vocab: int, device: torch.device) -> SamplingBatch:
        params = [s.sampling for s in seqs]
        greedy = [p.greedy for p in params]
        top_k = [
            vocab if g or p.top_k < 0 else min(p.top_k, vocab) for g, p in zip(greedy, params, strict=True)
        ]
        seeded = [i for i, p in enumerate(params) if p.sampling_seed is not None and not greedy[i]]
        truncate_rows = [i for i, p in enumerate(params) if p.truncates(vocab)]
        # one host-to-device copy for all float and all int fields
        floats = upload(
            torch.tensor(
                [
                    [1.0 if g else p.temperature, p.top_p, p.min_p, inverse_temperature(p)]
                    for g, p in zip(greedy, params, strict=True)
                ],
                dtype=torch.float32,
            ),
            device,
        )
        ints = upload(
            torch.tensor(
                [
                    [k, row_seed(s) if device.type == "cuda" else p.sampling_seed or 0, s.num_output, g]
                    for k, p, s, g in zip(top_k, params, seqs, greedy, strict=True)
                ],
                dtype=torch.int64,
            ),
            device,
        )
        return cls(
            temperature_N=floats[:, 0],
            inv_temperature_N=floats[:, 3],
            greedy_N=ints[:, 3].bool(),
            top_k_N=ints[:, 0],
            top_p_N=floats[:, 1],
            min_p_N=floats[:, 2],
            seed_N=ints[:, 1],
            step_N=ints[:, 2],
            seeded_rows=upload(torch.tensor(seeded), device) if seeded else None,
            all_greedy=all(greedy),
            truncate=bool(truncate_rows),
            truncate_rows=truncate_rows,
            truncate_sums=search_sums(
                [top_k[i] for i in truncate_rows], [params[i].top_p for i in truncate_rows], vocab
            ),
        )


def search_sums(top_k: list[int], top_p: list[float], vocab: int) -> int:
    """`truncated_sample`'s `sums` for truncating rows of these top_k (the vocabulary where off)
    and top_p: 1 where one has top_k (token counts), 2 where one has top_p (mass), both, or 0."""
    return int(any(k < vocab for k in top_k)) | 2 * any(p < 1.0 for p in top_p)


def row_seed(seq: Sequence) -> int:
    """The hash key of a row's draws: its sampling_seed, else the seed the engine gave it."""
    seed = seq.sampling.sampling_seed
    return seq.seed if seed is None else seed


def inverse_temperature(params) -> float:
    """What the fused pass multiplies logits by: 1 / T, or 1 for greedy rows (raw log_softmax)."""
    return 1.0 if params.greedy else 1.0 / params.temperature


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits_NV: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if logits_NV.device.type != "cuda":
            return self.sample_torch(logits_NV, batch)
        from rlx.engine.triton_sample import fused_sample

        rows = logits_NV.shape[0]
        tokens_N = torch.empty(rows, dtype=torch.int64, device=logits_NV.device)
        logprobs_N = torch.empty(rows, dtype=torch.float32, device=logits_NV.device)
        greedy_N = batch.greedy_N.to(torch.int32)
        fused_sample(  # 1 / T as the graphs get it (rounded once on the host), so a row draws
            # the same whether its step ran in a graph or eagerly
            logits_NV,
            batch.inv_temperature_N,
            greedy_N,
            batch.seed_N,
            batch.step_N,
            tokens_N,
            logprobs_N,
        )
        if batch.truncate_rows:
            self.resample_truncated(logits_NV, batch, tokens_N, logprobs_N)
        return tokens_N, logprobs_N

    def resample_truncated(
        self,
        logits_NV: torch.Tensor,
        batch: SamplingBatch,
        tokens_N: torch.Tensor,
        out_logprobs_N: torch.Tensor,
    ) -> None:
        """Overwrite the fused pass's choice for rows with top-k / top-p / min-p, in place, on
        CUDA (`triton_truncate`, without a sort; the CPU draws every row in `sample_torch`):
        tokens_N and out_logprobs_N may be of any dtype, e.g. one fp32 readback buffer."""
        from rlx.engine.triton_truncate import truncated_sample

        at = upload(torch.tensor(batch.truncate_rows), logits_NV.device)
        truncated_sample(
            logits_NV, at, batch.inv_temperature_N, batch.top_k_N, batch.top_p_N, batch.min_p_N,
            batch.seed_N, batch.step_N, tokens_N, out_logprobs_N, sums=batch.truncate_sums,
        )  # fmt: skip

    def sample_torch(
        self, logits_NV: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits_NV = logits_NV.float()
        logp_NV = torch.log_softmax(logits_NV / batch.temperature_N[:, None], dim=-1)
        if batch.all_greedy:
            tokens_N = logits_NV.argmax(-1)
        else:
            probs_NV = logp_NV.exp()
            if batch.truncate:
                probs_NV = truncate(probs_NV, batch)
            noise_NV = torch.empty_like(probs_NV).exponential_(generator=self.generator)
            if batch.seeded_rows is not None:
                rows = batch.seeded_rows
                noise_NV[rows] = seeded_exponential(batch.seed_N[rows], batch.step_N[rows], probs_NV.shape[1])
            sampled_N = (probs_NV / noise_NV.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(-1)
            tokens_N = torch.where(batch.greedy_N, logits_NV.argmax(-1), sampled_N)
        return tokens_N, logp_NV.gather(-1, tokens_N[:, None])[:, 0]


def truncate(probs_NV: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Zero what top-k, top-p and min-p cut (SGLang's top_k_top_p_min_p_sampling), unrenormalised:
    the exponential race does not need normalised probabilities."""
    vocab = probs_NV.shape[-1]
    sorted_NV, index_NV = probs_NV.sort(dim=-1, descending=True)
    keep_NV = torch.arange(vocab, device=probs_NV.device)[None, :] < batch.top_k_N[:, None]
    keep_NV &= (sorted_NV.cumsum(-1) - sorted_NV) <= batch.top_p_N[:, None]
    keep_NV &= sorted_NV >= batch.min_p_N[:, None] * sorted_NV[:, :1]
    return torch.zeros_like(probs_NV).scatter_(-1, index_NV, sorted_NV * keep_NV)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (right shifts masked to act as logical shifts)."""
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * _MIX1
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * _MIX2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def seeded_exponential(seed_R: torch.Tensor, step_R: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [R, V] that depends only on (seed, step, token id): -log(u) for u uniform on
    (0, 1) from 24 bits of a hash. u stops at the largest fp32 below 1: (2^24 - 1) + 0.5 rounds
    to 2^24 in fp32, and a noise of 0 made its token win whatever its probability (a token in
    V / 2^24 of the draws: 0.9% at a 151,936-way vocabulary). triton_sample does the same."""
    bits_RV = seeded_bits(seed_R, step_R, vocab)
    uniform_RV = ((bits_RV.float() + 0.5) * (1.0 / (1 << 24))).clamp_(max=UNIFORM_MAX)
    return -torch.log(uniform_RV)


def seeded_bits(seed_R: torch.Tensor, step_R: torch.Tensor, vocab: int) -> torch.Tensor:
    """The 24 hash bits [R, V] (int64) of each (seed, step, token id) that its noise comes from."""
    token_V = torch.arange(vocab, device=seed_R.device, dtype=torch.int64)
    return (_mix(row_hash(seed_R, step_R)[:, None] + token_V[None, :] * _GOLDEN) >> 40) & ((1 << 24) - 1)


def row_hash(seed_R: torch.Tensor, step_R: torch.Tensor) -> torch.Tensor:
    """The hash (int64) of each row's (seed, step) that its draws come from: the key of the
    per-token hash above; the fused sampler's uniform is its top 23 bits (`triton_sample`)."""
    return _mix(seed_R * _GOLDEN + _mix(step_R + 1))
