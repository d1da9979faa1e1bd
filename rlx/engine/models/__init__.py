"""Model families of the engine's fast path, by HF `model_type`; anything else runs through
transformers' own model (`hf_generic`, slower: no paged KV, recomputed each step)."""

from __future__ import annotations

from rlx.engine.models.dense import CausalLM
from rlx.engine.models.qwen3_moe import Qwen3MoeLM

FAMILIES: dict[str, type[CausalLM]] = {  # keyed as `rlx.engine.config.MODEL_TYPES` names them
    "qwen3": CausalLM,
    "llama": CausalLM,
    "glm4": CausalLM,
    "qwen3_moe": Qwen3MoeLM,
}

__all__ = ["FAMILIES", "CausalLM", "Qwen3MoeLM"]
