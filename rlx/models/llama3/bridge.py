"""Llama 3's HF side (`LlamaForCausalLM`): its transformers config, config.json keys, weight table."""

from __future__ import annotations

from typing import Any

from rlx.models.bridge import TensorMapping, llama_style_mappings
from rlx.models.config import ModelConfig
from rlx.models.hf_config import HFField, dense_hf_fields, dense_hf_kwargs


def hf_fields(cfg: ModelConfig) -> dict[str, HFField]:
    """config.json keys per ModelConfig key; defaults are LlamaConfig's when a key is absent.

    Llama-3.1-8B's config.json has no head_dim: LlamaConfig then uses hidden_size / heads.
    """
    head_dim = HFField(("head_dim",), derive=lambda hf: hf["hidden_size"] // hf["num_attention_heads"])
    return dense_hf_fields(cfg, head_dim=head_dim, norm_epsilon_default=1e-6)


HF_CONFIG = "LlamaConfig"  # the transformers config class of hf_config_kwargs


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """`transformers.LlamaConfig`'s kwargs for `cfg`'s shape; tiny models get the tiny vocabulary's pad/eos ids."""
    return dense_hf_kwargs(
        cfg,
        attention_bias=False,
        mlp_bias=False,
    )


def weight_mappings(cfg: ModelConfig) -> dict[str, TensorMapping]:
    """Megatron parameter template -> HF tensors: the plain Llama layout."""
    return llama_style_mappings(
        num_heads=cfg.num_attention_heads,
        num_groups=cfg.num_query_groups,
        head_dim=cfg.kv_channels,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
