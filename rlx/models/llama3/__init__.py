"""The Llama 3 family: RMSNorm, SwiGLU, RoPE with Llama 3.1's "llama3" scaling, GQA, no biases."""

from __future__ import annotations

from typing import Any

from rlx.models.bridge import WeightBridge
from rlx.models.family import HFField, ModelFamily
from rlx.models.llama3 import bridge, spec


class Llama3(ModelFamily):
    """Llama 3 / 3.1 / 3.2 / 3.3 models as transformers' `LlamaForCausalLM`, and the tiny test shape."""

    hf_model_type = "llama"
    # LlamaForCausalLM has no qk-norm, no post-sublayer norms and rotates whole heads; its
    # attention_bias would bias o_proj too, which Megatron's add_qkv_bias does not.
    pinned = {
        "qk_layernorm": False,
        "add_qkv_bias": False,
        "post_sublayer_norms": False,
        "rotary_percent": 1.0,
    }
    hf_constants = {"hidden_act": "silu", "mlp_bias": False}

    def hf_config(self):
        return bridge.hf_config(self.cfg)

    def hf_fields(self) -> dict[str, HFField]:
        return bridge.hf_fields(self.cfg)

    def transformer_kwargs(self) -> dict[str, Any]:
        return spec.transformer_kwargs(self.cfg)

    def weight_bridge(self) -> WeightBridge:
        return WeightBridge(bridge.weight_mappings(self.cfg))


__all__ = ["Llama3"]
