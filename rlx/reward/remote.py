"""A remote reward model over HTTP (`reward.url`): batched, time-limited, retried.

Protocol: one `POST reward.url` per batch of samples, JSON both ways.

    request  {"samples": [{"prompt": ..., "response": ..., "label": ..., "metadata": {...}}, ...],
              "query":   [prompt_text + response, ...],   # the same batch in OpenRLHF's
              "prompts": [prompt_text, ...],              # --remote_rm_url form, so its
              "labels":  [label, ...]}                    # reward servers answer it as is
    response {"rewards": [r0, r1, ...]}                   # one per sample, in order; other keys ignored

`prompt` is the sample's prompt as the data gave it (a string or a list of chat messages);
`prompt_text` is the prompt as the model saw it (decoded `prompt_ids` when the scorer has the
tokenizer). A reward may be a number or, with `reward.reward_key`, an object holding it.

A batch holds up to `reward.batch_size` samples, from one group or several: a partial batch
waits `reward.batch_wait_s` for more finished groups. Each attempt is limited to
`reward.timeout_s`; connection errors, timeouts, 429 and 5xx answers are retried
`reward.max_retries` times, the first after `reward.retry_backoff_s`, then twice as long each
time; if the server still does not answer, the batch's samples fail as `unavailable`
(`reward.on_failure` decides what that means for training). Another 4xx, or an answer that is
not `{"rewards": [...]}` with one entry per sample, fails them as `remote_error` at once.
At start (`check`) the URL must answer an HTTP request at all, else ConfigError: a server that
is down before the run starts is a setup mistake, not something to train through.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

import aiohttp

from rlx.errors import ConfigError
from rlx.reward.config import RewardConfig
from rlx.reward.scorer import BaseScorer, RewardFailure
from rlx.sample import Sample

log = logging.getLogger(__name__)

RETRY_STATUS = {429, 500, 502, 503, 504}


class RemoteReward(BaseScorer):
    """Scores samples by POSTing them to `cfg.url` (module docstring: protocol, batching, retries)."""

    _extra_counts = ("requests", "retries")

    def __init__(self, cfg: RewardConfig, *, tokenizer: Any = None):
        super().__init__(cfg)
        self.url = cfg.url
        self.tokenizer = tokenizer
        self._session: aiohttp.ClientSession | None = None
        self._pending: list[tuple[Sample, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self._slots: asyncio.Semaphore | None = None

    def check(self) -> None:
        """ConfigError unless the URL answers an HTTP request (any status: a POST-only route that
        answers 405 to this GET is up), trying as often and as patiently as a request would."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        error: Exception | None = None
        for attempt in range(self.cfg.max_retries + 1):
            try:
                opener.open(self.url, timeout=self.cfg.timeout_s).close()
                return
            except urllib.error.HTTPError:
                return
            except (urllib.error.URLError, OSError) as e:
                error = e
            if attempt < self.cfg.max_retries:
                time.sleep(self.cfg.retry_backoff_s * 2**attempt)
        raise ConfigError(
            f"reward.url={self.url!r} does not answer ({error}; {self.cfg.max_retries + 1} tries)\n"
            "fix: start the reward server first, or correct reward.url"
        )

    async def _score(self, samples: list[Sample]) -> None:
        loop = asyncio.get_running_loop()
        futures = []
        for s in samples:
            futures.append(loop.create_future())
            self._pending.append((s, futures[-1]))
        while len(self._pending) >= self.cfg.batch_size:
            batch, self._pending = self._pending[: self.cfg.batch_size], self._pending[self.cfg.batch_size :]
            self._launch(batch)
        if self._timer is not None and not self._pending:
            self._timer.cancel()
            self._timer = None
        elif self._timer is None and self._pending:
            self._timer = loop.call_later(self.cfg.batch_wait_s, self._flush)
        await asyncio.gather(*futures)

    def _flush(self) -> None:
        self._timer = None
        if self._pending:
            batch, self._pending = self._pending, []
            self._launch(batch)

    def _launch(self, batch: list[tuple[Sample, asyncio.Future]]) -> None:
        task = asyncio.ensure_future(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[Sample, asyncio.Future]]) -> None:
        samples = [s for s, _ in batch]
        try:
            if self._slots is None:
                self._slots = asyncio.Semaphore(self.cfg.num_workers)
            async with self._slots:
                rewards = await self._post(samples)
            for s, value in zip(samples, rewards, strict=True):
                self._set(s, value, f"reward server {self.url}")
        except RewardFailure as f:
            for s in samples:
                self._fail(s, f)
        finally:
            for _, future in batch:
                if not future.done():
                    future.set_result(None)

    async def _post(self, samples: list[Sample]) -> list[Any]:
        """The server's rewards for `samples`, retried as the module docstring says."""
        body = json.dumps(self._payload(samples), default=str)
        error = ""
        for attempt in range(self.cfg.max_retries + 1):
            self._counts["requests"] += 1
            try:
                async with self._http().post(
                    self.url, data=body, headers={"Content-Type": "application/json"}
                ) as response:
                    text = await response.text()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as e:
                error = (
                    f"no answer within reward.timeout_s={self.cfg.timeout_s}"
                    if isinstance(e, TimeoutError)
                    else f"{type(e).__name__}: {e}"
                )
            else:
                if 200 <= status < 300:
                    return self._rewards(text, len(samples))
                error = f"answered {status}: {text[:200]}"
                if status not in RETRY_STATUS:
                    raise RewardFailure("remote_error", f"reward server {self.url} {error}")
            if attempt < self.cfg.max_retries:
                self._counts["retries"] += 1
                log.info("reward server %s: %s; retry %d", self.url, error, attempt + 1)
                await asyncio.sleep(self.cfg.retry_backoff_s * 2**attempt)
        raise RewardFailure(
            "unavailable", f"reward server {self.url} failed {self.cfg.max_retries + 1} times; last: {error}"
        )

    def _rewards(self, text: str, count: int) -> list[Any]:
        try:
            rewards = json.loads(text)["rewards"]
        except (ValueError, KeyError, TypeError):
            raise RewardFailure(
                "remote_error", f'reward server {self.url} answered {text[:200]!r}, not {{"rewards": [...]}}'
            ) from None
        if not isinstance(rewards, list) or len(rewards) != count:
            got = f"{len(rewards)} rewards" if isinstance(rewards, list) else repr(rewards)[:60]
            raise RewardFailure("wrong_count", f"reward server {self.url} returned {got} for {count} samples")
        return rewards

    def _payload(self, samples: list[Sample]) -> dict[str, Any]:
        prompts = [self._prompt_text(s) for s in samples]
        return {
            "samples": [
                {"prompt": s.prompt, "response": s.response_text, "label": s.label, "metadata": s.metadata}
                for s in samples
            ],
            "query": [p + s.response_text for p, s in zip(prompts, samples, strict=True)],
            "prompts": prompts,
            "labels": [s.label for s in samples],
        }

    def _prompt_text(self, s: Sample) -> str:
        if self.tokenizer is not None and s.prompt_ids:
            return self.tokenizer.decode(s.prompt_ids, skip_special_tokens=False)
        return s.prompt if isinstance(s.prompt, str) else json.dumps(s.prompt)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.cfg.timeout_s),
                connector=aiohttp.TCPConnector(limit=self.cfg.num_workers),
                trust_env=False,
            )
        return self._session

    async def aclose(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._flush()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
