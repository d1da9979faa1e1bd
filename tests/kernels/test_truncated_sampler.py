"""The truncating sampler's kernel (rlx.engine.triton_truncate: top-k, top-p, min-p without a
sort) against its rule stated in torch (tests/helpers.py, `truncated_inverse_cdf`, which
tests/unit/test_fused_draw_rule.py checks against SGLang's), by hand, by frequency, and beside
the fused sampler: 2-byte logits (bf16 on a GPU, fp16 in Triton's CPU interpreter, which holds
no bf16) and fp32."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import (  # tests/ is on sys.path (conftest)
    EXTREME_UNIFORM_SEEDS,
    fused_uniform,
    truncated_inverse_cdf,
    truncation_kept,
)


def truncated_draw(logits, rows, inv_t, top_k, top_p, min_p, seed, step, shares=None):
    from rlx.engine.triton_truncate import truncated_sample

    n = logits.shape[0]
    tokens = torch.full((n,), -7, dtype=torch.int64, device=logits.device)
    logprobs = torch.full((n,), -7.0, device=logits.device)
    at = torch.tensor(rows, device=logits.device)
    truncated_sample(logits, at, inv_t, top_k, top_p, min_p, seed, step, tokens, logprobs, shares=shares)
    return tokens, logprobs


def two_byte(device) -> torch.dtype:
    """The logits of 16-bit keys: bf16 on a GPU, as the engine serves; fp16 in the interpreter,
    which holds no bf16 (the same kernels: 4 search passes, where fp32 takes 8)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float16


# None: default_shares (33 a row for 40 rows on 132 SMs; 2 interpreted, one SM)
@pytest.mark.parametrize("shares, wide", [(1, False), (3, False), (None, False), (3, True)])
def test_truncated_sampler_matches_its_rule(shares, wide, device):
    """Rows of top-k, top-p and min-p alone and together (4 of each setting on a GPU, 1
    interpreted), at temperatures 0.5-1.5, over Qwen's vocabulary on a GPU and 2,500 words
    interpreted (not a multiple of the kernel's tile), in 2-byte logits (many tied values) and
    fp32 (`wide`): the rule's tokens at any share count, logprobs within fp32 noise of
    log_softmax(logits / T) before truncation; rows not listed keep what was in the buffers."""
    dtype = torch.float32 if wide else two_byte(device)
    g = torch.Generator(device=device).manual_seed(0)
    vocab = 151936 if device.type == "cuda" else 2500
    settings = [  # top_k (vocab: off), top_p, min_p
        (vocab, 0.9, 0.0), (50, 1.0, 0.0), (1, 1.0, 0.0), (vocab, 1.0, 0.05), (20, 0.5, 0.0),
        (vocab, 0.05, 0.0), (1000, 0.95, 0.001), (vocab, 0.999, 0.0), (3, 0.2, 0.3), (vocab, 1.0, 0.0),
    ]  # fmt: skip
    copies = 4 if device.type == "cuda" else 1  # the interpreter runs a program at a time
    n = copies * len(settings)
    logits = (torch.randn(n, vocab, device=device, generator=g) * 4).to(dtype)
    top_k = torch.tensor([k for k, _, _ in settings] * copies, device=device)
    top_p = torch.tensor([p for _, p, _ in settings] * copies, device=device)
    min_p = torch.tensor([m for _, _, m in settings] * copies, device=device)
    inv_t = 1.0 / (torch.rand(n, device=device, generator=g) + 0.5)
    seed = torch.randint(0, 1 << 62, (n,), device=device, generator=g)
    step = torch.randint(0, 1000, (n,), device=device, generator=g)
    rows = list(range(0, n - 1))  # the last row is not drawn
    tokens, logprobs = truncated_draw(logits, rows, inv_t, top_k, top_p, min_p, seed, step, shares)
    expected = truncated_inverse_cdf(logits, inv_t, top_k, top_p, min_p, fused_uniform(seed, step))
    assert torch.equal(tokens[:-1], expected[:-1]), (tokens[:-1] != expected[:-1]).nonzero()[:, 0].tolist()
    assert tokens[-1].item() == -7 and logprobs[-1].item() == -7.0
    logp = (logits.float() * inv_t[:, None]).log_softmax(-1).gather(-1, expected[:, None])[:, 0]
    assert (logprobs[:-1] - logp[:-1]).abs().max().item() < 1e-4
    greedy = logits.float().argmax(-1)  # top_k 1 keeps the largest value, the lowest id of a tie
    assert torch.equal(tokens[2::10], greedy[2::10])


