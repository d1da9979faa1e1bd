"""The rule the engine's fused Triton sampler draws by (rlx.engine.triton_sample), stated in torch
in tests/helpers.py: the first token, in id order, whose cumulative probability passes u times
the total, with u = (b + 0.5) / 2^23 from the top 23 bits of the row's hash of (seed, output
index). tests/kernels/test_engine_kernels.py checks the kernels against it; here, on the CPU,
the rule itself."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import (  # tests/ is on sys.path (conftest)
    EXTREME_UNIFORM_SEEDS,
    fused_uniform,
    inverse_cdf,
    truncated_inverse_cdf,
    truncation_kept,
)


def test_the_uniform_stays_inside_0_1_at_its_extreme_hashes():
    """All-ones bits give 1 - 2^-24, all-zeros 2^-24 (exact in fp32): never 1, where a draw would
    fall past the last token, nor 0."""
    seeds = torch.tensor([s for s, _ in EXTREME_UNIFORM_SEEDS])
    u = fused_uniform(seeds, torch.full_like(seeds, 5))
    assert u.tolist() == [v for _, v in EXTREME_UNIFORM_SEEDS]


def test_inverse_cdf_by_hand():
    """Cumulative 1/8, 3/8, 3/4, 1 (exact in binary): a draw takes the first token whose
    cumulative sum passes u (u on a boundary takes the next token); unnormalised probabilities
    give the same tokens; a token of probability 0 is never drawn."""
    u = torch.tensor([1 / 16, 1 / 8, 1 / 2, 3 / 4, 0.999])
    probs = torch.tensor([[0.125, 0.25, 0.375, 0.25]]).expand(5, 4)
    assert inverse_cdf(probs, u).tolist() == [0, 1, 2, 3, 3]
    assert inverse_cdf(probs * 3, u).tolist() == [0, 1, 2, 3, 3]
    cut = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).expand(5, 4)
    assert inverse_cdf(cut, u).tolist() == [1, 1, 3, 3, 3]


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_hashed_draws_follow_the_distribution(temperature):
    """20,000 seeds at one output index: each token's frequency within 5 standard deviations of
    softmax(logits / T) computed by hand."""
    logits = [0.0, 1.0, 2.0, -1.0, 0.5, 3.0]
    weights = [math.exp(x / temperature) for x in logits]
    expected = [w / sum(weights) for w in weights]
    n = 20_000
    seeds = torch.arange(1000, 1000 + n) * 7919 + 1
    tokens = inverse_cdf(
        torch.tensor([weights]).expand(n, 6), fused_uniform(seeds, torch.full_like(seeds, 7))
    )
    counts = torch.bincount(tokens, minlength=6).tolist()
    for count, p in zip(counts, expected, strict=True):
        assert abs(count / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (counts, expected)


def test_successive_output_indices_draw_independently():
    """One seed over 20,000 output indices: the same frequencies (the uniform moves with the
    index), and a draw does not predict the next (pairs of tokens 0 | 1 at 1/4 each)."""
    n = 20_000
    steps = torch.arange(n)
    tokens = inverse_cdf(
        torch.tensor([[1.0, 1.0]]).expand(n, 2), fused_uniform(torch.full_like(steps, 12345), steps)
    )
    assert abs(tokens.float().mean().item() - 0.5) <= 5 * math.sqrt(0.25 / n)
    pairs = torch.bincount(tokens[:-1] * 2 + tokens[1:], minlength=4) / (n - 1)
    assert (pairs - 0.25).abs().max().item() <= 5 * math.sqrt(0.25 * 0.75 / n), pairs.tolist()


def test_truncation_keeps_what_sglangs_rule_keeps_and_breaks_ties_by_id():
    """The truncating sampler's rule (tests/helpers.py, `truncation_kept`) keeps the tokens
    that the torch path's `sampler.truncate` (SGLang's top_k_top_p_min_p) keeps, on fp32 logits
    without ties, for top-k, top-p and min-p alone and together; and where values tie, top-k keeps
    the lowest ids: logits 3 at ids 1, 2, 4, 7 with top_k 2 keep ids 1 and 2 whatever u is."""
    from rlx.engine.sampler import truncate

    g = torch.Generator().manual_seed(0)
    rows, vocab = 12, 500
    logits = torch.randn(rows, vocab, generator=g) * 3
    inv_t = torch.rand(rows, generator=g) + 0.5
    top_k = torch.tensor([vocab, 7, vocab, vocab, 40, 1, vocab, 300, vocab, 3, 60, vocab])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.3, 0.8, 1.0, 1.0, 0.95, 0.05, 1.0, 0.5, 0.99])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.01, 0.0, 0.5, 0.02, 0.001])
    probs = (logits * inv_t[:, None]).softmax(-1)
    batch = SimpleNamespace(top_k_N=top_k, top_p_N=top_p, min_p_N=min_p)
    sglang_kept = truncate(probs, batch) > 0
    kept, _ = truncation_kept(logits, inv_t, top_k, top_p, min_p)
    assert torch.equal(kept, sglang_kept)
    assert kept[0].all() and kept[1:].sum(-1).max() < vocab  # row 0 cuts nothing, the others some
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0, -1.0, 3.0]]).expand(5, 8)
    u = torch.tensor([0.01, 0.3, 0.49, 0.51, 0.99])
    one = torch.ones(5)
    drawn = truncated_inverse_cdf(ties, one, torch.full((5,), 2), one, torch.zeros(5), u)
    assert drawn.tolist() == [1, 1, 1, 2, 2]
