"""A trained policy's adapters in PEFT's format, which the `peft` package loads onto the base
model in transformers (`PeftModel.from_pretrained(base, DIR)`):

    DIR/adapter_config.json          peft_type LORA, r, lora_alpha, lora_dropout, target_modules
    DIR/adapter_model.safetensors    base_model.model.<HF module>.lora_A.weight [r, in], .lora_B.weight [out, r]

Megatron fuses layers HF keeps apart (q/k/v in `linear_qkv`, gate/up in `linear_fc1`); the
fused layer's update B @ A splits by B's rows exactly as its weight does, so each HF module gets
the shared A and its own rows of B, through the weight bridge's own mapping of the layer's
weight (`TensorMapping.to_hf`, applied to B instead of W). A row-parallel layer's A is gathered
over TP the way its weight is. The result is the same update, module by module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from rlx.lora.adapter import BASE_ATTR, LoRAAdapter
from rlx.lora.config import ALL_LINEAR

CONFIG_NAME, WEIGHTS_NAME = "adapter_config.json", "adapter_model.safetensors"


def unsupported(model, lora) -> str | None:
    """Why the adapters of `model` (a ModelConfig) under `lora` (its train.lora) have no PEFT export
    that `peft` loads right, or None. peft (0.21) takes an MoE model's adapters as written for
    transformers v4 and moves every `gate_proj` / `up_proj` / `down_proj` onto transformers v5's
    fused routed experts, so the adapters of an MoE model's MLPs (dense layers, shared experts) would
    load onto the experts; and routed experts' own adapters have no per-expert module there."""
    if not model.num_moe_experts:
        return None
    mlp = ALL_LINEAR in lora.target_modules or {"linear_fc1", "linear_fc2"} & set(lora.target_modules)
    dense_mlps = model.moe_first_dense_layers or model.moe_shared_expert_intermediate_size or lora.experts
    if not (mlp and dense_mlps):
        return None
    return (
        f"model={model.name} is an MoE model with adapted MLP layers, whose adapters peft loads onto the "
        "fused routed experts (its transformers v4 -> v5 mapping); the merged model (hf/, or "
        "python -m rlx.tools.export RUN) holds them all; for a PEFT adapter, adapt attention only "
        "(train.lora.target_modules=[...] without linear_fc1 and linear_fc2)"
    )


def peft_tensors(
    bridge, chunk: torch.nn.Module, tp_group, tp_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT key, tensor) of every adapter of this rank's model `chunk`, whole over TP; `bridge`
    is the family's `WeightBridge` (its table maps each adapted weight to HF modules). A
    collective over `tp_group`, like the bridge's export: every TP rank must consume it in step.
    Check `unsupported` first."""
    from rlx.models.bridge import gather_shards, named_parameters

    for template, layer, param in named_parameters(chunk):
        adapter: LoRAAdapter | None = getattr(param, BASE_ATTR, None)
        if adapter is None:
            continue
        mapping = bridge._mapping(template)
        split, whole = (adapter.a, adapter.b) if adapter.row_parallel else (adapter.b, adapter.a)
        shards = gather_shards(split.detach(), tp_size, tp_group)
        parts = mapping.to_hf(shards)  # the split factor laid out as HF's modules
        for hf_name, part in zip(mapping.hf, parts, strict=True):
            module = f"base_model.model.{hf_name.format(i=layer).removesuffix('.weight')}"
            a, b = (part, whole.detach()) if adapter.row_parallel else (whole.detach(), part)
            yield f"{module}.lora_A.weight", a.clone()  # shared by q/k/v (gate/up): one copy each
            yield f"{module}.lora_B.weight", b.contiguous()


def write_peft(named: Iterator[tuple[str, torch.Tensor]], out_dir: Path, lora: dict, base_model: str) -> Path:
    """Write the PEFT directory from `peft_tensors`' pairs (every stage's) and the run's
    `train.lora` settings `lora`; `base_model`: the HF directory the adapters go on."""
    from safetensors.torch import save_file

    tensors = {name: tensor.to("cpu") for name, tensor in named}
    modules = sorted({name.split(".")[-3] for name in tensors})  # ...<module>.lora_A.weight
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model),
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=1))
    return out_dir