@pytest.mark.parametrize("wide", [False, True])
def test_truncated_sampler_finds_boundaries_far_below_the_maximum(wide, device):
    """The first pass tests values within 28.1 of the row's largest logit / T where top_k is at
    most 1,024 or top_p * Z at most 64; a boundary below them leaves the later passes the whole
    range under the first key, which they must still resolve to the boundary's own key. Logits
    falling with the id (40 down to -330) at T = 1,000 (every s within 0.4 of the maximum): top_k
    7 and 1,000 (pass 0 near the maximum, all its keys below the row), half the vocabulary, top_p
    0.5 (Z near the vocabulary's size: even keys); the last kept token, the boundary, is the
    highest id kept, which a uniform of 1 - 2^-24 draws (a boundary found a few keys high drops
    it); and at T = 2e-6 (every offset under the logits' rounding): the rule's tokens, logprobs."""
    dtype = torch.float32 if wide else two_byte(device)
    vocab = 1200  # few enough that the largest logits stay apart in bf16
    cases = [(7, 1.0, 1000.0), (1000, 1.0, 1000.0), (vocab // 2, 1.0, 1000.0), (vocab, 0.5, 1000.0)]
    cases += [(7, 1.0, 2e-6), (vocab, 0.5, 2e-6)]  # top_k, top_p, T
    n = len(cases)
    logits = (40.0 - 370.0 * torch.arange(vocab, device=device) / vocab).expand(n, vocab).to(dtype)
    top_k = torch.tensor([k for k, _, _ in cases], device=device)
    top_p = torch.tensor([p for _, p, _ in cases], device=device)
    inv_t = 1.0 / torch.tensor([t for _, _, t in cases], device=device)
    top_seed = [seed for seed, u in EXTREME_UNIFORM_SEEDS if u > 0.5][0]
    seed = torch.full((n,), top_seed, device=device)
    step = torch.full((n,), 5, device=device)
    min_p = torch.zeros(n, device=device)
    tokens, logprobs = truncated_draw(logits, list(range(n)), inv_t, top_k, top_p, min_p, seed, step)
    expected = truncated_inverse_cdf(logits, inv_t, top_k, top_p, min_p, fused_uniform(seed, step))
    kept, _ = truncation_kept(logits, inv_t, top_k, top_p, min_p)
    last_kept = torch.where(kept, torch.arange(vocab, device=device), -1).amax(-1)
    assert torch.equal(expected[:4], last_kept[:4]) and expected[4:].tolist() == [0, 0]  # the rows' design
    assert torch.equal(tokens, expected), (tokens.tolist(), expected.tolist())
    s = logits.float() * inv_t[:, None]
    logp = s.log_softmax(-1).gather(-1, expected[:, None])[:, 0]
    # within fp32's resolution of logit / T: at T = 2e-6, s is 2e7, its unit in the last place 2
    # (a kernel's product may be fused into the subtraction and rounded once, not twice)
    resolution = 4 * torch.finfo(torch.float32).eps * s.abs().amax(-1)
    assert ((logprobs - logp).abs() <= 1e-4 + resolution).all(), (logprobs - logp).abs().tolist()


@pytest.mark.parametrize(
    "sums, settings",
    [
        (1, [(50, 1.0, 0.0), (1, 1.0, 0.0), (7, 1.0, 0.0), (1000, 1.0, 0.01)]),  # top_k alone: counts
        (2, [(None, 0.9, 0.0), (None, 0.05, 0.0), (None, 0.999, 0.0), (None, 0.5, 0.001)]),  # top_p: masses
        (0, [(None, 1.0, 0.05), (None, 1.0, 0.3)]),  # min_p alone: no search sums
    ],
)
def test_truncated_sampler_counts_only_what_its_rows_bound(sums, settings, device):
    """A batch whose rows have no top_p (`sums` 1), no top_k (2), or neither (0) is searched
    without the sums none of them needs, and draws the rule's tokens. Integer logits (randn × 3:
    many tokens tie at each value), token 0 set to the row's boundary value v (the lowest kept):
    the first tie at v by id, which top_k and top_p always keep (the ties kept are counted from
    the blocks, not from the passes' counts, which are 0 where not summed) and a seed of uniform
    2^-24 draws (the first kept token); on a GPU, random seeds too."""
    dtype = two_byte(device)
    g = torch.Generator(device=device).manual_seed(5)
    vocab, copies = (151936, 2) if device.type == "cuda" else (1200, 1)
    n = copies * len(settings)
    logits = (torch.randn(n, vocab, device=device, generator=g) * 3).round().to(dtype)
    top_k = torch.tensor([vocab if k is None else k for k, _, _ in settings] * copies, device=device)
    top_p = torch.tensor([p for _, p, _ in settings] * copies, device=device)
    min_p = torch.tensor([m for _, _, m in settings] * copies, device=device)
    inv_t = torch.ones(n, device=device)
    kept, _ = truncation_kept(logits, inv_t, top_k, top_p, min_p)
    logits[:, 0] = torch.where(kept, logits.float(), float("inf")).amin(-1).to(dtype)  # v stays the boundary
    low_seed = [seed for seed, u in EXTREME_UNIFORM_SEEDS if u < 0.5][0]
    seed = torch.tensor(
        ([low_seed] * len(settings) + [17 + i for i in range(len(settings))])[:n], device=device
    )
    step = torch.full((n,), 5, device=device)
    from rlx.engine.triton_truncate import truncated_sample

    tokens = torch.full((n,), -7, dtype=torch.int64, device=device)
    logprobs = torch.full((n,), -7.0, device=device)
    rows = torch.arange(n, device=device)
    truncated_sample(logits, rows, inv_t, top_k, top_p, min_p, seed, step, tokens, logprobs, sums=sums)
    expected = truncated_inverse_cdf(logits, inv_t, top_k, top_p, min_p, fused_uniform(seed, step))
    assert expected[: len(settings)].tolist() == [0] * len(settings)  # the design: token 0 kept, drawn
    assert torch.equal(tokens, expected), (tokens.tolist(), expected.tolist())


def test_truncated_sampler_draws_by_hand(device):
    """Logits 1, 3, 3, 0, 3, 2, -1, 3 (exact in bf16), T = 1: the four 3s hold mass 1 each
    (exp(s - m)), the row's Z = 4 + e^-1 + e^-2 + e^-3 + e^-4 = 4.5713. top_k 2 keeps ids 1, 2 (a
    tie goes to the lowest ids); top_p 0.5 (budget 2.2857) ids 1, 2, 4 (the mass before id 7 is
    3); top_p 0.9 (4.114) the four 3s and the 2 at id 5 (mass before it 4, before id 0 4.37);
    min_p 0.5 the four 3s; top_k 3 with top_p 0.9 ids 1, 2, 4. Each seed's u picks the first kept
    token whose kept mass from id 0 passes u times the kept total: 64 seeds a case on a GPU; in
    the interpreter, one seed for each kept token (from 200, by that rule), all cases in one call;
    logprob s - m - log Z at each."""
    dtype = two_byte(device)
    logits_8 = [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, -1.0, 3.0]
    z = sum(math.exp(x - 3.0) for x in logits_8)
    cases = [  # top_k, top_p, min_p, kept ids, their masses
        (2, 1.0, 0.0, [1, 2], [1.0, 1.0]),
        (8, 0.5, 0.0, [1, 2, 4], [1.0, 1.0, 1.0]),
        (8, 0.9, 0.0, [1, 2, 4, 5, 7], [1.0, 1.0, 1.0, math.exp(-1.0), 1.0]),
        (8, 1.0, 0.5, [1, 2, 4, 7], [1.0, 1.0, 1.0, 1.0]),
        (3, 0.9, 0.0, [1, 2, 4], [1.0, 1.0, 1.0]),
    ]
    pool = torch.arange(200) * 7919 + 1
    u = fused_uniform(pool, torch.full_like(pool, 5)).double()
    seeds, params, expected = [], [], []
    for top_k, top_p, min_p, kept, mass in cases:
        cum = torch.tensor(mass, dtype=torch.float64).cumsum(0)
        drawn = [kept[i] for i in torch.searchsorted(cum, u * cum[-1], right=True).tolist()]
        assert set(drawn) == set(kept)  # the pool reaches every kept token
        chosen = range(64) if device.type == "cuda" else [drawn.index(t) for t in kept]
        seeds += [pool[i].item() for i in chosen]
        expected += [drawn[i] for i in chosen]
        params += [(top_k, top_p, min_p)] * len(chosen)
    n = len(seeds)
    seed = torch.tensor(seeds, device=device)
    logits = torch.tensor([logits_8], device=device).expand(n, 8).contiguous().to(dtype)
    tokens, logprobs = truncated_draw(
        logits, list(range(n)), torch.ones(n, device=device),
        *(torch.tensor(c, device=device) for c in zip(*params, strict=True)), seed, torch.full_like(seed, 5),
    )  # fmt: skip
    assert tokens.cpu().tolist() == expected
    s = torch.tensor(logits_8)[tokens.cpu()] - 3.0
    assert (logprobs.cpu() - (s - math.log(z))).abs().max().item() < 1e-5


def test_truncated_sampler_draws_follow_the_distribution(device):
    """One distribution at many seeds, T = 1, top_p 0.8: exp(x - 3) of logits 0, 1, 2, -1, 0.5, 3
    is 0.050, 0.135, 0.368, 0.018, 0.082, 1 (Z 1.653, budget 1.323): ids 5 and 2 are kept (mass
    before id 1: 1.368), no other id is drawn, and on a GPU (20,000 seeds) each is drawn 1 / 1.368
    and 0.368 / 1.368 of the time, within 5 standard deviations (interpreted, 24 seeds: both
    drawn; the frequencies of the rule itself: tests/unit/test_fused_draw_rule.py)."""
    dtype = two_byte(device)
    rows = 20_000 if device.type == "cuda" else 24
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5, 3.0]], device=device).expand(rows, 6).contiguous()
    seed = torch.arange(rows, device=device) * 7919 + 1
    step = torch.full_like(seed, 7)
    ones = torch.ones(rows, device=device)
    tokens, _ = truncated_draw(
        logits.to(dtype), list(range(rows)), ones, torch.full((rows,), 6, device=device),
        torch.full((rows,), 0.8, device=device), torch.zeros(rows, device=device), seed, step,
    )  # fmt: skip
    counts = torch.bincount(tokens.cpu(), minlength=6).tolist()
    p5 = 1 / (1 + math.exp(-1.0))
    assert counts[0] == counts[1] == counts[3] == counts[4] == 0 and counts[2] and counts[5], counts
    for count, p in ((counts[5], p5), (counts[2], 1 - p5)) if device.type == "cuda" else ():
        assert abs(count / rows - p) <= 5 * math.sqrt(p * (1 - p) / rows), counts


