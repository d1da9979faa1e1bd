"""Evaluation during a run: every `run.eval_interval` steps (and before the first and after the
last), each `data.eval` set's prompts get `rollout.n_samples_per_eval_prompt` responses with the
evaluation's own sampling settings (`rollout.eval_*`, the run's where null; a set may set its own
`n_samples_per_prompt` and `temperature`, e.g. one greedy pass and one of k samples over one file), scored by the run's
reward, summarised as `eval/NAME/reward_mean`, `pass@1` and `pass@k` (k = 2, 4, 8, ... up to n)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from rlx.data.config import EvalSetConfig
from rlx.eval.metrics import summarise
from rlx.rollout.config import RolloutConfig
from rlx.rollout.group import expand
from rlx.rollout.pool import RolloutPool
from rlx.sample import Sample


def eval_sampling(rollout: RolloutConfig, eval_set: EvalSetConfig | None = None) -> tuple[int, dict]:
    """(responses per prompt, the sampling parameters that differ from training's, in SGLang's
    names) for one eval set: the set's own `n_samples_per_prompt` / `temperature`, else
    `rollout.n_samples_per_eval_prompt` / `rollout.eval_*`."""
    own = eval_set or EvalSetConfig()
    chosen = {
        "temperature": rollout.eval_temperature if own.temperature is None else own.temperature,
        "top_p": rollout.eval_top_p,
        "max_new_tokens": rollout.eval_max_response_len,
    }
    n = own.n_samples_per_prompt or rollout.n_samples_per_eval_prompt
    return n, {key: value for key, value in chosen.items() if value is not None}


def pass_ks(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]


def evaluate(
    pool: RolloutPool,
    sets: dict[str, list[Sample]],
    rollout: RolloutConfig,
    version: int,
    set_configs: dict[str, EvalSetConfig] | None = None,
) -> dict:
    """Generate and score every set once with the current weights; its metrics. `set_configs`:
    `data.eval`, whose sets may sample their own way (`eval_sampling`)."""
    start = time.perf_counter()
    plans = {name: eval_sampling(rollout, (set_configs or {}).get(name)) for name in sets}
    groups = {
        name: [expand(prompt, g, plans[name][0]) for g, prompt in enumerate(prompts)]
        for name, prompts in sets.items()
    }

    async def everything():
        await asyncio.gather(
            *(
                pool.generate_group(group, step=-1, version=version, sampling=plans[name][1])
                for name, set_groups in groups.items()
                for group in set_groups
            )
        )

    pool.run(everything())
    metrics: dict[str, float] = {}
    for name, set_groups in groups.items():
        metrics |= summarise(name, [s for group in set_groups for s in group], ks=pass_ks(plans[name][0]))
    return metrics | {"time/eval_s": time.perf_counter() - start}


class Evaluator:
    """`due(step, version)` -> the eval metrics when step is a multiple of `run.eval_interval`, else {}."""

    def __init__(
        self,
        pool: RolloutPool,
        sets: dict[str, list[Sample]],
        rollout: RolloutConfig,
        interval: int,
        before: Callable[[], None] | None = None,
        set_configs: dict[str, EvalSetConfig] | None = None,
    ):
        """`before`: called before each evaluation (until the engines serve the current version);
        `set_configs`: `data.eval` (each set's own sampling)."""
        self.pool, self.sets, self.rollout, self.interval, self.before = pool, sets, rollout, interval, before
        self.set_configs = set_configs or {}

    def due(self, step: int, version: int) -> dict:
        if not self.sets or not self.interval or step % self.interval:
            return {}
        if self.before is not None:
            self.before()
        return evaluate(self.pool, self.sets, self.rollout, version, self.set_configs)
