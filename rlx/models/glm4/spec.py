"""GLM-4's Megatron side (GLM-4-0414, transformers' `Glm4ForCausalLM`).

What differs from a Llama-style decoder, and where Megatron gets it:

- q/k/v biases (no o_proj bias): `add_qkv_bias` (from `model.add_qkv_bias`, set in the base);
- RMSNorm on the attention output and on the MLP output before each residual add:
  `rlx.models.layers.PostNormTransformerLayer`, chosen by `ModelFamily.layer_spec` from
  `model.post_sublayer_norms` (megatron-core 0.16 has no such option);
- RoPE on half of each head (`model.rotary_percent`, passed to GPTModel by the base) over
  interleaved pairs (transformers' GLM-4 `rotate_half` takes even/odd dims): `rotary_interleaved`.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from rlx.models.config import ModelConfig


def transformer_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """TransformerConfig kwargs for GLM-4: RMSNorm, SwiGLU, biases on q/k/v only, interleaved RoPE."""
    return dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=False,
        rotary_interleaved=True,
    )
