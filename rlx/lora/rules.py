"""The `train.lora` rules checked at compose time (from `rlx.config.validate`), before any
process starts: its own fields, the layer names against the model's, and what LoRA cannot do."""

from __future__ import annotations

from rlx.config.rules import field_errors
from rlx.lora.config import ALL_LINEAR, LoRAConfig

# HF / PEFT names a user may bring, and the Megatron layer that holds each (fused where HF splits)
HF_NAMES = {
    "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "qkv_proj": "linear_qkv",
    "query_key_value": "linear_qkv", "o_proj": "linear_proj", "dense": "linear_proj",
    "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "gate_up_proj": "linear_fc1", "down_proj": "linear_fc2",
}  # fmt: skip


def lora_errors(cfg, family, needs_critic: bool) -> list[str]:
    """`cfg` (an RlxConfig)'s train.lora against itself, the model `family` (a built ModelFamily,
    or None for a model class of the user's own) and the algorithm (`needs_critic`)."""
    lora: LoRAConfig = cfg.train.lora
    errors = field_errors(lora, LoRAConfig, "train.lora")
    if not lora.enabled:
        return errors
    if needs_critic:
        errors.append(
            f"train.lora.rank={lora.rank} with algo._target_={cfg.algo._target_}: LoRA trains the policy only, "
            "and this algorithm trains a critic from the same model, fully; use a critic-free algorithm "
            "(algo=grpo, gspo, reinforce_pp) with LoRA, or unset train.lora.rank"
        )
    if family is None:
        return errors
    names = family.lora_modules()
    if not lora.target_modules:
        errors.append(
            f"train.lora.target_modules is empty; list layers to adapt from {_listing(names)}, or [{ALL_LINEAR}]"
        )
    for name in lora.target_modules:
        if name == ALL_LINEAR or name in names:
            continue
        fix = f"the model's layers LoRA can adapt are {_listing(names)} (or {ALL_LINEAR} for all of them)"
        if HF_NAMES.get(name) in names:
            fix = f"{name} is HF's name: rlx adapts Megatron's layers, and {HF_NAMES[name]} holds it; {fix}"
        errors.append(f"train.lora.target_modules: {name} names no layer of model={_model_name(cfg)}; {fix}")
    has_experts = bool(getattr(cfg.model, "num_moe_experts", None))
    if lora.experts and not has_experts:
        errors.append(
            f"train.lora.experts=true, but model={_model_name(cfg)} has no routed experts; set train.lora.experts=false"
        )
    elif lora.experts and cfg.cluster.tensor_parallel_size > 1:
        errors.append(
            f"train.lora.experts=true with cluster.tensor_parallel_size={cfg.cluster.tensor_parallel_size}: "
            "rlx's experts keep the dense TP size and LoRA adapts experts only unsplit; use "
            "cluster.tensor_parallel_size=1 (spread the experts with cluster.expert_parallel_size), "
            "or set train.lora.experts=false"
        )
    return errors


def _listing(names) -> str:
    return ", ".join(names)


def _model_name(cfg) -> str:
    return getattr(cfg.model, "name", None) or type(cfg.model).__name__
