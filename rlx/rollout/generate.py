"""Custom generation (`rollout.generate_fn`): multi-turn, tools, agents; one function per task.

The contract of `rollout.generate_fn` (the dotted path of an async function):

    async def generate(ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample | list[Sample]

It is called once per sample to generate (each of a group's `n_samples_per_prompt` copies of a
prompt, concurrently), instead of rlx's one request per group. `sample` holds the prompt
(`prompt`, `prompt_ids`, `label`, `metadata`) and an empty response; `sampling_params` is the
run's (SGLang's names: temperature, top_p, top_k, max_new_tokens, stop_token_ids, stop, ...), to pass
on or change. The function drives the engines through `ctx` and builds the response as token ids:

    out = await ctx.generate(sample.tokens, params)   # SGLang's /generate answer
    ctx.append_output(sample, out)                    # the model's tokens: trained (loss_mask 1)
    ctx.append_tokens(sample, tool_ids)               # tool or environment output: not trained

so what the model produced is never re-tokenised, and only model tokens carry loss. It sets
`sample.status` when it ends some other way than the last output says (`append_output` sets
it from the engine's finish reason: COMPLETED on EOS or a stop token, even on the last token
the limit allows, TRUNCATED when cut by the limit), and may set `sample.reward` itself (the
scorer then leaves it). It returns the sample, or several (fan-out: each becomes a sample of the
group, numbered after it). An exception fails that sample (status FAILED with the reason); the
run goes on. So does a call that outlasts `rollout.generate_timeout_s` (it is cancelled). It must
await, never block: every sample shares one event loop, and a call that holds it for a minute
(`time.sleep`, a blocking HTTP client) ends the run, naming its line (`rlx.rollout.loop_watch`);
run blocking work with `await asyncio.to_thread(f, ...)`.

slime's `async def generate(args, sample, sampling_params)` ports by taking `ctx` for `args`:
`ctx.url` is the router's address (slime's `args.sglang_router_ip/port`), `ctx.post(path, json)`
its `post` helper, `ctx.tokenizer` the tokenizer.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

from rlx.config.build import load_function
from rlx.errors import ConfigError
from rlx.rollout.client import EngineClient
from rlx.rollout.config import RolloutConfig
from rlx.sample import Sample, Status

GenerateFn = Callable[["GenerateContext", Sample, dict], Awaitable[Sample | list[Sample]]]

_FIRST, _SECOND = itemgetter(0), itemgetter(1)

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


class GenerateContext:
    """What a generate_fn drives the engines with (one per sample call). `stop_ids`: the ids that
    end this run's responses (`stop_ids()`), so that an answer ending on one is COMPLETED."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer,
        rollout: RolloutConfig,
        version: int,
        stop_ids: Collection[int] = frozenset(),
    ):
        self.client, self.tokenizer, self.rollout, self.version = client, tokenizer, rollout, version
        self.url = client.base_url
        self.stop_ids = frozenset(stop_ids)

    async def generate(self, input_ids: list[int], sampling_params: dict, **kwargs: Any) -> dict:
        """POST /generate for one prompt (through the router when there is one); SGLang's answer,
        with `meta_info.output_token_logprobs` (the logprobs every trained token needs)."""
        return await self.client.generate(list(input_ids), sampling_params, **kwargs)

    async def post(self, path: str, payload: dict) -> Any:
        """POST any SGLang endpoint (slime's `post(url, payload)`); the JSON answer."""
        return (await self.client._request("POST", path, json=payload)).body

    def append_output(
        self,
        sample: Sample,
        out: dict,
        stop_token_ids: Collection[int] = (),
        *,
        ignore_eos: bool = False,
        stop: Collection[str] = (),
    ) -> int:
        """Append the model's tokens of one /generate answer to the response (trained, with their
        logprobs and the version that generated them); set the status from its finish reason
        (`read_output`; `stop_token_ids` and `stop` (strings): the request's own besides the run's;
        `ignore_eos`: the request's, which stops it on no token, yet on its strings, as SGLang
        does). Returns the number of tokens appended."""
        stops = frozenset() if ignore_eos else self.stop_ids | frozenset(stop_token_ids)
        answer = read_output(out, self.version, stops, [*self.rollout.stop, *strings(stop)])
        _extend(sample, answer.ids, answer.logprobs, 1, answer.version)
        sample.status = answer.status
        if sample.status is Status.ABORTED:
            sample.status_reason = answer.message or "aborted"
        return len(answer.ids)

    def append_tokens(self, sample: Sample, token_ids: list[int]) -> None:
        """Append tokens the model did not generate (tool output, environment feedback): part of
        the context of what follows, left out of the loss (loss_mask 0, logprob 0)."""
        ids = [int(t) for t in token_ids]
        _extend(sample, ids, [0.0] * len(ids), 0, self.version)

    def append_text(self, sample: Sample, text: str) -> list[int]:
        """`append_tokens` of `text` tokenised alone (no special tokens added); the ids."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        self.append_tokens(sample, ids)
        return ids


@dataclass
class Output:
    """One SGLang /generate answer for one prompt, as a sample needs it."""

    ids: list[int]  # the new tokens
    logprobs: list[float]  # theirs (empty when the engine sent none, e.g. aborted before it started)
    version: int  # the weight version that generated them
    status: Status  # from the finish reason
    message: str  # the finish reason's message ("" when none)


def read_output(
    out: dict, version: int, stop_ids: Collection[int] = (), stop_strings: Collection[str] = ()
) -> Output:
    """The tokens, logprobs, weight version (`version` when the engine reports none) and finish
    status of a /generate answer. An answer whose last token is one of `stop_ids` (EOS, a stop
    token), or whose text holds one of `stop_strings`, is COMPLETED even when its finish reason is
    "length": SGLang checks the length limit first, so a response that ends on its last allowed
    token reports "length", yet it ended (as transformers' `generate` and rlx's hf_eval judge it).
    A stop string in the text can only have come with the last token: an earlier one would have
    stopped the request there. (The text skips special tokens: a stop string that is one is
    seen at the limit only as a stop token id.)"""
    meta = out.get("meta_info", {})
    pairs = meta.get("output_token_logprobs") or []
    # SGLang omits output_ids (and logprobs) for a request aborted before it started
    # (a batch's 30k tokens: map and itemgetter, not a Python loop over unpacked triples)
    ids = list(map(int, map(_SECOND, pairs))) or [int(t) for t in out.get("output_ids") or []]
    weight_version = meta.get("weight_version")
    served = int(weight_version) if weight_version not in (None, "", "default") else version
    finish = meta.get("finish_reason") or {}
    status = FINISH_STATUS.get(finish.get("type"), Status.COMPLETED)
    if status is Status.TRUNCATED and ids and (ids[-1] in stop_ids or _holds(out.get("text"), stop_strings)):
        status = Status.COMPLETED
    logprobs = list(map(_FIRST, pairs))
    if None in logprobs:  # JSON's null for a non-finite number (orjson's and SGLang's encoding)
        logprobs = [math.nan if lp is None else lp for lp in logprobs]
    return Output(ids, list(map(float, logprobs)), served, status, str(finish.get("message") or ""))


def _holds(text: Any, stops: Collection[str]) -> bool:
    return isinstance(text, str) and any(s and s in text for s in stops)


def strings(stop: str | Collection[str] | None) -> list[str]:
    """SGLang's `stop` as a list: one string, several, or none."""
    return [stop] if isinstance(stop, str) else list(stop or ())


