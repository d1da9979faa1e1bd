"""The MoE / MLA / sequence-parallel fixes in `rlx.compat.megatron_cpu` (CPU, one process).

Each test fails without its fix; the multi-process paths (the MoE all-to-all, SP gradients)
are checked end to end in tests/integration/test_moe_families.py.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from rlx.compat import megatron_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU parts are inert with a GPU")


def test_backward_of_autograd_functions_allocates_on_the_cpu():
    """The autograd engine drops torch-function modes; megatron's communication Functions
    allocate with device=current_device() in their backward."""
    megatron_cpu.apply()

    class Doubles(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            out = torch.empty(grad.shape, dtype=grad.dtype, device=torch.cuda.current_device())
            return out.copy_(grad * 2)

    x = torch.ones(3, requires_grad=True)
    Doubles.apply(x).sum().backward()
    assert x.grad.device.type == "cpu" and torch.equal(x.grad, torch.full((3,), 2.0))


def test_router_gating_runs_without_transformer_engine():
    megatron_cpu.apply()
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    x, w = torch.randn(5, 8), torch.randn(4, 8)
    torch.testing.assert_close(router_gating_linear(x, w, None, torch.float32), x @ w.T)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_torch_norm_under_sequence_parallel_marks_its_weights(sequence_parallel):
    """Marked weights get their gradients summed over TP by megatron's grad finalisation."""
    megatron_cpu.apply()
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        normalization="RMSNorm",
        tensor_model_parallel_size=2,
        sequence_parallel=sequence_parallel,
    )
    norm = WrappedTorchNorm(config=config, hidden_size=8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert getattr(norm.weight, "sequence_parallel", False) is sequence_parallel
    assert config.sequence_parallel is sequence_parallel  # the caller's config is left alone


def test_multi_latent_attention_does_not_take_the_te_path():
    megatron_cpu.apply()
    from megatron.core.transformer import multi_latent_attention

    assert multi_latent_attention.HAVE_TE is False