def test_truncated_sampler_that_cuts_nothing_draws_the_fused_samplers_token(device):
    """top_k off, top_p 1, min_p 0: the kernel draws what the fused sampler draws for the row
    (one rule, one uniform), and its logprob."""
    dtype = two_byte(device)
    from rlx.engine.triton_sample import fused_sample

    g = torch.Generator(device=device).manual_seed(3)
    rows, vocab = (16, 151936) if device.type == "cuda" else (6, 3000)
    logits = (torch.randn(rows, vocab, device=device, generator=g) * 3).to(dtype)
    inv_t = 1.0 / (torch.rand(rows, device=device, generator=g) + 0.5)
    seed = torch.randint(0, 1 << 62, (rows,), device=device, generator=g)
    step = torch.randint(0, 1000, (rows,), device=device, generator=g)
    fused_tokens = torch.empty(rows, dtype=torch.int64, device=device)
    fused_logprobs = torch.empty(rows, device=device)
    zeros = torch.zeros(rows, dtype=torch.int32, device=device)
    fused_sample(logits, inv_t, zeros, seed, step, fused_tokens, fused_logprobs)
    tokens, logprobs = truncated_draw(
        logits, list(range(rows)), inv_t, torch.full((rows,), vocab, device=device), torch.ones(rows, device=device),
        torch.zeros(rows, device=device), seed, step,
    )  # fmt: skip
    assert torch.equal(tokens, fused_tokens)
    assert (logprobs - fused_logprobs).abs().max().item() < 1e-4


def test_truncated_sampler_keeps_a_row_of_nan_logits_to_itself(device):
    """NaN logits (a diverged model) get an id inside the vocabulary and a NaN logprob; the
    other rows draw what they draw without that row."""
    dtype = two_byte(device)
    g = torch.Generator(device=device).manual_seed(1)
    vocab = 2500
    logits = (torch.randn(3, vocab, device=device, generator=g) * 3).to(dtype)
    args = (
        torch.ones(3, device=device), torch.tensor([50, vocab, 5], device=device),
        torch.tensor([0.9, 0.5, 1.0], device=device), torch.zeros(3, device=device),
        torch.tensor([1, 2, 3], device=device), torch.zeros(3, dtype=torch.int64, device=device),
    )  # fmt: skip
    clean, _ = truncated_draw(logits, [0, 1, 2], *args)
    broken = logits.clone()
    broken[1] = float("nan")
    tokens, logprobs = truncated_draw(broken, [0, 1, 2], *args)
    assert 0 <= tokens[1].item() < vocab and logprobs[1].isnan().item()
    assert tokens[0].item() == clean[0].item() and tokens[2].item() == clean[2].item()
