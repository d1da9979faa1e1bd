"""The config.json side shared by model families: reading it, where `ModelConfig` keys live, RoPE,
token ids.

config.json files come in two generations: transformers 5 writes RoPE settings under
`rope_parameters`; older files (most published checkpoints) keep `rope_theta`,
`partial_rotary_factor` and a `rope_scaling` dict at the top level. `HFField` tries each place.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlx.errors import ConfigError
from rlx.models.config import ModelConfig
from rlx.models.tiny import EOS, PAD, VOCAB


def read_config(path: Path) -> dict[str, Any]:
    """config.json of the checkpoint at `path`, as a dict (ConfigError naming the line if it is not JSON)."""
    file = path / "config.json"
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{file}: not valid JSON (line {e.lineno}: {e.msg}); download or copy it again"
        ) from e
    if not isinstance(hf, dict):
        raise ConfigError(f"{file}: not a JSON object; download or copy it again")
    return hf


MISSING = object()  # a config.json key that is absent (and has no default)


@dataclass(frozen=True)
class HFField:
    """Where a `ModelConfig` key lives in config.json: dotted paths tried in order, and what HF
    assumes when none is present: the constant `default`, or `derive(config_json)`."""

    paths: tuple[str, ...]
    default: Any = MISSING
    derive: Callable[[dict[str, Any]], Any] | None = None

    def read(self, hf: dict[str, Any]) -> Any:
        for path in self.paths:
            node: Any = hf
            for part in path.split("."):
                node = node.get(part, MISSING) if isinstance(node, dict) else MISSING
            if node is not MISSING:
                return node
        if self.derive is not None:
            try:
                return self.derive(hf)
            except (KeyError, TypeError):  # a key it needs is absent too
                pass
        return self.default


def _rope(key: str) -> tuple[str, ...]:
    return (f"rope_parameters.{key}", f"rope_scaling.{key}")


def rope_fields(cfg: ModelConfig, *, partial_rotary_default: float = 1.0) -> dict[str, HFField]:
    """RoPE keys: base, rotated fraction, and the llama3 scaling parameters when scaling is on."""
    fields = {
        "rotary_base": HFField(("rope_parameters.rope_theta", "rope_theta"), default=10000.0),
        "rotary_percent": HFField(
            ("rope_parameters.partial_rotary_factor", "partial_rotary_factor"), default=partial_rotary_default
        ),
        # Absent means unscaled RoPE; a checkpoint with scaling is refused by a config without it.
        "rope_scaling_factor": HFField(_rope("factor"), default=None),
    }
    if cfg.rope_scaling_factor is not None:
        fields |= {
            "rope_scaling_low_freq_factor": HFField(_rope("low_freq_factor")),
            "rope_scaling_high_freq_factor": HFField(_rope("high_freq_factor")),
            "rope_scaling_original_max_position_embeddings": HFField(
                _rope("original_max_position_embeddings")
            ),
        }
    return fields


def dense_hf_fields(
    cfg: ModelConfig,
    *,
    head_dim: HFField,
    norm_epsilon_default: float,
    partial_rotary_default: float = 1.0,
) -> dict[str, HFField]:
    """The keys every Llama-layout config.json has (Llama, Qwen3, GLM-4), with the family's defaults.

    `add_qkv_bias` is checked against `attention_bias`: in GLM-4 that biases q/k/v only; in Llama
    and Qwen3 it also biases o_proj, which those families refuse (they pin add_qkv_bias=false).
    """
    return {
        "num_layers": HFField(("num_hidden_layers",)),
        "hidden_size": HFField(("hidden_size",)),
        "ffn_hidden_size": HFField(("intermediate_size",)),
        "num_attention_heads": HFField(("num_attention_heads",)),
        # Old configs without num_key_value_heads mean plain multi-head attention.
        "num_query_groups": HFField(("num_key_value_heads",), derive=lambda hf: hf["num_attention_heads"]),
        "kv_channels": head_dim,
        "vocab_size": HFField(("vocab_size",)),
        "max_position_embeddings": HFField(("max_position_embeddings",)),
        "norm_epsilon": HFField(("rms_norm_eps",), default=norm_epsilon_default),
        "tie_word_embeddings": HFField(("tie_word_embeddings",), default=False),
        "add_qkv_bias": HFField(("attention_bias",), default=False),
        **rope_fields(cfg, partial_rotary_default=partial_rotary_default),
    }


def rope_type(hf: dict[str, Any]) -> str:
    """config.json's RoPE type ("default" when it names none)."""
    for path in ("rope_parameters.rope_type", "rope_scaling.rope_type", "rope_scaling.type"):
        value = HFField((path,)).read(hf)
        if value is not MISSING and value is not None:
            return value
    return "default"


def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' `rope_parameters` for `cfg`: plain RoPE, or "llama3" scaling when it is set.

    partial_rotary_factor is left out at 1.0 (the value every config class but GLM-4's assumes).
    """
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    if cfg.rope_scaling_factor is not None:
        params |= {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_scaling_low_freq_factor,
            "high_freq_factor": cfg.rope_scaling_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling_original_max_position_embeddings,
        }
    if cfg.rotary_percent != 1.0:
        params["partial_rotary_factor"] = cfg.rotary_percent
    return params


def tiny_token_ids(cfg: ModelConfig) -> dict[str, Any]:
    """pad/eos/bos ids of a tiny model over the tiny vocabulary; {} (the config class's) otherwise.

    Some config classes default to ids far outside a 16-token vocabulary (GLM-4: pad 151329).
    """
    if not cfg.tiny:
        return {}
    return dict(pad_token_id=VOCAB.index(PAD), eos_token_id=VOCAB.index(EOS), bos_token_id=None)


def dense_hf_kwargs(cfg: ModelConfig, **overrides: Any) -> dict[str, Any]:
    """The transformers config kwargs every decoder family shares, from `cfg`'s shape.

    Families add or override their own (biases, MoE sizes, RoPE extras) through `overrides`;
    tiny models get the tiny vocabulary's pad/eos ids.
    """
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.kv_channels,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": rope_parameters(cfg),
        "rms_norm_eps": cfg.norm_epsilon,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        **tiny_token_ids(cfg),
        **overrides,
    }
