"""megatron-core's multi-tensor fallbacks, as torch's foreach ops.

Without Transformer Engine or apex (rlx's case: neither is installed), megatron's optimizer takes
`megatron.core.utils`' local stand-ins for apex's multi-tensor kernels, which loop in Python:

- `local_multi_tensor_l2_norm` (the gradient norm, every step): one norm kernel a tensor, then
  `torch.tensor([...])` over those CUDA scalars, which reads each back to the host: one
  host-device synchronisation per weight tensor (311 at the Qwen3-1.7B shape), then another.
- `local_multi_tensor_scale` (gradient clipping's scale, and the fp32 master weights copied into
  the bf16 model after every step, as a scale by 1.0): `dst.copy_(src * scale)`, two kernels a
  tensor and an fp32 temporary of each (1.2 GiB for a 151,936 x 2048 embedding).

`apply()` points megatron's optimizer and clip-grad modules at foreach versions of the two: the
same arithmetic (a norm of per-tensor norms; a multiply and a cast), a few launches over all
tensors, and no synchronisation until megatron itself reads the norm. Only where megatron chose
the local fallbacks: a TE or apex build keeps its own kernels.
"""

from __future__ import annotations

import importlib

import torch

_MODULES = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """`amp_C.multi_tensor_l2norm`'s contract: `(norm of all tensors of tensor_lists[0] as a [1] fp32
    tensor on their device, None)`; per-tensor norms are not asked for by megatron's callers."""
    if per_tensor:
        raise NotImplementedError("per-tensor norms: megatron's callers never ask for them")
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32), None
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def scale(chunk_size, noop_flag, tensor_lists, factor: float) -> None:
    """`amp_C.multi_tensor_scale`'s contract: `tensor_lists[1][i] = tensor_lists[0][i] * factor`
    (cast to the destination's dtype)."""
    src, dst = tensor_lists
    if not dst:
        return
    if factor == 1.0:
        torch._foreach_copy_(dst, src)
    elif all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, factor)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def apply() -> None:
    """Swap the local fallbacks for `l2_norm` and `scale` in megatron's optimizer modules
    (idempotent; leaves TE's or apex's kernels in place)."""
    from megatron.core import utils

    for name in _MODULES:
        module = importlib.import_module(name)
        if getattr(module, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:
            module.l2_norm_impl = l2_norm
        if getattr(module, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = scale
