"""Evaluation sets and their metrics.

    sets = build_eval_sets(rc.data, tokenizer, max_prompt_len)    # {name: [Sample, ...]} from data.eval
    ...generate rollout.n_samples_per_eval_prompt responses per prompt and score them...
    metrics = summarise(name, scored_samples, ks=(4, 8))         # eval/{name}/reward_mean, pass@1, pass@k

`rlx.eval.metrics` says when a sample counts as correct and how pass@k is estimated.
"""

from __future__ import annotations

from typing import Any

from rlx.data.config import DataConfig, eval_set_config
from rlx.data.source import FileSource
from rlx.eval.metrics import pass_at_k, summarise
from rlx.sample import Sample

__all__ = ["build_eval_sets", "pass_at_k", "summarise"]


def build_eval_sets(data_cfg: DataConfig, tokenizer: Any, max_prompt_len: int) -> dict[str, list[Sample]]:
    """Every `data.eval` set's prompts, read and checked like training prompts, in file order.
    `data_cfg` is `cfg.data`, a DataConfig or its DictConfig node.

    Each set is a file (`data.eval.NAME.path`) read by `FileSource` with the set's keys (null ones
    inherited from `data.*`), so a bad row fails here naming the file, line and the set's key. Each
    Sample carries `metadata["eval_set"] = NAME` and `metadata["prompt_index"]`, its 0-based
    position among the set's kept prompts (what `summarise` groups a prompt's samples by).
    """
    if not hasattr(type(data_cfg), "__dataclass_fields__"):  # a DictConfig node (cfg.data)
        from omegaconf import OmegaConf

        data_cfg = OmegaConf.to_object(data_cfg)
    sets = {}
    for name in data_cfg.eval:
        source = FileSource(
            eval_set_config(data_cfg, name), tokenizer, seed=0, max_prompt_len=max_prompt_len, eval_set=name
        )
        samples = source.take(len(source))
        for sample in samples:
            sample.metadata["eval_set"] = name
        sets[name] = samples
    return sets
