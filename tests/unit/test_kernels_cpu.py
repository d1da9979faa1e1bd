"""rlx.models.kernels on a machine without CUDA: every kernel set builds megatron's own layers and
no weight gradient is fused, so the CPU path (and CI) trains exactly as before. The fused pieces
themselves are tested against fp32 on a GPU (tests/gpu/test_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import megatron_world  # tests/ is on sys.path (conftest)

from rlx.config import build
from rlx.config.compose import compose
from rlx.models.config import KERNEL_CHOICES
from rlx.models.kernels import KERNEL_SETS, fp32_accumulating_gemm_works, fuse_weight_gradients, resolve

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's behaviour")


@pytest.mark.parametrize("name", KERNEL_CHOICES)
def test_every_kernel_set_is_megatrons_own_layers_on_cpu(name):
    assert resolve(name) is KERNEL_SETS["torch"]


def test_the_fp32_accumulating_gemm_has_no_cpu_kernel():
    # torch's addmm(..., out_dtype=float32) exists for CUDA only: fusing would fail in the backward
    assert not fp32_accumulating_gemm_works(torch.device("cpu"))


def test_no_weight_gradient_is_fused_in_a_cpu_model():
    from rlx.trainer.config import TrainConfig
    from rlx.trainer.trainable import wrap_for_training

    with megatron_world():
        family = build(compose(["model=tiny_qwen3"]).model)
        gpt = family.build_model(params_dtype=torch.bfloat16)  # bf16 weights, fp32 grad buffer
        (ddp,), _ = wrap_for_training([gpt], TrainConfig(precision="bf16"), 1e-3, torch.bfloat16)
        assert all(p.main_grad.dtype == torch.float32 for p in gpt.parameters())
        assert fuse_weight_gradients([ddp]) == 0
        assert not any(getattr(m, "gradient_accumulation_fusion", False) for m in gpt.modules())
