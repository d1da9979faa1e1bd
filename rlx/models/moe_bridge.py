"""HF <-> Megatron weights for mixture-of-experts and multi-latent-attention models.

`rlx.models.bridge.WeightBridge` walks a model's parameters with one template per layer. MoE
models add two things it does not know about:

- routed experts: Megatron's `SequentialMLP` holds `num_experts / ep` local experts per rank
  (`mlp.experts.local_experts.{j}`), while an HF checkpoint stores every expert by its global
  index (`mlp.experts.{e}.gate_proj.weight`). Templates here use `{e}` for the global expert,
  `e = ep_rank * num_local_experts + j`; expert weights are split over the expert
  tensor-parallel group and, on export, gathered over it and then over the expert-parallel group;
- router state that is a buffer, not a parameter (DeepSeek-V3's `expert_bias`, HF's
  `e_score_correction_bias`), which the bridge loads and exports too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rlx.lora.adapter import is_adapter
from rlx.models.bridge import (
    GatedMLP,
    Replicated,
    SafetensorsReader,
    Split,
    TensorMapping,
    WeightBridge,
    gather_shards,
    tp_shards,
    unwrap,
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
# Router buffers that are model state (loaded and exported); other buffers are scratch.
_STATE_BUFFERS = ("mlp.router.expert_bias",)


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in the dense tensor-parallel, expert tensor-parallel and expert-parallel groups."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    etp_rank: int = 0
    etp_size: int = 1
    etp_group: dist.ProcessGroup | None = None
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: dist.ProcessGroup | None = None

    @classmethod
    def from_megatron(cls) -> ParallelGroups:
        """The groups of megatron's initialised parallel state."""
        from megatron.core import parallel_state as ps

        return cls(
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            tp_group=ps.get_tensor_model_parallel_group(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
            etp_size=ps.get_expert_tensor_parallel_world_size(),
            etp_group=ps.get_expert_tensor_parallel_group(),
            ep_rank=ps.get_expert_model_parallel_rank(),
            ep_size=ps.get_expert_model_parallel_world_size(),
            ep_group=ps.get_expert_model_parallel_group(),
        )


@dataclass(frozen=True)
class ModelTensor:
    """One parameter or state buffer of this rank's model, with its place in the whole model."""

    template: str  # name with `{i}` for the layer and `{e}` for a routed expert
    layer: int | None  # global layer index
    expert: int | None  # this rank's global index of a routed expert; None if not one
    experts: tuple[int, ...]  # the global index of this local slot on every EP rank, in EP-rank order
    tensor: torch.Tensor


def model_tensors(model: torch.nn.Module, ep_rank: int = 0, ep_size: int = 1) -> Iterator[ModelTensor]:
    """Every parameter, then the state buffers, with global layer and expert indices."""
    model = unwrap(model)
    layers = model.decoder.layers if hasattr(model, "decoder") else None
    named = [(n, p) for n, p in model.named_parameters() if not is_adapter(p)]  # LoRA: merged on export
    named += [(n, b) for n, b in model.named_buffers() if n.endswith(_STATE_BUFFERS)]
    for name, tensor in named:
        match = _LAYER.match(name)
        if match is None:
            yield ModelTensor(name, None, None, (), tensor)
            continue
        local_layer, rest = int(match.group(1)), match.group(2)
        layer = layers[local_layer]
        expert = _LOCAL_EXPERT.match(rest)
        experts: tuple[int, ...] = ()
        if expert is not None:  # local slot j holds global expert r * num_local + j on EP rank r
            j, num_local = int(expert.group(1)), layer.mlp.num_local_experts
            experts = tuple(r * num_local + j for r in range(ep_size))
            rest = f"mlp.experts.local_experts.{{e}}.{expert.group(2)}"
        own = experts[ep_rank] if experts else None
        yield ModelTensor(f"decoder.layers.{{i}}.{rest}", layer.layer_number - 1, own, experts, tensor)


class MoEWeightBridge(WeightBridge):
    """`WeightBridge` that also maps routed experts (sharded by EP and expert TP) and router buffers."""

    def load(self, model: torch.nn.Module, hf_dir: str | Path, groups: ParallelGroups) -> None:
        """Copy this rank's share of every parameter and state buffer from the HF checkpoint,
        one tensor at a time."""
        reader = SafetensorsReader(hf_dir)
        for item in model_tensors(model, groups.ep_rank, groups.ep_size):
            mapping = self._mapping(item.template)
            rank, size = (
                (groups.etp_rank, groups.etp_size) if item.experts else (groups.tp_rank, groups.tp_size)
            )
            _check_partitioning(item.template, mapping, item.tensor)
            names = [h.format(i=item.layer, e=item.expert) for h in mapping.hf]
            shard = mapping.to_megatron([reader.get(n) for n in names], rank, size)
            if shard.shape != item.tensor.shape:
                raise ValueError(
                    f"{item.template} (layer {item.layer}, expert {item.expert}): checkpoint gives "
                    f"{tuple(shard.shape)} for tp rank {rank}/{size}, model has {tuple(item.tensor.shape)}"
                )
            with torch.no_grad():
                item.tensor.copy_(shard)

    def export(self, model: torch.nn.Module, groups: ParallelGroups) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors in the model's order; every expert appears once.

        A collective over the TP, expert-TP and EP groups: every rank of them must consume the
        iterator to the end, in step; every rank gets every tensor.
        """
        for item in model_tensors(model, 0, groups.ep_size):
            mapping = self._mapping(item.template)
            if not mapping.export:
                continue
            if not item.experts:
                full = mapping.to_hf(tp_shards(item.tensor, mapping, groups.tp_size, groups.tp_group))
                for name, tensor in zip(mapping.hf, full, strict=True):
                    yield name.format(i=item.layer), tensor
                continue
            full = mapping.to_hf(tp_shards(item.tensor, mapping, groups.etp_size, groups.etp_group))
            for name, per_rank in zip(mapping.hf, full, strict=True):
                every_rank = gather_shards(per_rank, groups.ep_size, groups.ep_group)
                for expert, tensor in zip(item.experts, every_rank, strict=True):
                    yield name.format(i=item.layer, e=expert), tensor


def _check_partitioning(template: str, mapping: TensorMapping, tensor: torch.Tensor) -> None:
    """A table that disagrees with Megatron's TP split would load scrambled weights."""
    if getattr(tensor, "tensor_model_parallel", False) and tensor.partition_dim != mapping.tp_dim:
        raise ValueError(
            f"{template}: Megatron splits dim {tensor.partition_dim}, mapping says {mapping.tp_dim}"
        )


# ---- tables ----------------------------------------------------------------------------------------


def moe_mappings(*, shared_experts: bool, expert_bias: bool) -> dict[str, TensorMapping]:
    """Router, routed experts and (optionally) shared experts and the selection bias of one MoE layer.

    HF layout (Qwen3-MoE, DeepSeek-V3): `mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj`,
    `mlp.shared_experts.{gate,up,down}_proj`, `mlp.gate.e_score_correction_bias`.
    """
    hf, mg = "model.layers.{i}.mlp", "decoder.layers.{i}.mlp"
    table: dict[str, TensorMapping] = {
        f"{mg}.router.weight": Replicated((f"{hf}.gate.weight",)),
        f"{mg}.experts.local_experts.{{e}}.linear_fc1.weight": GatedMLP(
            (f"{hf}.experts.{{e}}.gate_proj.weight", f"{hf}.experts.{{e}}.up_proj.weight")
        ),
        f"{mg}.experts.local_experts.{{e}}.linear_fc2.weight": Split(
            (f"{hf}.experts.{{e}}.down_proj.weight",), tp_dim=1
        ),
    }
    if shared_experts:
        table[f"{mg}.shared_experts.linear_fc1.weight"] = GatedMLP(
            (f"{hf}.shared_experts.gate_proj.weight", f"{hf}.shared_experts.up_proj.weight")
        )
        table[f"{mg}.shared_experts.linear_fc2.weight"] = Split(
            (f"{hf}.shared_experts.down_proj.weight",), tp_dim=1
        )
    if expert_bias:
        table[f"{mg}.router.expert_bias"] = Replicated((f"{hf}.gate.e_score_correction_bias",))
    return table


def mla_mappings(*, q_lora: bool) -> dict[str, TensorMapping]:
    """DeepSeek's multi-latent attention: HF `self_attn.*` -> Megatron `MLASelfAttention`.

    The latent down-projections are whole on every rank (`rlx.models.moe_family`), the up
    projections split heads (HF's head-major rows unchanged), the output projection is
    row-parallel.
    """
    hf, mg = "model.layers.{i}.self_attn", "decoder.layers.{i}.self_attention"
    table: dict[str, TensorMapping] = {
        f"{mg}.linear_kv_down_proj.weight": Replicated((f"{hf}.kv_a_proj_with_mqa.weight",)),
        f"{mg}.kv_layernorm.weight": Replicated((f"{hf}.kv_a_layernorm.weight",)),
        f"{mg}.linear_kv_up_proj.weight": Split((f"{hf}.kv_b_proj.weight",), tp_dim=0),
        f"{mg}.linear_proj.weight": Split((f"{hf}.o_proj.weight",), tp_dim=1),
    }
    if q_lora:
        table[f"{mg}.linear_q_down_proj.weight"] = Replicated((f"{hf}.q_a_proj.weight",))
        table[f"{mg}.q_layernorm.weight"] = Replicated((f"{hf}.q_a_layernorm.weight",))
        table[f"{mg}.linear_q_up_proj.weight"] = Split((f"{hf}.q_b_proj.weight",), tp_dim=0)
    else:
        table[f"{mg}.linear_q_proj.weight"] = Split((f"{hf}.q_proj.weight",), tp_dim=0)
    return table