def stop_ids(cfg: RolloutConfig, tokenizer, model_path: str | None = None) -> frozenset[int]:
    """The ids that end this run's responses as the engines judge them: `rollout.stop_token_ids`
    and the EOS ids of the checkpoint's config.json, generation_config.json (both read where
    `model_path` has them) and tokenizer, as SGLang gathers them; none with `rollout.ignore_eos`
    (the engines then stop on neither)."""
    if cfg.ignore_eos:
        return frozenset()
    values = [getattr(tokenizer, "eos_token_id", None), *cfg.stop_token_ids]
    for name in ("config.json", "generation_config.json") if model_path else ():
        try:
            values.append(json.loads((Path(model_path) / name).read_text()).get("eos_token_id"))
        except (OSError, ValueError, AttributeError):
            pass  # absent or unreadable: the engine's own load names a broken one
    ids = set()
    for value in values:
        ids.update(value if isinstance(value, list | tuple) else [value])
    return frozenset(int(v) for v in ids if isinstance(v, int) and not isinstance(v, bool))


def _extend(sample: Sample, ids: list[int], logprobs: list[float], mask: int, version: int) -> None:
    if len(logprobs) != len(ids):
        raise ValueError(f"{len(ids)} tokens but {len(logprobs)} logprobs (ask for return_logprob)")
    sample.response_ids = sample.response_ids + ids
    sample.rollout_logprobs = sample.rollout_logprobs + logprobs
    sample.loss_mask = sample.loss_mask + [mask] * len(ids)
    sample.token_versions = sample.token_versions + [version] * len(ids)
    model_versions = [v for v, m in zip(sample.token_versions, sample.loss_mask, strict=True) if m]
    sample.version = min(model_versions, default=version)


def load_generate_fn(path: str) -> GenerateFn:
    """The async function `rollout.generate_fn` names; ConfigError naming the key when it is not one."""
    fix = "give the dotted path of `async def generate(ctx, sample, sampling_params)` (rlx.rollout.generate)"
    fn = load_function("rollout.generate_fn", path, fix)
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"rollout.generate_fn={path!r} is not an async function\nfix: {fix}")
    return fn
