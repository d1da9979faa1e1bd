"""The Qwen3 dense family: qk-norm RMSNorm, SwiGLU, RoPE, GQA, RMSNorm, no biases."""

from __future__ import annotations

from rlx.models.family import ModelFamily
from rlx.models.qwen3 import bridge, spec


class Qwen3(ModelFamily):
    """Qwen3 dense models (Qwen3-0.6B ... 32B, and the tiny test shape)."""

    hf_model_type = "qwen3"
    hf_architecture = "Qwen3ForCausalLM"
    # Qwen3's decoder layer always has q/k norms; its attention_bias would bias o_proj too.
    pinned = {
        "qk_layernorm": True,
        "add_qkv_bias": False,
        "post_sublayer_norms": False,
        "rotary_percent": 1.0,
    }
    hf_constants = {"hidden_act": "silu"}
    bridge_module = bridge
    spec_module = spec


__all__ = ["Qwen3"]
