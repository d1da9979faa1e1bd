"""Which torch Adam kernel steps the trainer (rlx.trainer.adam.choose_adam_kernel): the fused
one (`train.adam_fused`, the default: one pass over all tensors, no temporaries), else the
multi-tensor one or, with `train.adam_foreach=false`, one tensor at a time (whose sqrt(v) temporary
is the largest tensor's, not a third of the optimizer state). The same arithmetic: the unfused two
give the same weights bit for bit, the fused one the same within fp32 rounding of the masters.
Here on the CPU, where torch runs every path when asked."""

from __future__ import annotations

import pytest
import torch
from helpers import fp32_masters, tiny_bf16_trainable  # tests/ is on sys.path (conftest)

from rlx.trainer.config import TrainConfig

PATHS = ("_fused_adam", "_multi_tensor_adam", "_single_tensor_adam")


@pytest.fixture
def paths(monkeypatch) -> list[str]:
    """The names of torch's Adam implementations each step called, in order."""
    import torch.optim.adam as adam

    called = []
    for name in PATHS:
        real = getattr(adam, name)
        monkeypatch.setattr(
            adam, name, lambda *a, _real=real, _name=name, **k: (called.append(_name), _real(*a, **k))[1]
        )
    return called


def _weights_after_steps(fused: bool, foreach: bool) -> tuple[dict, list, dict]:
    """(weights, fp32 masters) after three Adam steps at lr 1e-2, and the weights before them."""
    with tiny_bf16_trainable(TrainConfig(precision="bf16", adam_fused=fused, adam_foreach=foreach)) as (
        gpt,
        _,
        optimizer,
        step,
    ):
        groups = [g for inner in optimizer.chained_optimizers for g in inner.optimizer.param_groups]
        assert all(g["fused"] is fused for g in groups)
        if (
            foreach and not fused
        ):  # on a CPU torch would take one tensor at a time: ask for the multi-tensor step
            assert all(g["foreach"] is None for g in groups)
            for g in groups:
                g["foreach"] = True
        else:
            assert all(g["foreach"] is False for g in groups)
        before = {k: v.detach().clone() for k, v in gpt.named_parameters()}
        for _ in range(3):
            step()
        return {k: v.detach().clone() for k, v in gpt.named_parameters()}, fp32_masters(optimizer), before


def test_one_tensor_at_a_time_gives_the_multi_tensor_steps_weights_bit_for_bit(paths):
    weights, masters, before = _weights_after_steps(fused=False, foreach=True)
    assert set(paths) == {"_multi_tensor_adam"}
    paths.clear()
    weights_one, masters_one, _ = _weights_after_steps(fused=False, foreach=False)
    assert set(paths) == {"_single_tensor_adam"}
    assert weights.keys() == weights_one.keys()
    for key, tensor in weights.items():
        assert torch.equal(weights_one[key], tensor), key
    assert masters and all(torch.equal(a, b) for a, b in zip(masters, masters_one, strict=True))
    # and the steps moved every weight matrix
    assert all(not torch.equal(weights[k], before[k]) for k in weights if weights[k].dim() == 2)


def test_the_fused_step_is_the_default_and_gives_the_same_weights(paths):
    assert TrainConfig().adam_fused
    weights, masters, before = _weights_after_steps(fused=True, foreach=True)
    assert set(paths) == {"_fused_adam"}
    paths.clear()
    weights_one, masters_one, _ = _weights_after_steps(fused=False, foreach=False)
    assert set(paths) == {"_single_tensor_adam"}
    for a, b in zip(masters, masters_one, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    moved = 0
    for key, tensor in weights.items():
        # bf16 copies of those masters: equal but where a master sits on a rounding boundary
        torch.testing.assert_close(weights_one[key].float(), tensor.float(), rtol=2**-8, atol=1e-6)
        moved += not torch.equal(tensor, before[key])
    assert moved == len(weights)


def test_a_resumed_optimizer_keeps_this_runs_kernel_not_the_writers(paths):
    """torch's `load_state_dict` restores the saved param groups' flags: a checkpoint written by a
    multi-tensor run would resume unfused. `Trainable.load` chooses again (`choose_adam_kernel`)."""
    from rlx.trainer.adam import choose_adam_kernel

    with tiny_bf16_trainable(TrainConfig(precision="bf16", adam_fused=False)) as (_, _, writer, step):
        step()
        saved = [inner.optimizer.state_dict() for inner in writer.chained_optimizers]
    cfg = TrainConfig(precision="bf16")
    with tiny_bf16_trainable(cfg) as (_, _, reader, step):
        for inner, state in zip(reader.chained_optimizers, saved, strict=True):
            inner.optimizer.load_state_dict(state)
        groups = [g for inner in reader.chained_optimizers for g in inner.optimizer.param_groups]
        assert not any(g["fused"] for g in groups)  # the writer's
        choose_adam_kernel(reader, cfg)
        assert all(g["fused"] and g["foreach"] is False for g in groups)
        steps = [s["step"] for inner in reader.chained_optimizers for s in inner.optimizer.state.values()]
        assert steps and all(s.dtype == torch.float32 and s.item() == 1.0 for s in steps)
        paths.clear()
        step()
        assert set(paths) == {"_fused_adam"}
        assert all(s.item() == 2.0 for inner in reader.chained_optimizers for s in [
            st["step"] for st in inner.optimizer.state.values()])  # fmt: skip
