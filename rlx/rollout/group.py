"""One group of samples on its way through the engines: a prompt's group, the ids and sampling
seeds of its requests, an engine's answer appended to a sample, and the metrics of a batch."""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Collection

from rlx.rollout.generate import read_output
from rlx.sample import Sample, Status


def expand(prompt: Sample, group: int, n: int) -> list[Sample]:
    """The `n` samples of one prompt's group, numbered (group, 0..n-1)."""
    samples = []
    for i in range(n):
        s = copy.copy(prompt)
        s.metadata = dict(prompt.metadata)
        s.group, s.index = group, i
        samples.append(s)
    return samples


def snapshot(s: Sample) -> dict:
    """A sample's fields (lists and dicts copied), for `restore` after a failed engine."""
    return {name: copy.copy(getattr(s, name)) for name in Sample.__slots__}


def restore(s: Sample, saved: dict) -> None:
    for name, value in saved.items():
        setattr(s, name, value)


def request_id(s: Sample) -> str:
    """The request id of a sample's next generation request: unique among live requests."""
    return f"rlx-{id(s):x}-{s.group}-{s.index}-{s.response_len}"


def sampling_seed(run_seed: int, step: int, s: Sample) -> int:
    """A 63-bit sampling seed from (run seed, step, group, index[, tokens so far]), distinct per
    sample, step and continuation."""
    key = f"{run_seed}/{step}/{s.group}/{s.index}" + (f"/{s.response_len}" if s.response_len else "")
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def append_answer(
    s: Sample,
    out: dict,
    version: int,
    tokenizer,
    stop_ids: Collection[int] = (),
    stop_strings: Collection[str] = (),
) -> None:
    """Append one SGLang /generate answer to the sample (a continuation extends what it has);
    `version`: the policy version if the engine reports none; `stop_ids` and `stop_strings`: the
    run's (`rlx.rollout.generate.stop_ids`, `rollout.stop`), so that an answer ending on one is
    COMPLETED."""
    answer = read_output(out, version, stop_ids, stop_strings)
    new = len(answer.ids)
    s.response_ids = s.response_ids + answer.ids
    s.rollout_logprobs = s.rollout_logprobs + answer.logprobs
    s.loss_mask = (s.loss_mask or [1] * (s.response_len - new)) + [1] * new
    s.token_versions = (s.token_versions or [answer.version] * (s.response_len - new)) + [
        answer.version
    ] * new
    s.version = min(s.token_versions, default=answer.version)
    s.response_text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
    s.status, s.status_reason = answer.status, ""
    if s.status is Status.ABORTED or not s.response_ids:
        s.status = Status.ABORTED if s.status is Status.ABORTED else Status.FAILED
        s.status_reason = answer.message or "empty response"


def rollout_metrics(samples: list[Sample], elapsed: float) -> dict[str, float]:
    """rollout/* and time/perf figures of one batch's samples."""
    n = max(len(samples), 1)
    num_tokens = sum(s.response_len for s in samples)
    count = {st: sum(s.status == st for s in samples) for st in Status}
    metrics = {
        "rollout/reward_mean": sum(s.reward or 0.0 for s in samples) / n,
        "rollout/response_len_mean": num_tokens / n,
        "rollout/truncated_frac": count[Status.TRUNCATED] / n,
        "rollout/failed_frac": (count[Status.FAILED] + count[Status.ABORTED]) / n,
        "rollout/num_tokens": float(num_tokens),
        "rollout/num_prompt_tokens": float(sum(len(s.prompt_ids) for s in samples)),
        "time/rollout_s": elapsed,
        "perf/rollout_tokens_per_s": num_tokens / max(elapsed, 1e-9),
    }
    # a tool-using generate_fn's batch: `rlx.agent.call_tool` records each call in the sample
    calls = [c for s in samples for c in (s.metadata or {}).get("tool_calls", ())]
    if calls:
        metrics["rollout/tool_calls_mean"] = len(calls) / n
        metrics["rollout/tool_failed_frac"] = sum(not c.get("ok", True) for c in calls) / len(calls)
        metrics["rollout/tool_seconds_mean"] = sum(c.get("seconds", 0.0) for c in calls) / len(calls)
    return metrics
