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


def test_a_batch_names_the_sums_its_truncating_rows_need():
    """`truncate_sums` (what the GPU's truncating search counts): bit 1 where a truncating row
    has top_k under the vocabulary, bit 2 where one has top_p under 1; greedy rows and rows that
    truncate nothing add neither (they are not searched)."""
    vocab = 100

    def sums(*params: dict) -> int:
        seqs = [
            Sequence(i, GenerateRequest([1], SamplingParams(max_new_tokens=4, **p)), max_new=4, seed=0)
            for i, p in enumerate(params)
        ]
        return SamplingBatch.build(seqs, vocab, torch.device("cpu")).truncate_sums

    assert sums({"top_k": 5}) == 1
    assert sums({"top_p": 0.9}) == 2
    assert sums({"top_k": 5}, {"top_p": 0.9}) == 3
    assert sums({"top_k": 5, "top_p": 0.9}) == 3
    assert sums({"min_p": 0.1}) == 0
    assert sums({"top_k": 100, "top_p": 1.0, "min_p": 0.1}) == 0  # top_k at the vocabulary cuts nothing
    assert sums({"top_k": 500}, {"top_k": 5, "temperature": 0.0}, {"top_p": 0.5, "temperature": 0.0}) == 0
    assert sums({"top_p": 0.9, "temperature": 0.0}, {"top_k": 5}) == 1
