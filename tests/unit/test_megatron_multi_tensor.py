"""rlx.compat.megatron_multi_tensor: megatron's Python-loop stand-ins for apex's multi-tensor
kernels (the gradient norm, the clip scale, the master-to-model weight copy) replaced by torch's
foreach ops: the same numbers as megatron's own fallbacks, and megatron's optimizer uses them."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_bf16_trainable  # tests/ is on sys.path (conftest)

from rlx.compat import megatron_multi_tensor as mt
from rlx.trainer.config import TrainConfig


def test_l2_norm_is_the_norm_of_every_element_in_fp32():
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([[12.0]]), torch.tensor([84.0], dtype=torch.bfloat16)]
    norm, per_tensor = mt.l2_norm(2048, None, [tensors], False)
    # sqrt(9 + 16 + 144 + 7056) = sqrt(7225) = 85
    assert norm.dtype == torch.float32 and norm.shape == (1,) and per_tensor is None
    assert norm.item() == 85.0
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (5, 300, 7)]
    whole = torch.linalg.vector_norm(torch.cat(grads).double()).float()
    torch.testing.assert_close(mt.l2_norm(2048, None, [grads], False)[0], whole.reshape(1), rtol=1e-6, atol=0)
    assert mt.l2_norm(2048, None, [[]], False)[0].item() == 0.0


def test_scale_copies_casts_and_scales_in_place():
    src = [torch.tensor([1.0, 2.0**-9 + 1.0]), torch.tensor([3.0])]
    dst = [torch.zeros(2, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)]
    mt.scale(2048, None, [src, dst], 1.0)  # megatron's master -> model copy: a cast
    assert dst[0].tolist() == [1.0, 1.0] and dst[1].tolist() == [3.0]  # 1 + 2^-9 rounds to 1 in bf16
    mt.scale(2048, None, [src, src], 0.5)  # gradient clipping: in place
    assert src[0].tolist() == [0.5, (2.0**-9 + 1.0) / 2] and src[1].tolist() == [1.5]
    out = [torch.zeros(2), torch.zeros(1)]
    mt.scale(2048, None, [src, out], 4.0)
    assert out[0].tolist() == [2.0, 2.0 + 2.0**-8] and out[1].tolist() == [6.0]
    mt.scale(2048, None, [[], []], 2.0)  # nothing to do


def test_megatrons_optimizer_takes_them_and_clips_to_the_norm():
    """A step at clip_grad 0.5: megatron's norm of the gradients (`l2_norm`) is theirs; `scale`
    clips them to 0.5 in place; the weights then are the bf16 casts of the fp32 masters (`scale`
    by 1.0)."""
    from megatron.core.optimizer import clip_grads, optimizer

    with tiny_bf16_trainable(TrainConfig(precision="bf16", clip_grad=0.5)) as (gpt, _, opt, step):
        assert clip_grads.l2_norm_impl is mt.l2_norm
        assert (
            clip_grads.multi_tensor_scale_impl is mt.scale and optimizer.multi_tensor_scale_impl is mt.scale
        )
        params = list(gpt.parameters())
        _, norm, _ = step()
        clipped = torch.linalg.vector_norm(torch.cat([p.main_grad.flatten() for p in params]).double())
        # the clip: gradients times 0.5 / (norm + 1e-6), megatron's coefficient
        assert norm > 0.5
        assert clipped.item() == pytest.approx(0.5 * norm / (norm + 1e-6), rel=1e-6)
        assert opt.get_grad_norm() == pytest.approx(clipped.item(), rel=1e-6)
        pairs = [(p, m) for inner in opt.chained_optimizers
                 for ps, ms in zip(inner.float16_groups, inner.fp32_from_float16_groups, strict=True)
                 for p, m in zip(ps, ms, strict=True)]  # fmt: skip
        assert {id(p) for p, _ in pairs} == {id(p) for p in params}
        for p, m in pairs:
            assert torch.equal(p.detach(), m.to(torch.bfloat16))
