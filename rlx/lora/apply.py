"""Putting adapters on a built model: which layers, their initial values, freezing the rest.

`apply_lora` runs on each model chunk after its base weights are loaded and before megatron's
DDP and optimizer are built, so DDP makes gradient buffers for the adapters only and the
optimizer keeps state (and fp32 master copies) for them only.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from rlx.lora.adapter import BASE_ATTR, LoRAAdapter, add_update, is_adapter, kaiming_a
from rlx.lora.config import ALL_LINEAR, LoRAConfig

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")
ROUTED_EXPERT = ".experts.local_experts."  # in the module name of a routed expert's layer


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig, seed: int) -> list[str]:
    """Adapters on `model`'s (a bare GPTModel chunk) decoder column- and row-parallel linear layers
    named in `cfg.target_modules` (all of them for all-linear; routed experts' only with
    `cfg.experts`), every other parameter frozen. Returns the adapted layers' names in the model's
    global numbering.

    A's initial value is drawn from `seed` and the layer's global name (its global layer and
    expert index), so every layout starts from the same adapters; B starts at zero."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    every = ALL_LINEAR in cfg.target_modules
    adapted = []
    for name, module in list(model.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        if not (every or leaf in cfg.target_modules) or _LAYER.match(name) is None:
            continue  # the decoder's layers only: not the output layer
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            continue
        if ROUTED_EXPERT in name and not cfg.experts:
            continue
        if getattr(module, "gather_output", False):
            raise ValueError(f"{name}: LoRA adapts column-parallel layers with split outputs only")
        global_name = _global_name(model, name)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(global_name.encode()))
        adapter = LoRAAdapter(
            module,
            row_parallel=isinstance(module, RowParallelLinear),
            rank=cfg.rank,
            scale=cfg.scale,
            dropout=cfg.dropout,
            init_a=kaiming_a(cfg.rank, module.input_size, generator),
            swiglu=leaf == "linear_fc1" and module.config.gated_linear_unit,
        )
        model.get_submodule(parent_name).add_module(f"{leaf}_lora", adapter)
        setattr(module.weight, BASE_ATTR, adapter)
        module.register_forward_hook(add_update)
        adapted.append(global_name)
    for param in model.parameters():
        param.requires_grad_(is_adapter(param))
    return adapted


def adapters(model: torch.nn.Module) -> Iterator[tuple[str, LoRAAdapter]]:
    """(adapted layer's module name, its adapter) of `model` (DDP-wrapped or bare), in order."""
    while hasattr(model, "module"):  # megatron's DDP and Float16Module wrappers
        model = model.module
    for name, module in model.named_modules():
        if isinstance(module, LoRAAdapter):
            parent, _, leaf = name.rpartition(".")
            yield f"{parent}.{leaf.removesuffix('_lora')}", module


@contextmanager
def disabled(chunks: list[torch.nn.Module]):
    """The base model: every adapter of `chunks` off inside the block (the frozen reference
    policy of a LoRA run is its own base, so it needs no second copy of the weights)."""
    found = [adapter for chunk in chunks for _, adapter in adapters(chunk)]
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True


def _global_name(model: torch.nn.Module, name: str) -> str:
    """`name` with this stage's local layer index and this EP rank's local expert index made global."""
    from megatron.core import parallel_state as ps

    match = _LAYER.match(name)
    if match is None:
        return name
    layer = model.decoder.layers[int(match.group(1))]
    name = f"decoder.layers.{layer.layer_number - 1}.{name[match.end() :]}"
    expert = _LOCAL_EXPERT.search(name)
    if expert is not None:
        num_local = layer.mlp.experts.num_local_experts
        global_expert = ps.get_expert_model_parallel_rank() * num_local + int(expert.group(1))
        name = f"{name[: expert.start()]}.experts.{global_expert}.{name[expert.end() :]}"
    return name
