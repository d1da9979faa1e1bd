"""Composing, checking and building rlx configs.

    from rlx.config.compose import compose, to_object
    cfg = compose(["algo=grpo", "rollout.n_samples_per_prompt=4"])   # composed and validated
    algo = build(cfg.algo)                                          # GRPO(AlgoConfig(...))
    data = build(cfg.data, tokenizer, seed=cfg.run.seed, max_prompt_len=64)

This package's `__init__` imports only `build` (light: no Hydra, no validation), because
trainer ranks and engines build their components from config dataclasses too. Composing
(Hydra) lives in `rlx.config.compose`, the cross-group rules in `rlx.config.validate`.
"""

from rlx.config.build import build

__all__ = ["build"]
