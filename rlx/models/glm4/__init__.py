"""The GLM-4 family (GLM-4-0414): Llama-style with q/k/v biases, post-sublayer norms, half-head
interleaved RoPE and a fused gate_up projection."""

from __future__ import annotations

from rlx.models.family import ModelFamily
from rlx.models.glm4 import bridge, spec


class Glm4(ModelFamily):
    """GLM-4-0414 models (GLM-4-9B-0414, GLM-4-32B-0414) as `Glm4ForCausalLM`, and the tiny shape."""

    hf_model_type = "glm4"
    hf_architecture = "Glm4ForCausalLM"
    # Glm4DecoderLayer always has the post-attention / post-MLP norms and no qk-norm.
    pinned = {"qk_layernorm": False, "post_sublayer_norms": True}
    hf_constants = {"hidden_act": "silu"}
    bridge_module = bridge
    spec_module = spec


__all__ = ["Glm4"]
