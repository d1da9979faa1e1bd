"""train.adam_foreach=false (rlx.trainer.trainable.wrap_for_training): torch's Adam steps one tensor
at a time instead of all at once (whose fp32 sqrt(v) temporary is a third of the optimizer state):
the same arithmetic, so the same weights, here on the CPU, where torch runs either path when asked."""

from __future__ import annotations

import torch
from helpers import fp32_masters, tiny_bf16_trainable  # tests/ is on sys.path (conftest)

from rlx.trainer.config import TrainConfig


def _weights_after_steps(adam_foreach: bool) -> tuple[dict, list, dict]:
    """(weights, fp32 masters) after three Adam steps at lr 1e-2, and the weights before them."""
    with tiny_bf16_trainable(TrainConfig(precision="bf16", adam_foreach=adam_foreach)) as (
        gpt,
        _,
        optimizer,
        step,
    ):
        groups = [g for inner in optimizer.chained_optimizers for g in inner.optimizer.param_groups]
        if adam_foreach:  # on a CPU torch would take one tensor at a time: ask for the multi-tensor step
            assert all(g["foreach"] is None for g in groups)
            for g in groups:
                g["foreach"] = True
        else:
            assert all(g["foreach"] is False for g in groups)
        before = {k: v.detach().clone() for k, v in gpt.named_parameters()}
        for _ in range(3):
            step()
        return {k: v.detach().clone() for k, v in gpt.named_parameters()}, fp32_masters(optimizer), before


def test_one_tensor_at_a_time_gives_the_multi_tensor_steps_weights_bit_for_bit(monkeypatch):
    import torch.optim.adam as adam

    paths = []
    for name in ("_multi_tensor_adam", "_single_tensor_adam"):
        real = getattr(adam, name)
        monkeypatch.setattr(
            adam, name, lambda *a, _real=real, _name=name, **k: (paths.append(_name), _real(*a, **k))[1]
        )
    weights, masters, before = _weights_after_steps(adam_foreach=True)
    assert set(paths) == {"_multi_tensor_adam"}
    paths.clear()
    weights_one, masters_one, _ = _weights_after_steps(adam_foreach=False)
    assert set(paths) == {"_single_tensor_adam"}
    assert weights.keys() == weights_one.keys()
    for key, tensor in weights.items():
        assert torch.equal(weights_one[key], tensor), key
    assert masters and all(torch.equal(a, b) for a, b in zip(masters, masters_one, strict=True))
    # and the steps moved every weight matrix
    assert all(not torch.equal(weights[k], before[k]) for k in weights if weights[k].dim() == 2)
