"""Half-precision (bf16 / fp16) execution of a built Megatron model.

`ModelFamily.build_model(params_dtype=torch.bfloat16)` gives bf16 linear and embedding weights,
but the local spec's torch norms ignore `params_dtype` and stay fp32, so a bf16 activation would
meet an fp32 norm weight. Megatron-LM's answer, used here, is `Float16Module`: it casts every
parameter of the wrapped model to the config's half dtype, casts floating inputs on the first
pipeline stage, and returns fp32 outputs (logits or per-token losses) on the last one. The
optimizer (`get_megatron_optimizer` with `bf16=True`) keeps fp32 master weights.
"""

from __future__ import annotations

import torch


def half_precision(model: torch.nn.Module) -> torch.nn.Module:
    """`model` wrapped in megatron's `Float16Module` if its config is bf16 or fp16, else `model`.

    Load weights (`ModelFamily.load_hf_weights`) before or after wrapping: the bridge unwraps it.
    Wrap before `DistributedDataParallel`, as Megatron-LM's `get_model` does.
    """
    from megatron.core.transformer.module import Float16Module

    config = model.config
    if not (config.bf16 or config.fp16):
        return model
    return Float16Module(config, model)


__all__ = ["half_precision"]
