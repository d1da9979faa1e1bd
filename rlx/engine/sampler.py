"""Next tokens and their logprobs for a batch of rows, on the logits' device, in a few kernels.

SGLang's semantics (`sglang/srt/layers/sampler.py`): the logprob is
log_softmax(logits / temperature) in fp32 at the chosen token, before truncation; greedy rows
(temperature < 1e-6) take the argmax and report log_softmax(logits). A draw is the
exponential race argmax(p / E) with E ~ Exp(1), as vLLM and SGLang draw.

Randomness: rows without a seed take E from the engine's generator, one kernel for the whole
batch. A row with `sampling_seed` takes E from a counter-based hash of (seed, output index,
token id), so its stream is its own: the same draws alone or in any batch, and after a
preemption recomputes it. Nothing here reads a tensor back to the host.

Legend: N rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlx.engine.sequence import Sequence


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


@dataclass
class SamplingBatch:
    """Per-row parameters as device tensors, plus which work the batch needs at all."""

    temperature_N: torch.Tensor
    greedy_N: torch.Tensor
    top_k_N: torch.Tensor
    top_p_N: torch.Tensor
    min_p_N: torch.Tensor
    seed_N: torch.Tensor  # int64; rows without a seed hold 0
    step_N: torch.Tensor  # int64 output index of the token being drawn
    seeded_rows: torch.Tensor | None  # indices of rows with their own seed
    all_greedy: bool
    truncate: bool

    @classmethod
    def build(cls, seqs: list[Sequence], vocab: int, device: torch.device) -> SamplingBatch:
        params = [s.sampling for s in seqs]
        greedy = [p.greedy for p in params]
        top_k = [
            vocab if g or p.top_k < 0 else min(p.top_k, vocab) for g, p in zip(greedy, params, strict=True)
        ]
        seeded = [i for i, p in enumerate(params) if p.sampling_seed is not None and not greedy[i]]
        # one host-to-device copy for all float and all int fields
        floats = torch.tensor(
            [[1.0 if g else p.temperature, p.top_p, p.min_p] for g, p in zip(greedy, params, strict=True)],
            dtype=torch.float32,
        ).to(device, non_blocking=True)
        ints = torch.tensor(
            [
                [k, p.sampling_seed or 0, s.num_output, g]
                for k, p, s, g in zip(top_k, params, seqs, greedy, strict=True)
            ],
            dtype=torch.int64,
        ).to(device, non_blocking=True)
        return cls(
            temperature_N=floats[:, 0],
            greedy_N=ints[:, 3].bool(),
            top_k_N=ints[:, 0],
            top_p_N=floats[:, 1],
            min_p_N=floats[:, 2],
            seed_N=ints[:, 1],
            step_N=ints[:, 2],
            seeded_rows=torch.tensor(seeded, device=device) if seeded else None,
            all_greedy=all(greedy),
            truncate=any(k < vocab for k in top_k) or any(p.top_p < 1.0 or p.min_p > 0.0 for p in params),
        )


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits_NV: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
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
    """Exp(1) noise [R, V] that depends only on (seed, step, token id)."""
    row_R = _mix(seed_R * _GOLDEN + _mix(step_R + 1))
    token_V = torch.arange(vocab, device=seed_R.device, dtype=torch.int64)
    bits_RV = (_mix(row_R[:, None] + token_V[None, :] * _GOLDEN) >> 40) & ((1 << 24) - 1)
    uniform_RV = (bits_RV.float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform_RV)
