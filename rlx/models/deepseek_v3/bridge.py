"""DeepSeek-V3's HF side: its transformers config, where our keys live in config.json, its weight table.

DeepSeek-V3 = multi-latent attention in every layer, a dense SwiGLU MLP in the first
`first_k_dense_replace` layers, and after them an MoE block: sigmoid router with a per-expert
selection bias and group-limited top-k, routed experts and shared experts.
"""

from __future__ import annotations

from typing import Any

from rlx.errors import ConfigError
from rlx.models.bridge import TensorMapping, llama_style_mappings
from rlx.models.config import ModelConfig
from rlx.models.hf_config import HFField, tiny_token_ids
from rlx.models.moe_bridge import mla_mappings, moe_mappings


def _rope(key: str) -> tuple[str, ...]:
    # transformers 5 writes rope_parameters; released checkpoints have rope_scaling (and rope_theta).
    return (f"rope_parameters.{key}", f"rope_scaling.{key}")


def hf_fields(cfg: ModelConfig) -> dict[str, HFField]:
    """config.json keys per ModelConfig key; defaults are DeepseekV3Config's when a key is absent."""
    fields = {
        "num_layers": HFField(("num_hidden_layers",)),
        "hidden_size": HFField(("hidden_size",)),
        "ffn_hidden_size": HFField(("intermediate_size",)),
        "num_attention_heads": HFField(("num_attention_heads",)),
        "num_query_groups": HFField(("num_key_value_heads",), derive=lambda hf: hf["num_attention_heads"]),
        # Megatron's bookkeeping head size: MLA's query/key head, its non-rotary part plus the rotary one
        "kv_channels": HFField(
            (), derive=lambda hf: hf.get("qk_nope_head_dim", 128) + hf.get("qk_rope_head_dim", 64)
        ),
        "vocab_size": HFField(("vocab_size",)),
        "max_position_embeddings": HFField(("max_position_embeddings",)),
        "rotary_base": HFField(("rope_parameters.rope_theta", "rope_theta"), default=10000.0),
        "norm_epsilon": HFField(("rms_norm_eps",), default=1e-6),
        "tie_word_embeddings": HFField(("tie_word_embeddings",), default=False),
        "num_moe_experts": HFField(("n_routed_experts",), default=256),
        "moe_router_topk": HFField(("num_experts_per_tok",), default=8),
        "moe_ffn_hidden_size": HFField(("moe_intermediate_size",), default=2048),
        "moe_shared_expert_intermediate_size": HFField(
            (), derive=lambda hf: hf.get("n_shared_experts", 1) * hf.get("moe_intermediate_size", 2048)
        ),
        "moe_router_topk_scaling_factor": HFField(("routed_scaling_factor",), default=2.5),
        "moe_router_num_groups": HFField(("n_group",), default=8),
        "moe_router_group_topk": HFField(("topk_group",), default=4),
        "moe_router_norm_topk_prob": HFField(("norm_topk_prob",), default=True),
        "moe_first_dense_layers": HFField(("first_k_dense_replace",), default=3),
        "q_lora_rank": HFField(("q_lora_rank",), default=1536),
        "kv_lora_rank": HFField(("kv_lora_rank",), default=512),
        "qk_head_dim": HFField(("qk_nope_head_dim",), default=128),
        "qk_pos_emb_head_dim": HFField(("qk_rope_head_dim",), default=64),
        "v_head_dim": HFField(("v_head_dim",), default=128),
        # Absent: plain RoPE. A checkpoint with YaRN is refused by a config without it.
        "yarn_rotary_scaling_factor": HFField(_rope("factor"), default=None),
    }
    if cfg.yarn_rotary_scaling_factor is not None:
        fields |= {
            "yarn_original_max_position_embeddings": HFField(_rope("original_max_position_embeddings")),
            "yarn_beta_fast": HFField(_rope("beta_fast"), default=32.0),
            "yarn_beta_slow": HFField(_rope("beta_slow"), default=1.0),
            "yarn_mscale": HFField(_rope("mscale"), default=1.0),
            "yarn_mscale_all_dim": HFField(_rope("mscale_all_dim"), default=0.0),
        }
    return fields


def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' `rope_parameters`: YaRN when `model.yarn_rotary_scaling_factor` is set."""
    if cfg.yarn_rotary_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": cfg.rotary_base}
    return {
        "rope_type": "yarn",
        "rope_theta": cfg.rotary_base,
        "factor": cfg.yarn_rotary_scaling_factor,
        "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings,
        "beta_fast": cfg.yarn_beta_fast,
        "beta_slow": cfg.yarn_beta_slow,
        "mscale": cfg.yarn_mscale,
        "mscale_all_dim": cfg.yarn_mscale_all_dim,
    }


HF_CONFIG = "DeepseekV3Config"  # the transformers config class of hf_config_kwargs


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """`transformers.DeepseekV3Config`'s kwargs for `cfg`'s shape (no multi-token-prediction layers)."""
    num_shared, rest = divmod(cfg.moe_shared_expert_intermediate_size or 0, cfg.moe_ffn_hidden_size)
    if rest:
        raise ConfigError(
            f"model.moe_shared_expert_intermediate_size={cfg.moe_shared_expert_intermediate_size} must be "
            f"a multiple of model.moe_ffn_hidden_size={cfg.moe_ffn_hidden_size} (HF counts shared experts)"
        )
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        n_shared_experts=num_shared,
        n_routed_experts=cfg.num_moe_experts,
        routed_scaling_factor=cfg.moe_router_topk_scaling_factor or 1.0,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.qk_pos_emb_head_dim,
        v_head_dim=cfg.v_head_dim,
        qk_nope_head_dim=cfg.qk_head_dim,
        n_group=cfg.moe_router_num_groups or 1,
        topk_group=cfg.moe_router_group_topk or 1,
        num_experts_per_tok=cfg.moe_router_topk,
        first_k_dense_replace=cfg.moe_first_dense_layers,
        norm_topk_prob=cfg.moe_router_norm_topk_prob,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters=rope_parameters(cfg),
        rope_interleave=True,
        attention_bias=False,
        num_nextn_predict_layers=0,
        **tiny_token_ids(cfg),
    )


def weight_mappings(cfg: ModelConfig) -> dict[str, TensorMapping]:
    """Embeddings, norms and dense MLPs in Llama's layout; MLA attention; the MoE block."""
    table = llama_style_mappings(
        num_heads=cfg.num_attention_heads,
        num_groups=cfg.num_query_groups,
        head_dim=cfg.qk_head_dim,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    del table["decoder.layers.{i}.self_attention.linear_qkv.weight"]
    table |= mla_mappings(q_lora=cfg.q_lora_rank is not None)
    table |= moe_mappings(
        shared_experts=cfg.moe_shared_expert_intermediate_size is not None,
        expert_bias=cfg.moe_router_enable_expert_bias,
    )
    return table
