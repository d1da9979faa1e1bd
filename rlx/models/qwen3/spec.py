"""Qwen3's Megatron side: a Llama-style dense decoder with RMSNorm on each head's queries and keys.

The layer spec itself is the family default (megatron's local spec, SDPA core attention); what
makes it Qwen3 is the TransformerConfig below.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

from rlx.models.config import ModelConfig


def transformer_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """TransformerConfig kwargs for Qwen3: RMSNorm, SwiGLU, no biases, qk-norm."""
    return dict(
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=cfg.qk_layernorm,
    )
