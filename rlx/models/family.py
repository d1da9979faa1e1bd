"""`ModelFamily`: what rlx needs to know about one architecture, on both the HF and Megatron side.

A family turns a `ModelConfig` into an HF config (and a tiny checkpoint on first use), checks a
real checkpoint's config.json against it, builds the Megatron `GPTModel` (TransformerConfig +
local layer spec with SDPA attention), and moves weights between the two through a
`rlx.models.bridge.WeightBridge`. Subclasses supply the family-specific pieces (see
`rlx.models.qwen3.Qwen3`). megatron is imported lazily, so HF-side users (the rollout engine,
config checks) do not pay for it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlx.errors import ConfigError
from rlx.models.bridge import WeightBridge
from rlx.models.config import ModelConfig

_MISSING = object()


@dataclass(frozen=True)
class HFField:
    """Where a `ModelConfig` key lives in config.json: dotted paths tried in order, and the
    value HF assumes when none is present."""

    paths: tuple[str, ...]
    default: Any = _MISSING

    def read(self, hf: dict[str, Any]) -> Any:
        for path in self.paths:
            node: Any = hf
            for part in path.split("."):
                node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
            if node is not _MISSING:
                return node
        return self.default


class ModelFamily:
    """Base class of model families; constructed as `Family(cfg)` from `cfg._target_`."""

    hf_model_type: str = ""  # config.json's model_type

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    # ---- family-specific pieces (subclasses override) --------------------------------------

    def hf_config(self):
        """The transformers `PretrainedConfig` for this shape (pad/eos from the toy vocab when tiny)."""
        raise NotImplementedError

    def hf_fields(self) -> dict[str, HFField]:
        """`ModelConfig` key -> its place in config.json, for `check_hf_config`."""
        raise NotImplementedError

    def transformer_kwargs(self) -> dict[str, Any]:
        """Family-specific TransformerConfig kwargs (normalisation, activation, biases...)."""
        raise NotImplementedError

    def weight_bridge(self) -> WeightBridge:
        """The HF <-> Megatron mapping table for this shape."""
        raise NotImplementedError

    # ---- HF side -------------------------------------------------------------------------------

    def checkpoint_dir(self) -> Path:
        """The HF checkpoint directory: `model.hf_checkpoint`, else the tiny model (written once)."""
        from rlx.models.tiny import tiny_checkpoint_path, write_tiny_checkpoint

        if self.cfg.hf_checkpoint:
            path = Path(self.cfg.hf_checkpoint).expanduser()
            if not (path / "config.json").is_file():
                raise ConfigError(f"model.hf_checkpoint={self.cfg.hf_checkpoint}: no config.json at {path}")
            return path
        if not self.cfg.tiny:
            raise ConfigError("model.hf_checkpoint is required when model.tiny is false")
        hf_config = self.hf_config()
        path = tiny_checkpoint_path(self.cfg.name, hf_config)
        return write_tiny_checkpoint(hf_config, path, seed=self.cfg.init_seed)

    def check_hf_config(self, hf_dir: str | Path) -> None:
        """Raise ConfigError listing every shape key where config.json disagrees with `model.*`."""
        hf = json.loads((Path(hf_dir) / "config.json").read_text())
        problems = []
        if self.hf_model_type and hf.get("model_type") != self.hf_model_type:
            problems.append(
                f"model._target_={self.cfg._target_} expects model_type={self.hf_model_type} "
                f"but config.json has {hf.get('model_type')}"
            )
        for key, field in self.hf_fields().items():
            ours, theirs = getattr(self.cfg, key), field.read(hf)
            if theirs is _MISSING:
                problems.append(f"model.{key}={ours} but config.json has no {' or '.join(field.paths)}")
            elif not _same(ours, theirs):
                problems.append(f"model.{key}={ours} but config.json has {theirs}")
        if problems:
            raise ConfigError(
                f"{Path(hf_dir) / 'config.json'} does not match the model config:\n  " + "\n  ".join(problems)
            )

    # ---- Megatron side ---------------------------------------------------------------------------

    def transformer_config(self, *, params_dtype: torch.dtype = torch.float32, **overrides):
        """Megatron TransformerConfig: shape, parallel sizes from parallel_state, family kwargs,
        then `model.megatron_overrides`, then `overrides` (last wins)."""
        from megatron.core import parallel_state
        from megatron.core.transformer import TransformerConfig

        initialised = parallel_state.model_parallel_is_initialized()
        cfg = self.cfg
        kwargs: dict[str, Any] = dict(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            ffn_hidden_size=cfg.ffn_hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=cfg.num_query_groups,
            kv_channels=cfg.kv_channels,
            layernorm_epsilon=cfg.norm_epsilon,
            tensor_model_parallel_size=(
                parallel_state.get_tensor_model_parallel_world_size() if initialised else 1
            ),
            pipeline_model_parallel_size=(
                parallel_state.get_pipeline_model_parallel_world_size() if initialised else 1
            ),
            params_dtype=params_dtype,
            pipeline_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            # These fusions need Transformer Engine / apex kernels, which rlx does not require.
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            bias_dropout_fusion=False,
            bias_activation_fusion=False,
        )
        kwargs.update(self.transformer_kwargs())
        kwargs.update(cfg.megatron_overrides)
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)

    def layer_spec(self, config):
        """Megatron's local (no Transformer Engine) layer spec, core attention on torch SDPA."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        from rlx.models.attention import SDPAttention

        spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
        return spec

    def build_model(
        self,
        *,
        params_dtype: torch.dtype = torch.float32,
        pre_process: bool | None = None,
        post_process: bool | None = None,
    ):
        """This rank's `GPTModel` (its TP shard and PP stage); parallel_state must be initialised.

        Logits come out vocab-parallel: [b, s, vocab_size / tp].
        """
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel

        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("build_model needs megatron's parallel state: call init_distributed first")
        config = self.transformer_config(params_dtype=params_dtype)
        tp = config.tensor_model_parallel_size
        for key in ("vocab_size", "num_query_groups"):
            if getattr(self.cfg, key) % tp:
                raise ValueError(
                    f"model.{key}={getattr(self.cfg, key)} is not divisible by tensor parallel size {tp}"
                )
        return GPTModel(
            config=config,
            transformer_layer_spec=self.layer_spec(config),
            vocab_size=self.cfg.vocab_size,
            max_sequence_length=self.cfg.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage() if pre_process is None else pre_process,
            post_process=parallel_state.is_pipeline_last_stage() if post_process is None else post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=self.cfg.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=self.cfg.rotary_base,
        )

    def load_hf_weights(self, model: torch.nn.Module, hf_dir: str | Path) -> None:
        """Load this rank's shard of every parameter from an HF checkpoint, streaming tensors.

        Checks config.json first. Call before building the optimizer (it keeps its own copies).
        """
        from megatron.core import parallel_state

        self.check_hf_config(hf_dir)
        self.weight_bridge().load(
            model,
            hf_dir,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        )

    def export_hf_weights(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one at a time, in a stable order (a TP collective: every TP rank
        must iterate it fully; all get full tensors). A tied lm_head is not exported. Under PP
        each stage yields its own layers' tensors only."""
        from megatron.core import parallel_state

        return self.weight_bridge().export(
            model,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        )


def _same(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        try:
            return math.isclose(float(ours), float(theirs), rel_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return ours == theirs
