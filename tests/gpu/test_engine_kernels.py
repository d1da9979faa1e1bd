"""The engine's fused q/k norm, rotary and KV-store kernel (rlx.engine.triton_layers) against the
torch modules it replaces. Skipped without a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "heads,kv_heads,dim,norm", [(16, 8, 128, True), (12, 4, 64, False), (8, 8, 128, True)]
)
def test_qk_norm_rope_store_no_less_accurate_than_the_torch_modules(heads, kv_heads, dim, norm):
    """q/k RMSNorm and rotary in place, k and v into their cache slots, in bf16: against the same
    math in fp32, the kernel's q and k are no further off than the bf16 torch modules' (layers.RMSNorm,
    the rotary formula) on average, and at worst by a rounding; the cache holds the new k and v. (On the GPU
    Triton folds a cast to bf16 and back, so the kernel keeps some of the intermediates that
    the modules round in fp32: 22% of its outputs differ from theirs by a rounding.)"""
    from rlx.engine.models.layers import RMSNorm
    from rlx.engine.triton_layers import qk_norm_rope_store

    g = torch.Generator(device="cuda").manual_seed(heads)
    tokens, blocks, page, dt = 37, 12, 16, torch.bfloat16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda", generator=g).to(dt)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    angles = torch.rand(4096, dim // 2, device="cuda", generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    positions = torch.randint(0, 4096, (tokens,), device="cuda", generator=g)
    slots = torch.randperm(blocks * page, device="cuda", generator=g)[:tokens]
    meta = SimpleNamespace(slot_block=slots // page, slot_offset=slots % page)
    q_norm, k_norm = RMSNorm(dim, 1e-6).cuda().to(dt), RMSNorm(dim, 1e-6).cuda().to(dt)
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
    k_cache = torch.zeros(blocks, kv_heads, page, dim, device="cuda", dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    weights = (q_norm.weight, k_norm.weight) if norm else None
    qk_norm_rope_store(q, k, v, weights, 1e-6, cos, sin, positions, (k_cache, v_cache), meta)
    for got, (exact, modules) in zip((q, k), expected, strict=True):
        error, modules_error = (got.float() - exact).abs(), (modules.float() - exact).abs()
        assert error.mean() <= modules_error.mean()
        assert error.max() <= modules_error.max() + 2.0**-9 * exact.abs().max()  # a rounding at most
    assert torch.equal(k_cache[meta.slot_block, :, meta.slot_offset], k)
    assert torch.equal(v_cache[meta.slot_block, :, meta.slot_offset], v)
