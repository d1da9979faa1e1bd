"""megatron's distributed optimizer checkpointed with torch's Adam (rlx.compat.megatron_distrib_optimizer):
two steps, a save, a load into a new model and optimizer, and one more step give the weights three
steps straight give, bit for bit, with the fused Adam and without. After the load megatron hands
every weight one shared step tensor; `choose_adam_kernel` (which `Trainable.load` calls) gives each
its own, or the next step would count once a weight."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_bf16_trainable  # tests/ is on sys.path (conftest)

from rlx.trainer.adam import choose_adam_kernel
from rlx.trainer.config import TrainConfig
from rlx.trainer.trainable import load_checkpoint, save_checkpoint


def _steps(optimizer) -> list[torch.Tensor]:
    return [s["step"] for inner in optimizer.chained_optimizers for s in inner.optimizer.state.values()]


@pytest.mark.parametrize("fused", [True, False])
def test_resumed_steps_are_the_straight_steps(tmp_path, fused):
    cfg = TrainConfig(precision="bf16", distributed_optimizer=True, adam_fused=fused)
    with tiny_bf16_trainable(cfg) as (gpt, ddp, optimizer, step):
        step()
        step()
        save_checkpoint([ddp], optimizer, tmp_path)
        step()
        straight = {k: v.detach().clone() for k, v in gpt.named_parameters()}
        straight_masters = fp32_masters_of(optimizer)
    with tiny_bf16_trainable(cfg) as (gpt, ddp, optimizer, step):
        load_checkpoint([ddp], optimizer, tmp_path)
        steps = _steps(optimizer)
        assert len(steps) > 1 and len({id(s) for s in steps}) == 1  # megatron's one shared tensor
        choose_adam_kernel(optimizer, cfg)
        steps = _steps(optimizer)
        assert len({id(s) for s in steps}) == len(steps) and all(s.item() == 2.0 for s in steps)
        step()
        assert all(s.item() == 3.0 for s in _steps(optimizer))
        for key, tensor in gpt.named_parameters():
            assert torch.equal(tensor.detach(), straight[key]), key
        assert all(
            torch.equal(a, b) for a, b in zip(fp32_masters_of(optimizer), straight_masters, strict=True)
        )


def fp32_masters_of(optimizer) -> list[torch.Tensor]:
    """The distributed optimizer's fp32 master shards (its torch Adam's parameters)."""
    return [p.detach().clone() for inner in optimizer.chained_optimizers
            for group in inner.optimizer.param_groups for p in group["params"]]  # fmt: skip
