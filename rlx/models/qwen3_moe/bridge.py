"""Qwen3-MoE's HF side: its transformers config, where our keys live in config.json, its weight table.

Qwen3-MoE is Qwen3's decoder with every MLP replaced by a softmax-routed MoE block (no shared
expert), so the dense pieces come from `rlx.models.qwen3.bridge`.
"""

from __future__ import annotations

from typing import Any

from rlx.models.bridge import TensorMapping
from rlx.models.config import ModelConfig
from rlx.models.hf_config import HFField, dense_hf_kwargs
from rlx.models.moe_bridge import moe_mappings
from rlx.models.qwen3 import bridge as qwen3_bridge


def hf_fields(cfg: ModelConfig) -> dict[str, HFField]:
    """config.json keys per ModelConfig key; defaults are Qwen3MoeConfig's when a key is absent."""
    return qwen3_bridge.hf_fields(cfg) | {
        # Qwen3MoeConfig has no head_dim default: its attention falls back to hidden / heads.
        "kv_channels": HFField(
            ("head_dim",), derive=lambda hf: hf["hidden_size"] // hf["num_attention_heads"]
        ),
        # Released checkpoints write num_experts; transformers 5 saves it as num_local_experts.
        "num_moe_experts": HFField(("num_experts", "num_local_experts"), default=128),
        "moe_router_topk": HFField(("num_experts_per_tok",), default=8),
        "moe_ffn_hidden_size": HFField(("moe_intermediate_size",), default=768),
        "moe_router_norm_topk_prob": HFField(("norm_topk_prob",), default=False),
    }


HF_CONFIG = "Qwen3MoeConfig"  # the transformers config class of hf_config_kwargs


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """`transformers.Qwen3MoeConfig`'s kwargs for `cfg`'s shape; tiny models get the tiny vocabulary's pad/eos ids."""
    return dense_hf_kwargs(
        cfg,
        attention_bias=False,
        num_experts=cfg.num_moe_experts,
        num_experts_per_tok=cfg.moe_router_topk,
        moe_intermediate_size=cfg.moe_ffn_hidden_size,
        norm_topk_prob=cfg.moe_router_norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def weight_mappings(cfg: ModelConfig) -> dict[str, TensorMapping]:
    """Qwen3's table (qk-norm included) with the dense MLP replaced by the MoE block."""
    table = qwen3_bridge.weight_mappings(cfg)
    for dense in ("linear_fc1", "linear_fc2"):
        del table[f"decoder.layers.{{i}}.mlp.{dense}.weight"]
    return table | moe_mappings(shared_experts=False, expert_bias=False)
