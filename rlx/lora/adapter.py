"""One low-rank adapter beside one of Megatron's tensor-parallel linear layers.

The adapter is a sibling of its layer (`linear_qkv` gets `linear_qkv_lora` in the same module),
so the layer keeps its own parameter names (the HF weight bridge and Megatron's checkpoints see
the base model unchanged) and the adapter's parameters get their own checkpoint keys. A forward
hook on the layer adds the adapter's output to the layer's.

Tensor parallelism follows the layer's split, so the merged update B @ A of each rank is that
rank's shard of the full update and never needs a gather:

- column-parallel layer (W: [out/tp, in], input whole on every rank): A [r, in] is whole on every
  rank, B [out/tp, r] is split like W. The gradient of A's output is summed over TP in the
  backward (`copy_to_tensor_model_parallel_region`), as the layer sums its input's gradient.
- row-parallel layer (W: [out, in/tp], input split over TP): A [r, in/tp] is split like W, its
  partial outputs are summed over TP in the forward (`reduce_from_tensor_model_parallel_region`),
  B [out, r] is whole.

Under sequence parallelism (MoE models under TP), the column side gathers A's output over the
sequence (reduce-scattering its gradient) and the row side reduce-scatters it; the whole factor
then sees only this rank's share of the sequence, so its gradient is marked `sequence_parallel`
and megatron sums it over TP with the norms'. Only rank-sized tensors cross ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Set on an adapter's two parameters: the weight bridge and the checkpoints tell them apart by it.
ADAPTER_ATTR = "is_lora_adapter"
# Set on an adapted layer's weight: its adapter (`merged_weight` adds the update).
BASE_ATTR = "lora_adapter"


class LoRAAdapter(torch.nn.Module):
    """The low-rank update of `base` (a megatron ColumnParallelLinear or RowParallelLinear).

    `init_a` is the full A [rank, in_features] (the same on every rank, whatever the TP size, so
    a run's initial adapters do not depend on its layout); this rank keeps its shard. B starts at
    zero. The factors take the base weight's dtype and device."""

    def __init__(
        self,
        base: torch.nn.Module,
        *,
        row_parallel: bool,
        rank: int,
        scale: float,
        dropout: float,
        init_a: torch.Tensor,
        swiglu: bool = False,
    ):
        super().__init__()
        weight = base.weight
        self.row_parallel, self.scale, self.swiglu = row_parallel, scale, swiglu
        self.tp_group = base.tp_group
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        # an expert layer whose dispatcher moves its tokens (EP > 1) runs no collective itself
        own_comm = not getattr(base, "explicit_expert_comm", False)
        self.communicates = own_comm and tp_size > 1
        self.sequence_parallel = own_comm and bool(getattr(base, "sequence_parallel", False)) and tp_size > 1
        out_local, in_local = weight.shape
        a = init_a.chunk(tp_size, dim=1)[tp_rank] if row_parallel else init_a
        b = torch.zeros(out_local, rank)
        if a.shape != (rank, in_local):
            raise ValueError(f"LoRA A shard {tuple(a.shape)} does not fit the layer's input ({in_local})")
        kwargs = {"dtype": weight.dtype, "device": weight.device}
        self.a = torch.nn.Parameter(a.to(**kwargs).contiguous())
        self.b = torch.nn.Parameter(b.to(**kwargs))
        for param, split_dim in (
            (self.a, 1 if row_parallel else None),
            (self.b, None if row_parallel else 0),
        ):
            setattr(param, ADAPTER_ATTR, True)
            # megatron's marks: which factor is split over TP, which sums its gradient over TP
            param.tensor_model_parallel = split_dim is not None and tp_size > 1
            if split_dim is not None:
                param.partition_dim = split_dim
            if split_dim is None and self.sequence_parallel:
                param.sequence_parallel = True
            # a routed expert's (allreduce False): DDP reduces it over the expert-data-parallel
            # group, not over all data-parallel ranks, which hold other experts
            param.allreduce = getattr(weight, "allreduce", True)
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The update's output for the layer's input `x`, shaped like the layer's output."""
        from megatron.core.tensor_parallel import mappings

        h = F.linear(self.dropout(x), self.a)
        if self.row_parallel:
            if self.sequence_parallel:
                h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
            elif self.communicates:
                h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        elif self.sequence_parallel:
            h = mappings.gather_from_sequence_parallel_region(h, group=self.tp_group)
        elif self.communicates:
            h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, self.b) * self.scale

    @torch.no_grad()
    def delta(self) -> torch.Tensor:
        """scale * B @ A: this rank's shard of the update, shaped like the layer's weight shard."""
        return (self.b.float() @ self.a.float()) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron's distributed-checkpoint view: the split factor sharded along its TP dim (B of
        a gated fc1 in its gate and up halves, as megatron saves fc1 itself), the other replicated,
        so a checkpoint loads under any TP/PP/DP layout."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        metadata = metadata or {}
        state = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"a": 1} if self.row_parallel else {"b": 0},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata.get("dp_cp_group"),
        )
        if self.swiglu:
            key = f"{prefix}b"
            state[key] = apply_swiglu_sharded_factory(
                state[key], sharded_offsets, metadata.get("singleton_local_shards", False)
            )
        return state


def add_update(layer: torch.nn.Module, args: tuple, output):
    """Forward hook of an adapted layer: its (output, bias) with the adapter's update added."""
    adapter: LoRAAdapter = getattr(layer.weight, BASE_ATTR)
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter(args[0]).to(out.dtype), bias


def kaiming_a(rank: int, in_features: int, generator: torch.Generator) -> torch.Tensor:
    """A's initial value as PEFT draws it (kaiming-uniform with a = sqrt(5): U(+-1/sqrt(in)))."""
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=generator, dtype=torch.float32) * 2 - 1) * bound


def is_adapter(param: torch.Tensor) -> bool:
    return bool(getattr(param, ADAPTER_ATTR, False))


def is_adapter_key(key: str) -> bool:
    """Whether a (sharded) state-dict key is an adapter factor's (`<layer>_lora.a` / `.b`)."""
    return key.endswith(("_lora.a", "_lora.b"))


def merged_weight(param: torch.Tensor) -> torch.Tensor:
    """`param`'s value as the engines and exports see it: W + scale * B @ A for an adapted layer's
    weight (in W's dtype; this rank's shard), else `param` itself (detached)."""
    adapter = getattr(param, BASE_ATTR, None)
    if adapter is None:
        return param.detach()
    return (param.detach().float() + adapter.delta()).to(param.dtype)
