"""Qwen3's HF side: its transformers config, where our keys live in config.json, its weight table."""

from __future__ import annotations

from typing import Any

from rlx.models.bridge import Replicated, TensorMapping, llama_style_mappings
from rlx.models.config import ModelConfig
from rlx.models.hf_config import HFField, dense_hf_fields, dense_hf_kwargs


def hf_fields(cfg: ModelConfig) -> dict[str, HFField]:
    """config.json keys per ModelConfig key; defaults are Qwen3Config's when a key is absent."""
    return dense_hf_fields(cfg, head_dim=HFField(("head_dim",), default=128), norm_epsilon_default=1e-6)


HF_CONFIG = "Qwen3Config"  # the transformers config class of hf_config_kwargs


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """`transformers.Qwen3Config`'s kwargs for `cfg`'s shape; tiny models get the tiny vocabulary's pad/eos ids."""
    return dense_hf_kwargs(
        cfg,
        attention_bias=False,
    )


def weight_mappings(cfg: ModelConfig) -> dict[str, TensorMapping]:
    """Megatron parameter template -> HF tensors for Qwen3: Llama's table plus the qk-norms."""
    mappings = llama_style_mappings(
        num_heads=cfg.num_attention_heads,
        num_groups=cfg.num_query_groups,
        head_dim=cfg.kv_channels,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    attn = "model.layers.{i}.self_attn"
    mappings["decoder.layers.{i}.self_attention.q_layernorm.weight"] = Replicated((f"{attn}.q_norm.weight",))
    mappings["decoder.layers.{i}.self_attention.k_layernorm.weight"] = Replicated((f"{attn}.k_norm.weight",))
    return mappings
