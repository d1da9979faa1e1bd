"""Llama 3's Megatron side: RMSNorm, SwiGLU, RoPE, GQA, no biases.

The layer spec is the family default (megatron's local spec, SDPA core attention). Llama 3.1's
"llama3" RoPE frequency scaling is applied by `ModelFamily.build_model` whenever
`model.rope_scaling_factor` is set (see `rlx.models.layers.apply_llama3_rope_scaling`).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from rlx.models.config import ModelConfig


def transformer_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """TransformerConfig kwargs for Llama 3: RMSNorm, SwiGLU, no biases, no qk-norm."""
    return dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=False,
    )
