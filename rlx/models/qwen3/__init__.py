"""The Qwen3 dense family: qk-norm RMSNorm, SwiGLU, RoPE, GQA, RMSNorm, no biases."""

from __future__ import annotations

from typing import Any

from rlx.models.bridge import WeightBridge
from rlx.models.family import HFField, ModelFamily
from rlx.models.qwen3 import bridge, spec


class Qwen3(ModelFamily):
    """Qwen3 dense models (Qwen3-0.6B ... 32B, and the tiny test shape)."""

    hf_model_type = "qwen3"

    def hf_config(self):
        return bridge.hf_config(self.cfg)

    def hf_fields(self) -> dict[str, HFField]:
        return bridge.HF_FIELDS

    def transformer_kwargs(self) -> dict[str, Any]:
        return spec.transformer_kwargs(self.cfg)

    def weight_bridge(self) -> WeightBridge:
        return WeightBridge(bridge.weight_mappings(self.cfg))


__all__ = ["Qwen3"]
