"""The `model` config group's schema: architecture in Megatron's names, plus where weights live."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    """One model: the family that builds it, its shape, and its HF checkpoint directory.

    Shape keys use Megatron's names. For a real checkpoint they must agree with its
    config.json (checked before any model is built); for a tiny model they are what is written.
    """

    _target_: str = "rlx.models.qwen3.Qwen3"  # the model family class (spec + bridge + HF config)
    name: str = "tiny_qwen3"  # used for the tiny-model cache directory and in logs
    hf_checkpoint: str | None = None  # HF directory; None = the tiny model cached on first use
    tiny: bool = True  # write a random checkpoint for this shape on first use
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2  # key/value heads (GQA)
    kv_channels: int = 16  # head dim
    vocab_size: int = 16
    max_position_embeddings: int = 64
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-6
    tie_word_embeddings: bool = True
    qk_layernorm: bool = True
    init_seed: int = 0  # seed of a tiny model's random weights
    megatron_overrides: dict[str, Any] = field(default_factory=dict)  # extra TransformerConfig kwargs
