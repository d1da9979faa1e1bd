"""The torch sampler's seeded noise (rlx.engine.sampler.seeded_exponential; the CPU, and rows
with top-k / top-p / min-p on a GPU): a seeded row draws argmax(p / noise) with noise = -log(u),
u uniform from 24 bits of a hash of (seed, step, token). (2^24 - 1) + 0.5 rounds to 2^24 in
fp32, so a token whose 24 bits were all ones had u = 1 and a noise of 0, and won whatever its
probability: V / 2^24 of the draws (0.9% at Qwen's 151,936-way vocabulary) took a token at
random. u now stops below 1. Here on the CPU, through the torch sampler; the fused Triton sampler
draws by another rule (tests/unit/test_fused_draw_rule.py), its uniform's extremes checked in
tests/kernels/test_engine_kernels.py."""

from __future__ import annotations

import torch
from helpers import all_ones_draws  # tests/ is on sys.path (conftest)

from rlx.engine.sampler import Sampler, SamplingBatch, seeded_exponential
from rlx.engine.sequence import GenerateRequest, SamplingParams, Sequence


def test_the_noise_never_reaches_zero():
    vocab = 32768
    for seed, step, token in all_ones_draws(vocab, 3):
        noise = seeded_exponential(torch.tensor([seed]), torch.tensor([step]), vocab)[0]
        assert noise[token] > 0 and torch.isfinite(noise).all() and noise.min() > 0


def test_a_near_certain_token_is_drawn_whatever_the_others_hash_to():
    """Rows whose seed and step give some other token all-ones bits: with one token at
    probability 1 - 3e-9, each row still draws that token (before the fix: the other)."""
    vocab, certain = 32768, 11
    draws = all_ones_draws(vocab, 4)
    seqs = []
    for i, (seed, step, token) in enumerate(draws):
        assert token != certain
        request = GenerateRequest([1, 2], SamplingParams(max_new_tokens=8, sampling_seed=seed))
        seq = Sequence(i, request, max_new=8, seed=0)
        seq.token_ids += [3] * step  # `step` tokens already drawn: this draw is output index `step`
        seqs.append(seq)
    batch = SamplingBatch.build(seqs, vocab, torch.device("cpu"))
    assert batch.step_N.tolist() == [5] * len(draws)
    logits = torch.zeros(len(draws), vocab)
    logits[:, certain] = 30.0  # the others: exp(-30) each, 3e-9 together
    tokens, logprobs = Sampler(0, torch.device("cpu"))(logits, batch)
    assert tokens.tolist() == [certain] * len(draws)
    assert logprobs.max().item() <= 0 and logprobs.min().item() > -1e-4
