"""The Qwen3-MoE family: Qwen3's attention (qk-norm, GQA, RoPE) with a softmax-routed MoE in every layer."""

from __future__ import annotations

from typing import Any

from rlx.models.moe_family import MoEFamily
from rlx.models.qwen3 import spec as qwen3_spec
from rlx.models.qwen3_moe import bridge


class Qwen3Moe(MoEFamily):
    """Qwen3-MoE models (Qwen3-30B-A3B, Qwen3-235B-A22B, and the tiny test shape)."""

    hf_model_type = "qwen3_moe"
    hf_architecture = "Qwen3MoeForCausalLM"
    pinned = {
        "qk_layernorm": True,
        "add_qkv_bias": False,
        "post_sublayer_norms": False,
        "rotary_percent": 1.0,
        "moe_router_score_function": "softmax",
        "moe_shared_expert_intermediate_size": None,
        "moe_router_topk_scaling_factor": None,
        "moe_router_num_groups": None,
        "moe_router_enable_expert_bias": False,
        "moe_first_dense_layers": 0,
        "kv_lora_rank": None,
    }
    # Layer patterns with dense MLPs (sparse step > 1, mlp_only_layers) are not implemented.
    hf_constants = {"hidden_act": "silu", "decoder_sparse_step": 1, "mlp_only_layers": []}

    bridge_module = bridge

    def hf_config_args(self) -> tuple[str, dict[str, Any]]:
        self.check_routing()
        return super().hf_config_args()

    def transformer_kwargs(self) -> dict[str, Any]:
        return qwen3_spec.transformer_kwargs(self.cfg) | self.moe_kwargs()

    def weight_mappings(self):
        return bridge.weight_mappings(self.cfg)

    def num_parameters(self) -> int:
        """Parameters of the HF model, from the shape alone.

        Per layer: q/k/v/o projections (GQA), per-head q/k norms, two RMSNorms, the router
        (experts x hidden) and the routed experts (3 x hidden x moe_ffn each, SwiGLU). Plus the
        embedding, an untied lm_head and the final norm.
        """
        c = self.cfg
        h, d = c.hidden_size, c.kv_channels
        attention = h * d * (2 * c.num_attention_heads + 2 * c.num_query_groups) + 2 * d
        moe = c.num_moe_experts * (h + 3 * h * c.moe_ffn_hidden_size)
        embeddings = c.vocab_size * h * (1 if c.tie_word_embeddings else 2)
        return embeddings + c.num_layers * (attention + moe + 2 * h) + h


__all__ = ["Qwen3Moe"]
