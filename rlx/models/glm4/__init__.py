"""The GLM-4 family (GLM-4-0414): Llama-style with q/k/v biases, post-sublayer norms, half-head
interleaved RoPE and a fused gate_up projection."""

from __future__ import annotations

from typing import Any

from rlx.models.bridge import WeightBridge
from rlx.models.family import HFField, ModelFamily
from rlx.models.glm4 import bridge, spec


class Glm4(ModelFamily):
    """GLM-4-0414 models (GLM-4-9B-0414, GLM-4-32B-0414) as `Glm4ForCausalLM`, and the tiny shape."""

    hf_model_type = "glm4"
    # Glm4DecoderLayer always has the post-attention / post-MLP norms and no qk-norm.
    pinned = {"qk_layernorm": False, "post_sublayer_norms": True}
    hf_constants = {"hidden_act": "silu"}

    def hf_config(self):
        return bridge.hf_config(self.cfg)

    def hf_fields(self) -> dict[str, HFField]:
        return bridge.hf_fields(self.cfg)

    def transformer_kwargs(self) -> dict[str, Any]:
        return spec.transformer_kwargs(self.cfg)

    def weight_bridge(self) -> WeightBridge:
        return WeightBridge(bridge.weight_mappings(self.cfg))


__all__ = ["Glm4"]
