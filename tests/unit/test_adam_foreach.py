"""train.adam_foreach=false (rlx.trainer.trainable.wrap_for_training): torch's Adam steps one tensor
at a time instead of all at once (whose fp32 sqrt(v) temporary is a third of the optimizer state):
the same arithmetic, so the same weights, here on the CPU, where torch runs either path when asked."""

from __future__ import annotations

import torch
from helpers import megatron_world  # tests/ is on sys.path (conftest)

from rlx.config import build
from rlx.config.compose import compose
from rlx.trainer.config import TrainConfig
from rlx.trainer.trainable import wrap_for_training


def _weights_after_steps(adam_foreach: bool) -> tuple[dict, list, dict]:
    family = build(compose(["model=tiny_qwen3"]).model)
    hf_dir = family.checkpoint_dir()
    ids_BL = torch.randint(0, family.cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    with megatron_world():
        gpt = family.build_model(params_dtype=torch.bfloat16)
        family.load_hf_weights(gpt, hf_dir)
        cfg = TrainConfig(precision="bf16", adam_foreach=adam_foreach)
        (ddp,), optimizer = wrap_for_training([gpt], cfg, 1e-2, torch.bfloat16)
        groups = [g for inner in optimizer.chained_optimizers for g in inner.optimizer.param_groups]
        if adam_foreach:  # on a CPU torch would take one tensor at a time: ask for the multi-tensor step
            assert all(g["foreach"] is None for g in groups)
            for g in groups:
                g["foreach"] = True
        else:
            assert all(g["foreach"] is False for g in groups)
        before = {k: v.detach().clone() for k, v in gpt.named_parameters()}
        for _ in range(3):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            ddp(
                input_ids=ids_BL[:, :-1], position_ids=None, attention_mask=None, labels=ids_BL[:, 1:]
            ).mean().backward()
            optimizer.step()
        masters = [m.detach().clone() for inner in optimizer.chained_optimizers
                   for group in inner.fp32_from_float16_groups for m in group]  # fmt: skip
        return {k: v.detach().clone() for k, v in gpt.named_parameters()}, masters, before


def test_one_tensor_at_a_time_gives_the_multi_tensor_steps_weights_bit_for_bit(monkeypatch):
    import torch.optim.adam as adam

    paths = []
    for name in ("_multi_tensor_adam", "_single_tensor_adam"):
        real = getattr(adam, name)
        monkeypatch.setattr(adam, name, lambda *a, _real=real, _name=name, **k: (paths.append(_name), _real(*a, **k))[1])
    weights, masters, before = _weights_after_steps(adam_foreach=True)
    assert set(paths) == {"_multi_tensor_adam"}
    paths.clear()
    weights_one, masters_one, _ = _weights_after_steps(adam_foreach=False)
    assert set(paths) == {"_single_tensor_adam"}
    assert weights.keys() == weights_one.keys()
    for key, tensor in weights.items():
        assert torch.equal(weights_one[key], tensor), key
    assert masters and all(torch.equal(a, b) for a, b in zip(masters, masters_one, strict=True))
    # and the steps moved every weight matrix (three Adam steps at lr 1e-2)
    assert all(not torch.equal(weights[k], before[k]) for k in weights if weights[k].dim() == 2)
