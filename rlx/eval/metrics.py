"""Evaluation metrics over scored samples: mean reward, pass@1 and pass@k per evaluation set.

A sample counts as correct when its reward is at least `threshold` (default 1.0: the built-in
verifiers give 1.0 for a right answer, and the toy tasks' partial credit is 1.0 only for a full
match). A sample without a reward (failed or aborted) counts as reward 0 and incorrect.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from rlx.sample import Sample, Status

log = logging.getLogger(__name__)

CORRECT_THRESHOLD = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from `n` samples of which `c` are correct (Chen et al. 2021):
    the chance that `k` of them drawn without replacement include a correct one,
    1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1..n} (1 - k/i) (no huge binomials)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every draw of k contains a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def summarise(
    name: str, samples: Sequence[Sample], ks: Iterable[int] = (), threshold: float = CORRECT_THRESHOLD
) -> dict[str, float]:
    """`eval/{name}/reward_mean` (over samples), `eval/{name}/pass@1` and `eval/{name}/pass@{k}`
    for each k in `ks` (each the mean over prompts of `pass_at_k`), and `eval/{name}/num_failed`
    (samples whose generation or reward failed, or without a reward: each counts 0, never correct).

    A prompt's samples are those sharing `metadata["prompt_index"]`; prompts may have different
    numbers of samples. pass@k needs k <= n for every prompt: a k above the smallest prompt's
    sample count is left out (and logged).
    """
    if not samples:
        raise ValueError(f"eval set {name!r}: no samples to summarise")
    correct_by_prompt: dict[int, list[bool]] = defaultdict(list)
    rewards = []
    for sample in samples:
        if "prompt_index" not in sample.metadata:
            raise ValueError(
                f"eval set {name!r}: a sample has no metadata['prompt_index'] (group {sample.group}, "
                f"index {sample.index}); samples from rlx.eval.build_eval_sets carry it"
            )
        failed = _failed(sample)
        reward = 0.0 if failed else float(sample.reward)
        rewards.append(reward)
        correct_by_prompt[sample.metadata["prompt_index"]].append(not failed and reward >= threshold)
    fewest = min(len(c) for c in correct_by_prompt.values())
    wanted = sorted({1, *ks})
    if too_many := [k for k in wanted if k > fewest]:
        log.warning("eval set %r: pass@%s left out: a prompt has only %d samples", name, too_many, fewest)
    prefix = f"eval/{name}"
    metrics = {f"{prefix}/reward_mean": sum(rewards) / len(rewards)}
    for k in (k for k in wanted if k <= fewest):
        scores = [pass_at_k(len(c), sum(c), k) for c in correct_by_prompt.values()]
        metrics[f"{prefix}/pass@{k}"] = sum(scores) / len(scores)
    metrics[f"{prefix}/num_failed"] = float(sum(_failed(s) for s in samples))
    return metrics


def _failed(sample: Sample) -> bool:
    """No reward to count: generation or the reward function failed (the scorer sets 0.0 and FAILED)."""
    return sample.reward is None or sample.status is Status.FAILED
