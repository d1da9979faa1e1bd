"""The Qwen3 dense family: qk-norm RMSNorm, SwiGLU, RoPE, GQA, RMSNorm, no biases."""

from __future__ import annotations

from typing import Any

from rlx.models.bridge import WeightBridge
from rlx.models.family import HFField, ModelFamily
from rlx.models.qwen3 import bridge, spec


class Qwen3(ModelFamily):
    """Qwen3 dense models (Qwen3-0.6B ... 32B, and the tiny test shape)."""

    hf_model_type = "qwen3"
    # Qwen3's decoder layer always has q/k norms; its attention_bias would bias o_proj too.
    pinned = {
        "qk_layernorm": True,
        "add_qkv_bias": False,
        "post_sublayer_norms": False,
        "rotary_percent": 1.0,
    }
    hf_constants = {"hidden_act": "silu"}

    def hf_config(self):
        return bridge.hf_config(self.cfg)

    def hf_fields(self) -> dict[str, HFField]:
        return bridge.hf_fields(self.cfg)

    def transformer_kwargs(self) -> dict[str, Any]:
        return spec.transformer_kwargs(self.cfg)

    def weight_bridge(self) -> WeightBridge:
        return WeightBridge(bridge.weight_mappings(self.cfg))


__all__ = ["Qwen3"]
