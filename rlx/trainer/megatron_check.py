"""Megatron's own checks of a model and its layout, run in the driver when the config is composed.

The trainer builds Megatron's `TransformerConfig` from the model keys, the family, the trainer's
settings (`megatron_overrides` below: activation recompute, the pipeline schedule's flags, then
`model.megatron_overrides`) and the layout's parallel sizes. Its `__post_init__` checks them
against each other (heads and groups against TP, layers against PP and virtual stages, MoE and
MLA options...) and raises on the first rule broken, as a traceback from inside a trainer process.
`megatron_errors` builds the same TransformerConfig here, with the sizes the cluster keys give and
no weights or process group, and turns that error into a config error that names rlx's keys
(`model.*`, `cluster.*`) with their values and says which to change.

Megatron's import is most of a check's time (seconds); a process that goes on to train imports it
anyway, one that only composes (a SLURM submission, `run.plan_only`, a config error) need not. So
an accepted config is remembered in rlx's cache (`accepted/`, keyed by every argument of the
TransformerConfig and the versions of megatron-core and torch) and not built again; a refused one
is always built, so its message is Megatron's own.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import replace
from importlib import metadata
from typing import Any

from rlx.cache import cache_dir
from rlx.config.build import build
from rlx.errors import ConfigError
from rlx.trainer.config import PRECISION_DTYPES, RECOMPUTE
from rlx.trainer.pipeline import VIRTUAL_STAGES_KEY, virtual_stages

# TransformerConfig field -> the rlx key that sets it
KEYS = {
    "num_layers": "model.num_layers",
    "hidden_size": "model.hidden_size",
    "ffn_hidden_size": "model.ffn_hidden_size",
    "num_attention_heads": "model.num_attention_heads",
    "num_query_groups": "model.num_query_groups",
    "kv_channels": "model.kv_channels",
    "num_moe_experts": "model.num_moe_experts",
    "moe_router_topk": "model.moe_router_topk",
    "moe_ffn_hidden_size": "model.moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size": "model.moe_shared_expert_intermediate_size",
    "moe_router_num_groups": "model.moe_router_num_groups",
    "moe_router_group_topk": "model.moe_router_group_topk",
    "moe_router_score_function": "model.moe_router_score_function",
    "moe_aux_loss_coeff": "model.moe_aux_loss_coeff",
    "moe_token_dispatcher_type": "model.moe_token_dispatcher_type",
    "q_lora_rank": "model.q_lora_rank",
    "kv_lora_rank": "model.kv_lora_rank",
    "qk_head_dim": "model.qk_head_dim",
    "qk_pos_emb_head_dim": "model.qk_pos_emb_head_dim",
    "v_head_dim": "model.v_head_dim",
    "tensor_model_parallel_size": "cluster.tensor_parallel_size",
    "pipeline_model_parallel_size": "cluster.pipeline_parallel_size",
    "context_parallel_size": "cluster.context_parallel_size",
    "expert_model_parallel_size": "cluster.expert_parallel_size",
    VIRTUAL_STAGES_KEY: f"model.megatron_overrides.{VIRTUAL_STAGES_KEY}",
    "recompute_granularity": "train.recompute",
}


def megatron_overrides(model_cfg, train_cfg, cluster_cfg) -> dict[str, Any]:
    """The TransformerConfig settings the trainer adds to the model's: activation recompute
    (`train.recompute`), and under PP the schedule's flags (micro-batches of their own shapes
    exchange shapes first; the interleaved schedule, with virtual stages, keeps megatron's
    unbatched p2p ops), then `model.megatron_overrides` (the user's, last)."""
    pipeline: dict[str, Any] = {}
    if cluster_cfg.pipeline_parallel_size > 1:
        interleaved = virtual_stages(model_cfg.megatron_overrides) is not None
        pipeline |= {"variable_seq_lengths": not interleaved, "batch_p2p_comm": not interleaved}
        if not model_cfg.num_moe_experts:  # megatron refuses its default (allgather) even when dense
            pipeline["moe_token_dispatcher_type"] = "alltoall"
    return RECOMPUTE[train_cfg.recompute] | pipeline | dict(model_cfg.megatron_overrides)


def megatron_errors(cfg) -> list[str]:
    """Megatron's refusal of the model and layout of the composed `cfg` (an RlxConfig), as one
    message naming rlx's keys; [] when Megatron accepts them."""
    import torch

    c = cfg.cluster
    # kernels=torch: the fused kernels' flags are rlx's choice, not the user's, and resolving them
    # on a GPU machine would load kernel code (and fill megatron's slots) in the driver
    model = replace(
        cfg.model, kernels="torch", megatron_overrides=megatron_overrides(cfg.model, cfg.train, c)
    )
    try:
        family = build(model)
        family.layout = {
            "tp": c.tensor_parallel_size, "pp": c.pipeline_parallel_size,
            "cp": c.context_parallel_size, "ep": c.expert_parallel_size,
        }  # fmt: skip
        params_dtype = getattr(torch, PRECISION_DTYPES[cfg.train.precision])
        accepted = _accepted_marker(family, params_dtype)
        if accepted is not None and accepted.exists():
            return []
        family.transformer_config(params_dtype=params_dtype)
    except ConfigError as e:  # the family's own checks speak rlx already
        return [str(e)]
    except Exception as e:  # Megatron's __post_init__: ValueError, AssertionError, TypeError...
        return [explain(e, cfg)]
    if accepted is not None:
        try:
            accepted.parent.mkdir(parents=True, exist_ok=True)
            accepted.touch()
        except OSError:  # a read-only cache: checked again next time
            pass
    return []


def _accepted_marker(family, params_dtype):
    """The cache file that says Megatron accepted `family`'s config; None where the config's
    arguments cannot be told apart by their text (an object without a value of its own) or the
    family builds its config its own way."""
    if type(family).transformer_config.__module__ not in ("rlx.models.family", "rlx.models.moe_family"):
        return None
    text = json.dumps(
        family.transformer_config_inputs(params_dtype=params_dtype), default=_text, sort_keys=True
    )
    if " at 0x" in text:  # an object's address: another process's would differ
        return None
    versions = [sys.version, _version("megatron-core"), _version("torch"), _version("transformer-engine")]
    digest = hashlib.sha256(json.dumps([text, versions]).encode()).hexdigest()[:32]
    return cache_dir() / "accepted" / "megatron_config" / digest


def _text(value: Any) -> str:
    """A JSON-less argument as text: a function or class by its qualified name, else its repr."""
    if hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return repr(value)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def explain(error: Exception, cfg) -> str:
    """Megatron's message with its field names given as rlx's keys, and those keys' values."""
    text = str(error).strip() or type(error).__name__
    own = cfg.model.megatron_overrides  # a field the user set there is named there
    keys = KEYS | {field: f"model.megatron_overrides.{field}" for field in own}
    named = [field for field in keys if re.search(rf"\b{field}\b", text)]
    for field in sorted(named, key=len, reverse=True):
        text = re.sub(rf"(?<![.\w]){field}\b", keys[field], text)
    values = [f"{keys[f]}={_value(cfg, keys[f])}" for f in named]
    listed = f" ({', '.join(values)})" if values else ""
    return (
        f"Megatron refuses this model and layout{listed}: {text}; change "
        f"{'one of these keys' if values else 'the model.* or cluster.* keys it names'} so that its rule holds "
        "(Megatron's own settings go in +model.megatron_overrides.NAME=...)"
    )


def _value(cfg, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return node
