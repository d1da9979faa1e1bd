"""The engine's Triton kernels (rlx.engine.triton_decode, triton_layers, triton_sample) against the
torch code they replace: bf16 on a GPU, fp32 in Triton's CPU interpreter (conftest.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    EXTREME_UNIFORM_SEEDS,
    close,
    fused_uniform,
    inverse_cdf,
)  # tests/ is on sys.path (conftest)


def decode_error(device, dtype, heads, kv_heads, dim, page, num_splits, kv_dtype=None, **settings) -> float:
    """The kernel's largest difference from gather + SDPA over the same cache (`kv_dtype`, None:
    the queries' `dtype`): rows of 1 token to a whole table of 20 pages of 16 tokens' worth."""
    from rlx.engine.attention import gather_attention
    from rlx.engine.triton_decode import paged_decode

    g = torch.Generator(device=device).manual_seed(0)
    blocks, table = 64 * 16 // page, 20 * 16 // page
    k_cache, v_cache = (
        torch.randn(blocks, kv_heads, page, dim, device=device, generator=g).to(kv_dtype or dtype)
        for _ in "kv"
    )
    lens = torch.tensor([1, 17, 64, 300, 1000 % 320], device=device, dtype=torch.int32)
    tables = torch.randint(1, blocks, (5, table), device=device, generator=g, dtype=torch.int32)
    q = torch.randn(5, heads, dim, device=device, generator=g).to(dtype)
    out = paged_decode(q, k_cache, v_cache, tables, lens, dim**-0.5, num_splits=num_splits, **settings)
    mask = (torch.arange(table * page, device=device)[None, :] < lens[:, None])[:, None, None, :]
    ref = gather_attention(q[:, :, None], k_cache, v_cache, tables.long(), mask, dim**-0.5)[:, :, 0]
    return (out.float() - ref.float()).abs().max().item()


# None: default_splits (8 for 10 programs on a GPU, 1 interpreted)
@pytest.mark.parametrize("num_splits", [1, 2, 8, None])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,page",
    [(16, 2, 128, 16), (9, 3, 64, 16), (32, 2, 128, 64), (4, 4, 64, 1)],
    ids=["group 8", "SmolLM2's group of 3", "GLM-4's group of 16, pages of 64", "no grouping, pages of 1"],
)
def test_paged_decode_matches_gather_attention(num_splits, heads, kv_heads, dim, page, device, dtype):
    """Rows of 1 token to a whole table, each context split into shares (flash-decoding) or not:
    with 8 shares the 1-token and 17-token rows have empty shares, which must merge with weight 0.
    Query groups of the families the engine serves, padded to the kernel's 16-row tiles."""
    error = decode_error(device, dtype, heads, kv_heads, dim, page, num_splits)
    assert error < (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize(
    "heads,kv_heads,per_program,block_n",
    [(16, 8, 4, 16), (16, 8, 2, 32), (32, 4, 4, 16), (4, 4, 4, 16)],
    ids=["Qwen3's group of 2, 4 heads", "2 heads, 32-token tiles", "group 8: 32 query rows", "no grouping"],
)
def test_paged_decode_with_several_kv_heads_a_program(
    num_splits, heads, kv_heads, per_program, block_n, device, dtype
):
    """`heads_per_program` (many rows on sm90: `launch_settings`): a program's tile holds each of
    its KV heads' tokens side by side and each query keeps its own head's keys; the same output."""
    error = decode_error(
        device, dtype, heads, kv_heads, 128, 16, num_splits, heads_per_program=per_program, block_n=block_n
    )
    assert error < (2e-2 if dtype == torch.bfloat16 else 1e-5)


# None: launch_settings (on an sm90 GPU one-byte tiles of 128 tokens, 5 stages, 4 shares)
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_paged_decode_reads_an_fp8_cache(kv_dtype, num_splits, device, dtype):
    """`kv_cache_dtype=fp8_*`: the kernel widens the cache's one-byte tiles as they arrive (to
    fp16 beside bf16 queries); against gather + SDPA over the same cache read back in the queries'
    dtype, as closely as with a cache in that dtype (above)."""
    error = decode_error(device, dtype, 16, 8, 128, 16, num_splits, kv_dtype)
    assert error < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_the_decode_kernels_launch_settings_follow_the_rows_and_the_caches_element_size(device, monkeypatch):
    """(tile tokens, pipeline stages, context shares, KV heads a program), hand-computed for 8 KV
    heads (Qwen3's) on a 132-SM GPU: 2-byte caches split below two programs an SM (264), and from
    15 (sequence, KV head) pairs an SM (1,980: 248 rows) on sm90 take four heads' 16-token tiles
    a program, 2 stages; one-byte ones (fp8, sm90+) split below one (132) and take 128-token tiles
    up to four programs an SM (528 programs: 66 rows)."""
    import rlx.engine.triton_decode as td  # (`device`: where Triton imports, as the others)

    monkeypatch.setattr(td, "_sm_count", lambda index: 132)
    sm90 = True
    monkeypatch.setattr(td, "_sm90", lambda index: sm90)
    gpu = torch.device("cuda", 0)

    def settings(rows: int, kv_bytes: int) -> tuple[int, int, int, int]:
        return tuple(td.launch_settings(rows, 8, kv_bytes, gpu).values())

    # 16 rows: 128 programs, x2 = 256 < 264, x4 = 512; 32 rows: 256, x2 = 512; 64 rows: 512;
    # 247 rows: 1,976 pairs < 1,980; 248: 1,984
    assert [settings(r, 2) for r in (16, 32, 64, 247, 248, 1024)] == [
        (64, 4, 4, 1), (64, 4, 2, 1), (64, 4, 1, 1), (64, 4, 1, 1), (16, 2, 1, 4), (16, 2, 1, 4)
    ]  # fmt: skip
    # 16 rows: 128 < 132, x2; 32 rows: 256 >= 132
    assert [settings(r, 1) for r in (16, 32, 66, 67, 256)] == [
        (128, 5, 2, 1), (128, 5, 1, 1), (128, 5, 1, 1), (64, 5, 1, 1), (64, 5, 1, 1)
    ]  # fmt: skip
    assert settings(16, 4) == (64, 2, 4, 1)  # fp32: tiles twice a bf16 tile's bytes
    assert settings(256, 4) == (64, 2, 1, 1)
    assert td.launch_settings(256, 6, 2, gpu)["heads_per_program"] == 1  # 6 KV heads: not in fours
    assert td.launch_settings(16, 8, 1, gpu, head_dim=256) == {
        "block_n": 64,
        "num_stages": 4,
        "num_splits": 4,
        "heads_per_program": 1,
    }
    sm90 = False  # an sm80 GPU (less shared memory, not measured): the 2-byte settings
    assert [settings(r, 1) for r in (16, 64)] == [(64, 4, 4, 1), (64, 4, 1, 1)]
    assert settings(256, 2) == (64, 4, 1, 1)
    assert td.launch_settings(16, 8, 1, torch.device("cpu")) == {
        "block_n": 64,
        "num_stages": 4,
        "num_splits": 1,
        "heads_per_program": 1,
    }


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_the_residual_add_and_the_norm_module(with_residual, device, dtype):
    """`add_rms_norm(h, residual)`: the sum rounded as `residual + h` is, and the RMSNorm of it as
    layers.RMSNorm computes it; h a strided view, a width that is no power of 2 (masked lanes)."""
    from rlx.engine.models.layers import RMSNorm
    from rlx.engine.triton_layers import add_rms_norm

    g = torch.Generator(device=device).manual_seed(1)
    rows, width = 9, 1000
    h = torch.randn(rows, width + 24, device=device, generator=g).to(dtype)[:, :width]
    residual = torch.randn(rows, width, device=device, generator=g).to(dtype)
    norm = RMSNorm(width, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
        out, new_residual = add_rms_norm(h if with_residual else None, residual, norm.weight, 1e-6)
        summed = residual + h if with_residual else residual
        expected = norm(summed)
        x = summed.float()
        exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float()
    assert torch.equal(new_residual, summed)
    close(out, expected, dtype, roundings=2)  # the module rounds x before the weight, and after
    close(out, exact, dtype, roundings=2)


def test_silu_mul_matches_torch(device, dtype):
    """silu(gate) * up for gate and up the two halves of one GEMM output (strided rows)."""
    from rlx.engine.triton_layers import silu_mul

    g = torch.Generator(device=device).manual_seed(2)
    rows, width = 7, 1500
    gate_up = torch.randn(rows, 2 * width, device=device, generator=g).to(dtype)
    gate, up = gate_up[:, :width], gate_up[:, width:]
    out = silu_mul(gate, up)
    assert out.shape == (rows, width) and out.is_contiguous()
    close(out, F.silu(gate.float()) * up.float(), dtype, roundings=2)


@pytest.mark.parametrize(
    "heads,kv_heads,dim,norm", [(16, 8, 128, True), (12, 4, 64, False), (8, 8, 128, True)]
)
def test_qk_norm_rope_store_no_less_accurate_than_the_torch_modules(
    heads, kv_heads, dim, norm, device, dtype
):
    """q/k RMSNorm and rotary in place, k and v into their cache slots: against the same math in
    fp32, the kernel's q and k are no further off than the torch modules' (layers.RMSNorm, the
    rotary formula) on average, and at worst by a rounding; the cache holds the new k and v. (On
    the GPU Triton folds a cast to bf16 and back, so the kernel keeps some of the intermediates
    that the modules round in fp32: 22% of its bf16 outputs differ from theirs by a rounding.) In
    fp32 both are within reduction-order noise of the fp32 math."""
    from rlx.engine.models.layers import RMSNorm
    from rlx.engine.triton_layers import qk_norm_rope_store

    g = torch.Generator(device=device).manual_seed(heads)
    tokens, blocks, page = 37, 12, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=device, generator=g).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    angles = torch.rand(4096, dim // 2, device=device, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions = torch.randint(0, 4096, (tokens,), device=device, generator=g)
    slots = torch.randperm(blocks * page, device=device, generator=g)[:tokens]
    meta = SimpleNamespace(slot_block=slots // page, slot_offset=slots % page)
    q_norm = RMSNorm(dim, 1e-6).to(device=device, dtype=dtype)
    k_norm = RMSNorm(dim, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        q_norm.weight.normal_(generator=g), k_norm.weight.normal_(generator=g)

    def rotate(x):
        c, s = cos[positions][:, None].to(x.dtype), sin[positions][:, None].to(x.dtype)
        half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
        return x * c + half * s

    def fp32(x, module):
        x = x.float()
        if norm:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * module.weight.float()
        return rotate(x)

    with torch.no_grad():
        expected = [
            (fp32(q, q_norm), rotate(q_norm(q) if norm else q)),
            (fp32(k, k_norm), rotate(k_norm(k) if norm else k)),
        ]
    k_cache = torch.zeros(blocks, kv_heads, page, dim, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    weights = (q_norm.weight, k_norm.weight) if norm else None
    q_in, k_in = q.clone(), k.clone()
    qk_norm_rope_store(q, k, v, weights, 1e-6, cos, sin, positions, (k_cache, v_cache), meta)
    for got, (exact, modules) in zip((q, k), expected, strict=True):
        if dtype == torch.float32:
            close(got, exact, dtype, roundings=4)
            continue
        error, modules_error = (got.float() - exact).abs(), (modules.float() - exact).abs()
        assert error.mean() <= modules_error.mean()
        assert error.max() <= modules_error.max() + 2.0**-9 * exact.abs().max()  # a rounding at most
    assert torch.equal(k_cache[meta.slot_block, :, meta.slot_offset], k)
    assert torch.equal(v_cache[meta.slot_block, :, meta.slot_offset], v)
    # an fp8 cache (`kv_cache_dtype`) gets the same k and v, rounded as torch rounds them; on the
    # GPU only: Triton 3.9's interpreter rounds to fp8 wrongly where the rounding carries into the
    # exponent (1.99 -> 1.0, not 2.0; 98 of 4,096 normal draws), its CPU conversion's bug
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) if device.type == "cuda" else ():
        caches = (torch.zeros_like(k_cache, dtype=kv_dtype), torch.zeros_like(v_cache, dtype=kv_dtype))
        qk_norm_rope_store(q_in.clone(), k_in.clone(), v, weights, 1e-6, cos, sin, positions, caches, meta)
        for cache, x in zip(caches, (k, v), strict=True):
            assert torch.equal(cache[meta.slot_block, :, meta.slot_offset].float(), x.to(kv_dtype).float())


def fused_draw(logits, greedy, seed, step, temperature, splits):
    from rlx.engine.triton_sample import fused_sample

    rows = logits.shape[0]
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, device=logits.device)
    inv_t = torch.where(greedy.bool(), 1.0, 1.0 / temperature)
    fused_sample(logits, inv_t, greedy, seed, step, tokens, logprobs, splits=splits)
    return tokens, logprobs, inv_t


# None: default_splits (33 for 64 rows on 132 SMs, 1 interpreted)
@pytest.mark.parametrize("splits", [1, 4, None])
def test_fused_sampler_matches_torch_sampler(splits, device, dtype):
    """The graph's Triton sampler draws by its rule, stated in fp64 torch (tests/helpers.py,
    `inverse_cdf` at `fused_uniform`): same tokens at any share count, logprobs within fp32 noise
    of log_softmax; greedy rows take the argmax, a tie between two vocabulary shares going to the
    lower id, as torch.argmax's does. (Qwen's vocabulary on a GPU; a fifth of it in the
    interpreter, which takes 14 s a run of the whole.)"""
    g = torch.Generator(device=device).manual_seed(0)
    rows, vocab = 64, 151936 if device.type == "cuda" else 32768
    tie = (vocab * 3 // 8, vocab * 7 // 8)  # in different shares at 4 shares
    logits = (torch.randn(rows, vocab, device=device, generator=g) * 4).to(dtype)
    logits[0, list(tie)] = 100.0  # greedy row 0: a tie across shares
    temperature = torch.rand(rows, device=device, generator=g) + 0.5
    greedy = (torch.arange(rows, device=device) % 5 == 0).int()
    seed = torch.randint(0, 1 << 62, (rows,), device=device, generator=g)
    step = torch.randint(0, 1000, (rows,), device=device, generator=g)
    tokens, logprobs, inv_t = fused_draw(logits, greedy, seed, step, temperature, splits)
    x = logits.float() * inv_t[:, None]
    logp = x.log_softmax(-1)
    drawn = inverse_cdf(logp.exp(), fused_uniform(seed, step))
    expected = torch.where(greedy.bool(), logits.float().argmax(-1), drawn)
    assert torch.equal(tokens, expected) and tokens[0].item() == tie[0]
    assert (logprobs - logp.gather(-1, expected[:, None])[:, 0]).abs().max().item() < 1e-4


def test_fused_sampler_draws_by_hand_at_block_edges(device, dtype):
    """Mass only on ids 2,047 | 2,048, 2,049 (the first two blocks' edge) and 6,000 (the third
    block), a quarter each (logits 0, the rest -200, whose exp underflows to 0 in fp32): u below
    1/4 draws 2,047, below 1/2 2,048, below 3/4 2,049, above 6,000, at any share count; logprob
    log 1/4."""
    vocab, rows, chosen = 8192, 64, torch.tensor([2047, 2048, 2049, 6000])
    logits = torch.full((rows, vocab), -200.0, device=device)
    logits[:, chosen.tolist()] = 0.0
    seed = torch.arange(rows, device=device) * 7919 + 1
    step = torch.full_like(seed, 5)
    expected = chosen[(fused_uniform(seed.cpu(), step.cpu()) * 4).long()]
    assert set(expected.tolist()) == set(chosen.tolist())
    greedy = torch.zeros(rows, dtype=torch.int32, device=device)
    for splits in (1, 2):
        tokens, logprobs, _ = fused_draw(
            logits.to(dtype), greedy, seed, step, torch.ones(rows, device=device), splits
        )
        assert tokens.cpu().tolist() == expected.tolist()
        assert (logprobs.cpu() - math.log(0.25)).abs().max().item() < 1e-6


def test_fused_sampler_draws_follow_the_distribution(device, dtype):
    """Rows of one distribution with their own seeds (20,000 on a GPU, 600 interpreted): each
    token's frequency within 5 standard deviations of softmax(logits / 2) computed by hand."""
    rows = 20_000 if device.type == "cuda" else 600
    logits = [0.0, 1.0, 2.0, -1.0, 0.5, 3.0]
    weights = [math.exp(x / 2) for x in logits]
    expected = [w / sum(weights) for w in weights]
    seed = torch.arange(rows, device=device) * 7919 + 1
    step = torch.full_like(seed, 7)
    greedy = torch.zeros(rows, dtype=torch.int32, device=device)
    batch = torch.tensor([logits], device=device).expand(rows, 6).contiguous().to(dtype)
    tokens, _, _ = fused_draw(batch, greedy, seed, step, torch.full((rows,), 2.0, device=device), None)
    counts = torch.bincount(tokens.cpu(), minlength=6).tolist()
    for count, p in zip(counts, expected, strict=True):
        assert abs(count / rows - p) <= 5 * math.sqrt(p * (1 - p) / rows), (counts, expected)


def test_fused_sampler_keeps_a_row_of_nan_logits_to_itself(device, dtype):
    """A model that writes NaN logits (a diverged run) gets an id inside the vocabulary and a NaN
    logprob for that row, sampled or greedy, read within the row's bounds; the other rows draw
    what they draw without it."""
    vocab = 8192
    g = torch.Generator(device=device).manual_seed(1)
    logits = (torch.randn(4, vocab, device=device, generator=g) * 3).to(dtype)
    seed = torch.tensor([11, 12, 13, 14], device=device)
    step = torch.full_like(seed, 5)
    temperature = torch.ones(4, device=device)
    for greedy_row in (0, 1):
        greedy = torch.tensor([greedy_row, 0, 1, 0], dtype=torch.int32, device=device)
        clean, clean_logprobs, _ = fused_draw(logits, greedy, seed, step, temperature, 2)
        broken = logits.clone()
        broken[0] = float("nan")
        tokens, logprobs, _ = fused_draw(broken, greedy, seed, step, temperature, 2)
        assert 0 <= tokens[0].item() < vocab and logprobs[0].isnan().item()
        assert torch.equal(tokens[1:], clean[1:]) and torch.equal(logprobs[1:], clean_logprobs[1:])


def test_fused_sampler_draws_a_near_certain_token_at_the_uniforms_extremes(device, dtype):
    """u = 2^-24 and 1 - 2^-24 (tests/unit/test_fused_draw_rule.py) with one token at probability
    1 - 3e-9, 11 tokens before it: each row draws that token."""
    vocab, certain = 32768, 11
    seed = torch.tensor([s for s, _ in EXTREME_UNIFORM_SEEDS], device=device)
    step = torch.full_like(seed, 5)
    logits = torch.zeros(len(seed), vocab, device=device)
    logits[:, certain] = 30.0
    greedy = torch.zeros(len(seed), dtype=torch.int32, device=device)
    tokens, _, _ = fused_draw(logits.to(dtype), greedy, seed, step, torch.ones(len(seed), device=device), 1)
    assert tokens.tolist() == [certain] * len(seed)


def test_pdl_mode_reads_its_setting(device, monkeypatch):
    """`RLX_ENGINE_PDL`: 0, 1 or 2 (the default) on an sm90+ GPU, refused by its text otherwise;
    0 off CUDA, where Triton's interpreter has no launch to overlap."""
    from rlx.engine.pdl import pdl_mode

    def mode(value: str | None) -> int:
        if value is None:
            monkeypatch.delenv("RLX_ENGINE_PDL", raising=False)
        else:
            monkeypatch.setenv("RLX_ENGINE_PDL", value)
        pdl_mode.cache_clear()
        return pdl_mode(device)

    try:
        hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
        assert [mode(v) for v in (None, "0", "1", "2")] == ([2, 0, 1, 2] if hopper else [0, 0, 0, 0])
        with pytest.raises(ValueError, match=r"RLX_ENGINE_PDL='on': use 0 \(off\), 1 \(wait\) or 2"):
            mode("on")
    finally:
        pdl_mode.cache_clear()
