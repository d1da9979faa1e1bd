"""The trainer's Triton kernels (rlx.models.triton_norm, rlx.models.triton_rope), forward and backward,
against the same math in fp32 through torch's autograd: bf16 on a GPU, fp32 in Triton's CPU
interpreter (conftest.py). tests/gpu/test_kernels.py checks them inside megatron's layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import close  # tests/ is on sys.path (conftest)


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


LAYOUTS = {  # as the trainer hands rows over, from a fused QKV projection [s, b, KV groups, 3 q + k + v, d]
    "contiguous": lambda qkv: qkv,
    "evenly spaced": lambda qkv: qkv[:, :, :, 3],  # its keys
    "grouped": lambda qkv: qkv[:, :, :, :3],  # its query heads: groups of 3 rows, evenly spaced
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rms_norm_forward_and_backward(layout, device, dtype):
    """Rows read where they lie (the gradient reaches the projection's output through the view)."""
    from rlx.models.triton_norm import rms_norm

    g = torch.Generator(device=device).manual_seed(3)
    qkv = leaf(torch.randn(6, 2, 4, 5, 128, device=device, generator=g).to(dtype))
    x = LAYOUTS[layout](qkv)
    weight = leaf(torch.randn(128, device=device, generator=g).to(dtype))
    dy = torch.randn(x.shape, device=device, generator=g).to(dtype)
    y = rms_norm(x, weight, 1e-6)
    y.backward(dy)
    qkv32, w32 = leaf(qkv.detach().float()), leaf(weight.detach().float())
    y32 = F.rms_norm(LAYOUTS[layout](qkv32), (128,), w32, 1e-6)
    y32.backward(dy.float())
    close(y, y32, dtype)
    close(qkv.grad, qkv32.grad, dtype, roundings=4)  # zero outside the view, both
    close(weight.grad, w32.grad, dtype, roundings=4)


def test_add_rms_norm_forward_and_backward(device, dtype):
    """s = x + residual rounded as a separate add is; y its norm; both inputs get the gradient of
    s (its own gradient plus the norm's)."""
    from rlx.models.triton_norm import add_rms_norm

    g = torch.Generator(device=device).manual_seed(4)
    x, residual = (torch.randn(6, 2, 300, device=device, generator=g).to(dtype) for _ in range(2))
    weight = leaf(torch.randn(300, device=device, generator=g).to(dtype))
    ds, dy = (torch.randn(6, 2, 300, device=device, generator=g).to(dtype) for _ in range(2))
    x_leaf, r_leaf = leaf(x), leaf(residual)
    s, y = add_rms_norm(x_leaf, r_leaf, weight, 1e-6)
    torch.autograd.backward([s, y], [ds, dy])
    assert torch.equal(s, x + residual)
    s32 = leaf(s.detach().float())
    w32 = leaf(weight.float())
    y32 = F.rms_norm(s32, (300,), w32, 1e-6)
    y32.backward(dy.float())
    close(y, y32, dtype)
    d_sum = s32.grad + ds.float()
    close(x_leaf.grad, d_sum, dtype, roundings=4)
    assert torch.equal(x_leaf.grad, r_leaf.grad)
    close(weight.grad, w32.grad, dtype, roundings=4)


def test_the_weight_gradient_is_added_into_main_grad(device, dtype):
    """Under megatron's DDP (an fp32 `main_grad` and its flag) the backward adds the weight's
    gradient into main_grad, raises the flag, and returns a placeholder DDP's hook ignores."""
    from rlx.models.triton_norm import rms_norm

    g = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(40, 256, device=device, generator=g).to(dtype)
    weight = leaf(torch.randn(256, device=device, generator=g).to(dtype))
    before = torch.randn(256, device=device, generator=g)
    weight.main_grad, weight.grad_added_to_main_grad = before.clone(), False
    dy = torch.randn(40, 256, device=device, generator=g).to(dtype)
    rms_norm(x, weight, 1e-6).backward(dy)
    w32 = leaf(weight.detach().float())
    F.rms_norm(x.float(), (256,), w32, 1e-6).backward(dy.float())
    assert weight.grad_added_to_main_grad
    close(weight.main_grad - before, w32.grad, dtype, roundings=4)


@pytest.mark.parametrize("rot_dim", [64, 48])  # the whole head, and a rotated part with a tail
def test_rope_forward_and_backward_match_megatrons_rotation(rot_dim, device, dtype):
    """megatron's non-interleaved `_apply_rotary_pos_emb_bshd` on the keys of a fused QKV
    projection (a strided [s, b, heads, d] view): cos/sin rounded to the input's dtype, the
    unrotated tail passed through; the backward is the transposed rotation."""
    from rlx.models.triton_rope import apply_rope

    g = torch.Generator(device=device).manual_seed(rot_dim)
    s, b, heads, d = 9, 2, 3, 64
    qkv = leaf(torch.randn(s, b, heads, 3, d, device=device, generator=g).to(dtype))
    freqs = torch.rand(s, 1, 1, rot_dim, device=device, generator=g) * 20
    dy = torch.randn(s, b, heads, d, device=device, generator=g).to(dtype)
    out = apply_rope(qkv[:, :, :, 1], freqs)
    out.backward(dy)

    qkv32 = leaf(qkv.detach().float())
    keys = qkv32[:, :, :, 1]
    cos, sin = freqs.cos().to(dtype).float(), freqs.sin().to(dtype).float()
    rotated, tail = keys[..., :rot_dim], keys[..., rot_dim:]
    first, second = rotated.chunk(2, dim=-1)
    expected = torch.cat([rotated * cos + torch.cat([-second, first], -1) * sin, tail], -1)
    expected.backward(dy.float())
    close(out, expected, dtype)
    close(qkv.grad, qkv32.grad, dtype)
