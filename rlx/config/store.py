"""Registers the config schemas in Hydra's ConfigStore, so composing type-checks every key.

`conf/config.yaml` starts its defaults list with the root schema (`rlx_config`), and every
option file starts with its group's base node (`defaults: [base_model, _self_]`), so a
misspelled key or a wrong type fails at compose time with the key's full name. Importing
this module (done by `rlx.config`) is enough; registering twice is harmless.
"""

from __future__ import annotations

import operator
from functools import reduce

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from rlx.algo.config import AlgoConfig
from rlx.cache import cache_dir
from rlx.cluster import ClusterConfig
from rlx.config.schema import RlxConfig
from rlx.data.config import DataConfig
from rlx.models.config import ModelConfig
from rlx.rollout.config import RolloutConfig

ROOT_SCHEMA = "rlx_config"
GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "algo": AlgoConfig,
    "cluster": ClusterConfig,
    "rollout": RolloutConfig,
    "data": DataConfig,
}


def register() -> None:
    """Store the root schema, one `base_<group>` node per group, and rlx's resolvers."""
    cs = ConfigStore.instance()
    cs.store(name=ROOT_SCHEMA, node=RlxConfig)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
    # `${rlx.mul:a,b}` lets train.global_batch_size follow the rollout batch in sweeps over
    # rollout.batch_size or rollout.n_samples_per_prompt; OmegaConf has no arithmetic of its own.
    if not OmegaConf.has_resolver("rlx.mul"):
        OmegaConf.register_new_resolver("rlx.mul", lambda *xs: reduce(operator.mul, xs, 1))
    # `${rlx.cache:SmolLM2-135M-Instruct}`: a path in rlx's cache (RLX_CACHE), where experiments
    # find the example model and generated task files
    if not OmegaConf.has_resolver("rlx.cache"):
        OmegaConf.register_new_resolver("rlx.cache", lambda sub="": str(cache_dir() / sub))


register()
