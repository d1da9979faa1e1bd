"""HF <-> Megatron weight bridge, shared by every model family.

A family describes its weights as a table: Megatron parameter name template -> `TensorMapping`
(which HF tensors it comes from, how their layout changes, how tensor parallelism splits it).
Templates use `{i}` for the global layer index. `WeightBridge` walks a model's own parameters,
so whatever this rank holds (a TP shard, a PP stage) is exactly what is loaded or exported.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rlx.lora.adapter import is_adapter, merged_weight

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class TensorMapping:
    """How one Megatron parameter relates to HF tensors.

    `hf` are HF name templates; `tp_dim` is the Megatron dimension split across tensor-parallel
    ranks (None: replicated); `export` False leaves the parameter out of HF exports (a tied
    output layer, which HF stores once as the embedding).
    """

    hf: tuple[str, ...]
    tp_dim: int | None
    export: bool = True

    def to_megatron(self, hf_tensors: list[torch.Tensor], tp_rank: int, tp_size: int) -> torch.Tensor:
        """This rank's Megatron tensor from the full HF tensors."""
        raise NotImplementedError

    def to_hf(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """Full HF tensors from every TP rank's shard, in rank order (one shard if replicated)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Replicated(TensorMapping):
    """Same tensor on every TP rank (norm weights)."""

    hf: tuple[str, ...]
    tp_dim: None = None
    export: bool = True

    def to_megatron(self, hf_tensors, tp_rank, tp_size):
        return hf_tensors[0]

    def to_hf(self, shards):
        return [shards[0]]


@dataclass(frozen=True)
class Split(TensorMapping):
    """One HF tensor split in contiguous chunks along `tp_dim`.

    Dimension 0 is column-parallel and vocab-parallel layers, dimension 1 row-parallel ones.
    """

    hf: tuple[str, ...]
    tp_dim: int = 0
    export: bool = True

    def to_megatron(self, hf_tensors, tp_rank, tp_size):
        return hf_tensors[0].chunk(tp_size, dim=self.tp_dim)[tp_rank]

    def to_hf(self, shards):
        return [torch.cat(shards, dim=self.tp_dim)]


@dataclass(frozen=True)
class FusedQKV(TensorMapping):
    """HF q, k, v projections -> Megatron's fused `linear_qkv` (column-parallel).

    Megatron interleaves per query group: for each of the `num_groups` KV heads, that group's
    `num_heads / num_groups` query heads, then its key head, then its value head. TP rank r
    holds a contiguous run of whole groups.
    """

    hf: tuple[str, ...]  # (q, k, v)
    num_heads: int = 0
    num_groups: int = 0
    head_dim: int = 0
    tp_dim: int = 0
    export: bool = True

    def to_megatron(self, hf_tensors, tp_rank, tp_size):
        q, k, v = hf_tensors
        heads_per_group, d = self.num_heads // self.num_groups, self.head_dim
        groups = self.num_groups // tp_size
        rows = []
        for g in range(tp_rank * groups, (tp_rank + 1) * groups):
            rows += [
                q[g * heads_per_group * d : (g + 1) * heads_per_group * d],
                k[g * d : (g + 1) * d],
                v[g * d : (g + 1) * d],
            ]
        return torch.cat(rows, dim=0)

    def to_hf(self, shards):
        fused = torch.cat(shards, dim=0)
        heads_per_group, d = self.num_heads // self.num_groups, self.head_dim
        grouped = fused.view(self.num_groups, heads_per_group + 2, d, *fused.shape[1:])
        q = grouped[:, :heads_per_group].reshape(self.num_heads * d, *fused.shape[1:])
        k = grouped[:, heads_per_group].reshape(self.num_groups * d, *fused.shape[1:])
        v = grouped[:, heads_per_group + 1].reshape(self.num_groups * d, *fused.shape[1:])
        return [q.contiguous(), k.contiguous(), v.contiguous()]


@dataclass(frozen=True)
class GatedMLP(TensorMapping):
    """HF gate and up projections -> Megatron's `linear_fc1` = [gate; up] (column-parallel).

    Megatron splits each rank's fc1 output in half, so rank r holds [gate_r; up_r], not a
    contiguous chunk of the full [gate; up].
    """

    hf: tuple[str, ...]  # (gate, up)
    tp_dim: int = 0
    export: bool = True

    def to_megatron(self, hf_tensors, tp_rank, tp_size):
        gate, up = (t.chunk(tp_size, dim=0)[tp_rank] for t in hf_tensors)
        return torch.cat([gate, up], dim=0)

    def to_hf(self, shards):
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]


@dataclass(frozen=True)
class FusedGatedMLP(GatedMLP):
    """One HF tensor holding [gate; up] (GLM-4's `gate_up_proj`) -> Megatron's `linear_fc1`.

    The same per-rank layout as `GatedMLP`: rank r holds [gate_r; up_r], so the HF tensor is
    split into its halves first rather than chunked whole.
    """

    hf: tuple[str, ...]  # (gate_up,)

    def to_megatron(self, hf_tensors, tp_rank, tp_size):
        return super().to_megatron(list(hf_tensors[0].chunk(2, dim=0)), tp_rank, tp_size)

    def to_hf(self, shards):
        return [torch.cat(super().to_hf(shards), dim=0)]


class SafetensorsReader:
    """Reads single HF tensors from a checkpoint directory (one file, or sharded with an index)."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.hf_dir = Path(hf_dir)
        index = self.hf_dir / "model.safetensors.index.json"
        if index.exists():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        else:
            single = self.hf_dir / "model.safetensors"
            if not single.exists():
                raise FileNotFoundError(f"no model.safetensors or its index in {self.hf_dir}")
            with safe_open(str(single), framework="pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), single.name)
        self._open = safe_open
        self._handles: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        """The full tensor `name` (memory-mapped file, so only this tensor is read)."""
        if name not in self.weight_map:
            raise KeyError(f"{name} is not in the checkpoint at {self.hf_dir}")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = self._open(str(self.hf_dir / file), framework="pt", device="cpu")
        return self._handles[file].get_tensor(name)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The bare model inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, int | None, torch.nn.Parameter]]:
    """(name template, global layer index or None, parameter) in the model's own order.

    Layer indices are made global from each layer's `layer_number`, so a pipeline stage's local
    layer 0 maps to its true HF layer.
    """
    model = unwrap(model)
    layers = model.decoder.layers if hasattr(model, "decoder") else None
    for name, param in model.named_parameters():
        if is_adapter(param):  # LoRA's factors: exported merged into their layer's weight
            continue
        match = _LAYER.match(name)
        if match is None:
            yield name, None, param
        else:
            local, rest = int(match.group(1)), match.group(2)
            yield f"decoder.layers.{{i}}.{rest}", layers[local].layer_number - 1, param


class WeightBridge:
    """Loads HF checkpoints into Megatron models and exports them back, per a mapping table."""

    def __init__(self, mappings: dict[str, TensorMapping]):
        self.mappings = mappings

    def _mapping(self, template: str) -> TensorMapping:
        if template not in self.mappings:
            raise KeyError(f"no HF mapping for Megatron parameter {template}")
        return self.mappings[template]

    def load(self, model: torch.nn.Module, hf_dir: str | Path, tp_rank: int, tp_size: int) -> None:
        """Copy every parameter of `model` from the HF checkpoint, one tensor at a time."""
        reader = SafetensorsReader(hf_dir)
        for template, layer, param in named_parameters(model):
            mapping = self._mapping(template)
            _check_partitioning(template, mapping, param)
            hf_tensors = [reader.get(h.format(i=layer)) for h in mapping.hf]
            shard = mapping.to_megatron(hf_tensors, tp_rank, tp_size)
            if shard.shape != param.shape:
                raise ValueError(
                    f"{template} (layer {layer}): checkpoint gives {tuple(shard.shape)} for tp rank "
                    f"{tp_rank}/{tp_size}, model has {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(shard)
            del hf_tensors, shard

    def export(
        self, model: torch.nn.Module, tp_group: dist.ProcessGroup | None, tp_size: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one at a time, in the model's parameter order.

        Split parameters are all-gathered over `tp_group`: every TP rank must consume the
        iterator to the end, in step, and every rank gets the full tensors.
        """
        for template, layer, param in named_parameters(model):
            mapping = self._mapping(template)
            if not mapping.export:
                continue
            shards = tp_shards(param, mapping, tp_size, tp_group)
            for name, tensor in zip(mapping.hf, mapping.to_hf(shards), strict=True):
                yield name.format(i=layer), tensor
            del shards


def tp_shards(
    param: torch.Tensor, mapping: TensorMapping, size: int, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """Every rank's shard of `param` as exported (with its LoRA update, if adapted), in rank order:
    gathered over `group` (`size` ranks) when `mapping` splits it, else one copy."""
    local = merged_weight(param)
    if mapping.tp_dim is None or size == 1:
        return [local.clone()]
    return gather_shards(local, size, group)


def gather_shards(tensor: torch.Tensor, size: int, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every rank's `tensor` over `group` (`size` ranks), in rank order ([tensor] itself for one)."""
    if size == 1:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def _check_partitioning(template: str, mapping: TensorMapping, param: torch.nn.Parameter) -> None:
    """Megatron marks TP-split parameters; a table that disagrees would load scrambled weights.

    Marks are only set when Megatron initialises weights (`perform_initialization`), so an
    unmarked parameter is not checked.
    """
    if not getattr(param, "tensor_model_parallel", False):
        return
    split_dim = param.partition_dim
    if split_dim != mapping.tp_dim:
        raise ValueError(f"{template}: Megatron splits dim {split_dim}, mapping says {mapping.tp_dim}")


def llama_style_mappings(
    *, num_heads: int, num_groups: int, head_dim: int, tie_word_embeddings: bool
) -> dict[str, TensorMapping]:
    """The table for HF's Llama layout (Llama, Qwen, Mistral...), without per-family extras."""
    layer = "model.layers.{i}"
    embed = Split(("model.embed_tokens.weight",), tp_dim=0)
    return {
        "embedding.word_embeddings.weight": embed,
        "decoder.final_layernorm.weight": Replicated(("model.norm.weight",)),
        # Tied: only a later pipeline stage holds its own output copy; HF stores it once.
        "output_layer.weight": (
            Split(("model.embed_tokens.weight",), tp_dim=0, export=False)
            if tie_word_embeddings
            else Split(("lm_head.weight",), tp_dim=0)
        ),
        "decoder.layers.{i}.input_layernorm.weight": Replicated((f"{layer}.input_layernorm.weight",)),
        "decoder.layers.{i}.self_attention.linear_qkv.weight": FusedQKV(
            tuple(f"{layer}.self_attn.{p}_proj.weight" for p in "qkv"),
            num_heads=num_heads,
            num_groups=num_groups,
            head_dim=head_dim,
        ),
        "decoder.layers.{i}.self_attention.linear_proj.weight": Split(
            (f"{layer}.self_attn.o_proj.weight",), tp_dim=1
        ),
        "decoder.layers.{i}.pre_mlp_layernorm.weight": Replicated(
            (f"{layer}.post_attention_layernorm.weight",)
        ),
        "decoder.layers.{i}.mlp.linear_fc1.weight": GatedMLP(
            (f"{layer}.mlp.gate_proj.weight", f"{layer}.mlp.up_proj.weight")
        ),
        "decoder.layers.{i}.mlp.linear_fc2.weight": Split((f"{layer}.mlp.down_proj.weight",), tp_dim=1),
    }
