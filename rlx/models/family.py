"""`ModelFamily`: what rlx needs to know about one architecture, on both the HF and Megatron side.

A family turns a `ModelConfig` into an HF config (and a tiny checkpoint on first use), checks a
real checkpoint's config.json against it, builds the Megatron `GPTModel` (TransformerConfig +
local layer spec with SDPA attention), and moves weights between the two through a
`rlx.models.bridge.WeightBridge`. Subclasses supply the family-specific pieces (see
`rlx.models.qwen3.Qwen3`, `rlx.models.llama3.Llama3`, `rlx.models.glm4.Glm4`) and declare which
`ModelConfig` keys their HF architecture fixes (`pinned`, checked on construction, so a wrong
combination fails before any process starts). megatron is imported lazily, so HF-side users
(the rollout engine, config checks) do not pay for it.
"""

from __future__ import annotations

import importlib
import json
import math
import pkgutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from rlx.errors import ConfigError
from rlx.models.bridge import WeightBridge
from rlx.models.config import ModelConfig
from rlx.models.hf_config import MISSING, HFField, read_config, rope_type

__all__ = ["HFField", "ModelFamily"]


class ModelFamily:
    """Base class of model families; constructed as `Family(cfg)` from `cfg._target_`."""

    hf_model_type: str = ""  # config.json's model_type
    hf_architecture: str = ""  # config.json's architectures[0]: the transformers class
    # config.json RoPE types the family implements ("default": unscaled; llama3: model.rope_scaling_*)
    rope_types: tuple[str, ...] = ("default", "llama3")
    # `ModelConfig` keys whose value the family's HF architecture fixes (e.g. Llama has no
    # qk-norm): another value could not be loaded from or exported to its checkpoints.
    pinned: dict[str, Any] = {}
    # config.json keys with the only value the family implements (checked where present).
    hf_constants: dict[str, Any] = {}
    # The family's modules: `bridge` (hf_config, hf_fields, weight_mappings of a ModelConfig)
    # and `spec` (transformer_kwargs); the defaults below read them, subclasses override.
    bridge_module: ModuleType | None = None
    spec_module: ModuleType | None = None

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        wrong = [
            f"model.{key}={_yaml(getattr(cfg, key))}: {type(self).__name__} models need model.{key}={_yaml(value)}"
            for key, value in self.pinned.items()
            if not same_value(getattr(cfg, key), value)
        ]
        if wrong:
            raise ConfigError(f"model._target_={cfg._target_}:\n  " + "\n  ".join(wrong))

    # ---- family-specific pieces (subclasses override) --------------------------------------

    def hf_config_args(self) -> tuple[str, dict[str, Any]]:
        """(the transformers config class's name, its kwargs) for this shape: `hf_config` without
        importing transformers' config class, which loads its auto-model factory (seconds)."""
        return self.bridge_module.HF_CONFIG, self.bridge_module.hf_config_kwargs(self.cfg)

    def hf_config(self):
        """The transformers `PretrainedConfig` for this shape (pad/eos from the tiny vocabulary when tiny)."""
        import transformers

        name, kwargs = self.hf_config_args()
        return getattr(transformers, name)(**kwargs)

    def hf_config_key(self) -> str:
        """What `hf_config` is made of, and transformers' version (its defaults): a cache key for
        what follows from the config alone (the tiny checkpoint's path, the tensor shapes)."""
        import transformers

        name, kwargs = self.hf_config_args()
        return json.dumps([name, kwargs, transformers.__version__], sort_keys=True, default=str)

    def hf_fields(self) -> dict[str, HFField]:
        """`ModelConfig` key -> its place in config.json, for `check_hf_config`."""
        return self.bridge_module.hf_fields(self.cfg)

    def transformer_kwargs(self) -> dict[str, Any]:
        """Family-specific TransformerConfig kwargs (normalisation, activation, biases...)."""
        return self.spec_module.transformer_kwargs(self.cfg)

    def weight_bridge(self) -> WeightBridge:
        """The HF <-> Megatron mapping table for this shape."""
        return WeightBridge(self.bridge_module.weight_mappings(self.cfg))

    # ---- HF side -------------------------------------------------------------------------------

    def checkpoint_dir(self, **write_args: Any) -> Path:
        """The HF checkpoint directory: `model.hf_checkpoint`, else the tiny model (written once;
        `write_args`: `write_tiny_checkpoint`'s dtype and device for it)."""
        from rlx.models.tiny import tiny_checkpoint_path, write_tiny_checkpoint

        if self.cfg.hf_checkpoint:
            path = Path(self.cfg.hf_checkpoint).expanduser()
            if not (path / "config.json").is_file():
                raise ConfigError(f"model.hf_checkpoint={self.cfg.hf_checkpoint}: no config.json at {path}")
            return path
        if not self.cfg.tiny:
            raise ConfigError("model.hf_checkpoint is required when model.tiny is false")
        path = tiny_checkpoint_path(self.cfg.name, self.hf_config_key())
        if (path / "config.json").is_file():
            return path
        return write_tiny_checkpoint(self.hf_config(), path, seed=self.cfg.init_seed, **write_args)

    def check_hf_config(self, hf_dir: str | Path) -> None:
        """Raise ConfigError listing every key where config.json disagrees with `model.*`: the
        `hf_fields`, the family's `hf_constants`, and whether RoPE has llama3 scaling."""
        hf = read_config(Path(hf_dir))  # ConfigError naming the line if it is not JSON
        problems = []
        if self.hf_model_type and hf.get("model_type") != self.hf_model_type:
            theirs = family_for(hf.get("model_type"))
            fix = (
                f"drop the model option: model.hf_checkpoint alone reads the family ({theirs}) and the shape "
                "from config.json"
                if theirs
                else f"rlx has no family for it; point model.hf_checkpoint at a {self.hf_model_type} checkpoint"
            )
            problems.append(
                f"model._target_={self.cfg._target_} expects model_type={self.hf_model_type} "
                f"but config.json has {hf.get('model_type')}: {fix}"
            )
        for key, field in self.hf_fields().items():
            ours, theirs = getattr(self.cfg, key), field.read(hf)
            if theirs is MISSING:
                problems.append(f"model.{key}={ours} but config.json has no {' or '.join(field.paths)}")
            elif not same_value(ours, theirs):
                problems.append(f"model.{key}={ours} but config.json has {theirs}")
        for key, value in self.hf_constants.items():
            if key in hf and not same_value(hf[key], value):
                problems.append(
                    f"config.json has {key}={hf[key]} but {type(self).__name__} implements only {value}"
                )
        # llama3 scaling is the one RoPE variant the `rope_scaling_*` keys describe; others (YaRN
        # in DeepSeek-V3) are their families' business.
        theirs_llama3, ours_llama3 = rope_type(hf) == "llama3", self.cfg.rope_scaling_factor is not None
        if theirs_llama3 != ours_llama3:
            problems.append(
                f"model.rope_scaling_factor={self.cfg.rope_scaling_factor} but config.json has rope_type={rope_type(hf)}"
            )
        if problems:
            raise ConfigError(
                f"{Path(hf_dir) / 'config.json'} does not match the model config:\n  " + "\n  ".join(problems)
            )

    # ---- Megatron side ---------------------------------------------------------------------------

    # tp, pp, cp, ep of the layout, for a TransformerConfig built without megatron's parallel state
    # (the driver's check at compose time, `rlx.trainer.megatron_check`); None: 1 each
    layout: dict[str, int] | None = None

    def parallel_sizes(self) -> dict[str, int]:
        """tp, pp, cp, ep: megatron's parallel state once initialised (a trainer rank), else
        `layout`, else 1 each."""
        # megatron not imported yet: its state cannot be initialised either (and the driver's
        # check need not import it, seconds, to learn so)
        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None and ps.model_parallel_is_initialized():
            return {
                "tp": ps.get_tensor_model_parallel_world_size(),
                "pp": ps.get_pipeline_model_parallel_world_size(),
                "cp": ps.get_context_parallel_world_size(),
                "ep": ps.get_expert_model_parallel_world_size(),
            }
        return {"tp": 1, "pp": 1, "cp": 1, "ep": 1} | (self.layout or {})

    def transformer_config(self, *, params_dtype: torch.dtype = torch.float32, **overrides):
        """Megatron TransformerConfig of `transformer_config_kwargs`."""
        from megatron.core.transformer import TransformerConfig

        return TransformerConfig(**self.transformer_config_kwargs(params_dtype=params_dtype, **overrides))

    def transformer_config_kwargs(
        self, *, params_dtype: torch.dtype = torch.float32, **overrides
    ) -> dict[str, Any]:
        """TransformerConfig's kwargs: shape, parallel sizes (`parallel_sizes`), family kwargs,
        then `model.megatron_overrides`, then `overrides` (last wins)."""
        sizes = self.parallel_sizes()
        cfg = self.cfg
        kwargs: dict[str, Any] = dict(
            num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size,
            ffn_hidden_size=cfg.ffn_hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=cfg.num_query_groups,
            kv_channels=cfg.kv_channels,
            layernorm_epsilon=cfg.norm_epsilon,
            tensor_model_parallel_size=sizes["tp"],
            pipeline_model_parallel_size=sizes["pp"],
            context_parallel_size=sizes["cp"],
            params_dtype=params_dtype,
            pipeline_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16,
            fp16=params_dtype == torch.float16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            # These fusions need Transformer Engine / apex kernels, which rlx does not require;
            # the ones that need neither come from `fusion_kwargs` (on CUDA).
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            bias_dropout_fusion=False,
            bias_activation_fusion=False,
        )
        kwargs["add_qkv_bias"] = cfg.add_qkv_bias
        kwargs.update(self.transformer_kwargs())
        kwargs.update(
            self.fusion_kwargs(params_dtype, rotary_interleaved=kwargs.get("rotary_interleaved", False))
        )
        kwargs.update(cfg.megatron_overrides)
        kwargs.update(overrides)
        return kwargs

    def transformer_config_inputs(self, *, params_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """All that `transformer_config` builds megatron's config from, without importing megatron:
        megatron's verdict on them is its verdict on the config (`rlx.trainer.megatron_check`
        remembers the accepted ones)."""
        return {"TransformerConfig": self.transformer_config_kwargs(params_dtype=params_dtype)}

    def kernels(self):
        """The `rlx.models.kernels.KernelSet` `model.kernels` selects on this machine ("torch",
        megatron's unfused layers, without CUDA)."""
        from rlx.models.kernels import resolve

        return resolve(self.cfg.kernels)

    def fusion_kwargs(self, params_dtype: torch.dtype, *, rotary_interleaved: bool) -> dict[str, Any]:
        """TransformerConfig flags of `kernels()` (fused SwiGLU, cross entropy, RoPE); none on CPU."""
        from rlx.models.kernels import fusion_kwargs

        return fusion_kwargs(self.kernels(), params_dtype=params_dtype, rotary_interleaved=rotary_interleaved)

    def layer_spec(self, config, vp_stage: int | None = None):
        """Megatron's local (no Transformer Engine) layer spec, core attention on torch SDPA,
        `kernels()`' fused norms and SwiGLU on CUDA, post-sublayer norms when
        `model.post_sublayer_norms`, as a block spec where the final norm is fused too
        (see `rlx.models.layers`); `vp_stage`: the virtual pipeline chunk being built."""
        from rlx.models.layers import block_spec, local_layer_spec

        kernels = self.kernels()
        spec = local_layer_spec(config, post_sublayer_norms=self.cfg.post_sublayer_norms, kernels=kernels)
        return block_spec(config, spec, kernels, vp_stage=vp_stage)

    def build_model(
        self,
        *,
        params_dtype: torch.dtype = torch.float32,
        pre_process: bool | None = None,
        post_process: bool | None = None,
        vp_stage: int | None = None,
        **config_overrides,
    ):
        """This rank's `GPTModel` (its TP shard and PP stage; with virtual pipeline stages, its
        chunk `vp_stage`); parallel_state must be initialised.

        `config_overrides` are TransformerConfig kwargs applied last (the trainer's activation
        recompute: `recompute_granularity="full", recompute_method="uniform",
        recompute_num_layers=1`). Logits come out vocab-parallel: [b, s, vocab_size / tp].
        """
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel

        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("build_model needs megatron's parallel state: call init_distributed first")
        config = self.transformer_config(params_dtype=params_dtype, **config_overrides)
        tp = config.tensor_model_parallel_size
        for key in ("vocab_size", "num_query_groups"):
            if getattr(self.cfg, key) % tp:
                raise ValueError(
                    f"model.{key}={getattr(self.cfg, key)} is not divisible by tensor parallel size {tp}"
                )
        model = GPTModel(
            config=config,
            transformer_layer_spec=self.layer_spec(config, vp_stage=vp_stage),
            vocab_size=self.cfg.vocab_size,
            max_sequence_length=self.cfg.max_position_embeddings,
            pre_process=(
                parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
                if pre_process is None
                else pre_process
            ),
            post_process=(
                parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
                if post_process is None
                else post_process
            ),
            vp_stage=vp_stage,
            parallel_output=True,
            share_embeddings_and_output_weights=self.cfg.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=self.cfg.rotary_percent,
            rotary_base=self.cfg.rotary_base,
        )
        if self.cfg.rope_scaling_factor is not None:
            from rlx.models.layers import apply_llama3_rope_scaling

            apply_llama3_rope_scaling(model, self.cfg)
        from rlx.models.residual_norm import link_residual_norms

        link_residual_norms(model)
        return model

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

    def export_hf_weights(
        self, model: torch.nn.Module | list[torch.nn.Module]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors of the whole model, one at a time, in the one-rank order: a
        collective over the TP and pipeline groups (every rank must iterate it fully; all get
        every tensor, whatever stage holds it). `model`: this rank's model, or its list of
        virtual-stage chunks. A tied lm_head is not exported."""
        from megatron.core import parallel_state

        from rlx.models.stages import as_chunks, gather_stages

        bridge = self.weight_bridge()
        groups = dict(
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        )
        return gather_stages([bridge.export(chunk, **groups) for chunk in as_chunks(model)])

    def lora_modules(self) -> tuple[str, ...]:
        """Megatron's names of the decoder's tensor-parallel linear layers, the ones LoRA can adapt
        (`train.lora.target_modules`): attention's fused q/k/v and output projections, the MLP's
        fused gate/up and down projections."""
        return ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")

    # ---- size ----------------------------------------------------------------------------------

    def num_parameters(self) -> int:
        """Parameters of the whole model (all TP/PP shards), from the config alone.

        The dense decoder formula; families with other layer types (MoE, MLA) override it.
        Per layer: q/k/v/o projections (GQA: k and v have num_query_groups heads), q/k/v biases,
        per-head q/k norms, a gated MLP (gate, up, down), and 2 norms (4 with post-sublayer norms).
        Plus the embedding, a separate output layer unless tied, and the final norm.
        """
        cfg = self.cfg
        h, d = cfg.hidden_size, cfg.kv_channels
        q, kv = cfg.num_attention_heads * d, cfg.num_query_groups * d
        attention = h * (q + 2 * kv) + q * h
        attention += (q + 2 * kv) if cfg.add_qkv_bias else 0
        attention += 2 * d if cfg.qk_layernorm else 0
        mlp = 3 * h * cfg.ffn_hidden_size
        norms = (4 if cfg.post_sublayer_norms else 2) * h
        embeddings = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
        return embeddings + cfg.num_layers * (attention + mlp + norms) + h


def families() -> list[type]:
    """The model family classes rlx ships (one per package under rlx.models)."""
    import rlx.models

    found = []
    for info in pkgutil.iter_modules(rlx.models.__path__):
        if info.ispkg:
            module = importlib.import_module(f"rlx.models.{info.name}")
            found += [
                cls for cls in vars(module).values()
                if isinstance(cls, type) and issubclass(cls, ModelFamily) and cls.hf_model_type
            ]  # fmt: skip
    return found


def family_for(model_type: str | None) -> str | None:
    """The `_target_` of the family (a package `rlx.models.<name>`) whose checkpoints have
    config.json's `model_type`, or None."""
    return next((f"{c.__module__}.{c.__name__}" for c in families() if c.hf_model_type == model_type), None)


def _yaml(value: Any) -> str:
    """`value` as a command-line override writes it."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def same_value(ours: Any, theirs: Any) -> bool:
    """Whether a `model.*` value and a config.json value agree (floats to 1e-9: 1e5 == 100000)."""
    if isinstance(ours, float) or isinstance(theirs, float):
        try:
            return math.isclose(float(ours), float(theirs), rel_tol=1e-9)
        except (TypeError, ValueError):
            return False
    return ours == theirs
