"""The Llama 3 family: RMSNorm, SwiGLU, RoPE with Llama 3.1's "llama3" scaling, GQA, no biases."""

from __future__ import annotations

from rlx.models.family import ModelFamily
from rlx.models.llama3 import bridge, spec


class Llama3(ModelFamily):
    """Llama 3 / 3.1 / 3.2 / 3.3 models as transformers' `LlamaForCausalLM`, and the tiny test shape."""

    hf_model_type = "llama"
    hf_architecture = "LlamaForCausalLM"
    # LlamaForCausalLM has no qk-norm, no post-sublayer norms and rotates whole heads; its
    # attention_bias would bias o_proj too, which Megatron's add_qkv_bias does not.
    pinned = {
        "qk_layernorm": False,
        "add_qkv_bias": False,
        "post_sublayer_norms": False,
        "rotary_percent": 1.0,
    }
    hf_constants = {"hidden_act": "silu", "mlp_bias": False}
    bridge_module = bridge
    spec_module = spec


__all__ = ["Llama3"]
