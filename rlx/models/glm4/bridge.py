"""GLM-4's HF side (`Glm4ForCausalLM`): its transformers config, config.json keys, weight table."""

from __future__ import annotations

from typing import Any

from rlx.models.bridge import FusedGatedMLP, FusedQKV, Replicated, TensorMapping, llama_style_mappings
from rlx.models.config import ModelConfig
from rlx.models.hf_config import HFField, dense_hf_fields, dense_hf_kwargs, rope_parameters


def hf_fields(cfg: ModelConfig) -> dict[str, HFField]:
    """config.json keys per ModelConfig key; defaults are Glm4Config's when a key is absent
    (attention_bias true, partial_rotary_factor 0.5, rms_norm_eps 1.5625e-07, head_dim 128)."""
    fields = dense_hf_fields(
        cfg,
        head_dim=HFField(("head_dim",), default=128),
        norm_epsilon_default=1.5625e-07,
        partial_rotary_default=0.5,
    )
    fields["add_qkv_bias"] = HFField(("attention_bias",), default=True)
    return fields


HF_CONFIG = "Glm4Config"  # the transformers config class of hf_config_kwargs


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """`transformers.Glm4Config`'s kwargs for `cfg`'s shape; tiny models get the tiny vocabulary's pad/eos ids."""
    return dense_hf_kwargs(
        cfg,
        # Always written: Glm4Config assumes 0.5 when partial_rotary_factor is absent.
        rope_parameters=rope_parameters(cfg) | {"partial_rotary_factor": cfg.rotary_percent},
        attention_bias=cfg.add_qkv_bias,
    )


def weight_mappings(cfg: ModelConfig) -> dict[str, TensorMapping]:
    """Megatron parameter template -> HF tensors: Llama's table with GLM-4's fused gate_up_proj,
    q/k/v biases and the two post-sublayer norms."""
    mappings = llama_style_mappings(
        num_heads=cfg.num_attention_heads,
        num_groups=cfg.num_query_groups,
        head_dim=cfg.kv_channels,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    layer, megatron = "model.layers.{i}", "decoder.layers.{i}"
    mappings[f"{megatron}.mlp.linear_fc1.weight"] = FusedGatedMLP((f"{layer}.mlp.gate_up_proj.weight",))
    if cfg.add_qkv_bias:
        mappings[f"{megatron}.self_attention.linear_qkv.bias"] = FusedQKV(
            tuple(f"{layer}.self_attn.{p}_proj.bias" for p in "qkv"),
            num_heads=cfg.num_attention_heads,
            num_groups=cfg.num_query_groups,
            head_dim=cfg.kv_channels,
        )
    for norm in ("post_self_attn_layernorm", "post_mlp_layernorm"):
        mappings[f"{megatron}.{norm}.weight"] = Replicated((f"{layer}.{norm}.weight",))
    return mappings
