"""The colocated hand-over's offload round trip (rlx.trainer.offload) on a bf16 model with fp32
master weights, run on the CPU (`on_cpu=True` frees and refills the same tensors as on a GPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import fp32_masters, tiny_bf16_trainable  # tests/ is on sys.path (conftest)

from rlx.trainer.config import TrainConfig
from rlx.trainer.offload import Offloader


def _trained_after(round_trip: str) -> tuple[dict, list]:
    """Weights and fp32 masters after Adam step, `round_trip` ("none", "move_state": everything to
    the host and back, "two_stages": all but the parameters, then the parameters, then back,
    "grads_only": `move_state=False`), Adam step."""
    with tiny_bf16_trainable(TrainConfig(precision="bf16")) as (gpt, ddp, optimizer, step):
        step()  # Adam state, and weights no longer the checkpoint's
        grad_data = [b.grad_data for b in ddp.buffers]
        if round_trip == "move_state":
            offloader = Offloader(ddp, optimizer, on_cpu=True)
            offloader.offload()
            assert all(p.untyped_storage().nbytes() == 0 for p in gpt.parameters())
            bf16 = [p for p in gpt.parameters() if p.dtype == torch.bfloat16]
            assert bf16 and not any(id(p) in offloader._host for p in bf16)  # refilled, not copied
            assert all(g.untyped_storage().nbytes() == 0 for g in grad_data)
            offloader.onload(torch.device("cpu"))
        elif round_trip == "two_stages":  # a colocated weight sync's order (rlx.colocation.GpuTurns.publish)
            pointers = [p.data_ptr() for p in gpt.parameters()]
            offloader = Offloader(ddp, optimizer, on_cpu=True)
            offloader.offload(keep_params=True)
            assert [p.data_ptr() for p in gpt.parameters()] == pointers  # the weights a sync reads stay
            assert all(p.untyped_storage().nbytes() > 0 for p in gpt.parameters())
            assert all(g.untyped_storage().nbytes() == 0 for g in grad_data)
            state = [
                t
                for inner in optimizer.chained_optimizers
                for group in inner.optimizer.param_groups
                for p in group["params"]
                for t in (p, *inner.optimizer.state[p].values())
                if isinstance(t, torch.Tensor) and t.dim() > 0
            ]
            assert state and all(t.untyped_storage().nbytes() == 0 for t in state)  # masters, Adam's m and v
            offloader.offload()
            assert all(p.untyped_storage().nbytes() == 0 for p in gpt.parameters())
            offloader.offload()  # a third call finds nothing left
            offloader.onload(torch.device("cpu"))
        elif round_trip == "grads_only":
            pointers = [p.data_ptr() for p in gpt.parameters()]
            offloader = Offloader(ddp, optimizer, on_cpu=True)
            offloader.offload(move_state=False)
            assert all(g.untyped_storage().nbytes() == 0 for g in grad_data)  # gradients freed
            assert [p.data_ptr() for p in gpt.parameters()] == pointers  # weights left in place
            assert all(p.untyped_storage().nbytes() > 0 for p in gpt.parameters())
            assert not offloader._host  # nothing copied
            grads_s = offloader.onload(torch.device("cpu"))  # the seconds of the buffers' reallocation
            assert all(g.untyped_storage().nbytes() == g.numel() * g.element_size() for g in grad_data)
            assert grads_s > 0 and offloader.onload(torch.device("cpu")) == 0.0  # nothing left to reload
        step()
        return {k: v.detach().clone() for k, v in gpt.named_parameters()}, fp32_masters(optimizer)


@pytest.mark.parametrize("round_trip", ["move_state", "two_stages", "grads_only"])
def test_training_continues_bit_for_bit_after_a_round_trip(round_trip):
    """Offload after an Adam step, onload, step again: every weight and master equals those of a
    model that never left; moved, bf16 weights with a master are refilled from it, not copied."""
    weights, masters = _trained_after("none")
    weights_after, masters_after = _trained_after(round_trip)
    assert weights.keys() == weights_after.keys()
    for key, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(weights_after[key], tensor), key
    assert masters and all(torch.equal(a, b) for a, b in zip(masters, masters_after, strict=True))
