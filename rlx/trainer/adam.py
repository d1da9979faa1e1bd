"""Which of torch's Adam kernels the trainer's optimizer steps with (`train.adam_fused`,
`train.adam_foreach`). megatron builds torch's Adam without TE or apex and leaves the choice to
torch's defaults (its multi-tensor step on GPUs); `choose_adam_kernel` sets it on the param groups
after the build and again after a checkpoint's param groups were loaded over them."""

from __future__ import annotations

import torch

from rlx.trainer.offload import sub_optimizers


def choose_adam_kernel(optimizer, train_cfg) -> None:
    """Point the torch Adam(s) megatron built at `train.adam_fused` / `train.adam_foreach`'s kernel:
    fused (a param group's `fused` flag, which torch's constructor would set, checked as it checks:
    floating-point tensors on a device with the fused kernel), else multi-tensor or one tensor at a
    time. Also after a checkpoint's param groups (the writer's flags) were loaded: each weight's
    step count is moved where the chosen kernel keeps it (fused: beside the weight; else the host)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices, _get_scalar_dtype

    fused_devices = _get_fused_kernels_supported_devices()
    for wrapper in sub_optimizers(optimizer):
        state = wrapper.optimizer.state
        for group in wrapper.optimizer.param_groups:
            fusable = all(p.is_floating_point() and p.device.type in fused_devices for p in group["params"])
            fused = train_cfg.adam_fused and fusable
            group["fused"] = fused
            group["foreach"] = False if fused or not train_cfg.adam_foreach else None
            for p in group["params"]:
                step = state.get(p, {}).get("step")
                if torch.is_tensor(step):
                    where = p.device if fused else torch.device("cpu")
                    # a copy each: a loaded checkpoint may share one tensor among all weights
                    state[p]["step"] = step.to(
                        device=where, dtype=_get_scalar_dtype(is_fused=fused), copy=True
                    )
