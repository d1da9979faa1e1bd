"""The pool of rollout engines the loop talks to: generation, rewards, weight updates.

Engines run as Ray actors (each serving SGLang's HTTP API); with two or more, requests go
through the real sglang-router. The pool only speaks HTTP to them, so local and SGLang
engines are driven by the same code.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import time

import ray

from rlx.reward import load_reward_fn
from rlx.rollout.client import EngineClient
from rlx.rollout.config import RolloutConfig
from rlx.rollout.engine_actor import EngineActor
from rlx.rollout.router import Router
from rlx.sample import Sample, Status

log = logging.getLogger(__name__)

_FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


class RolloutPool:
    """`generate` expands prompts into groups and fills responses, logprobs, rewards, status."""

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        tokenizer,
        *,
        seed: int,
        actor_options: list[dict] | None = None,
    ):
        """`actor_options`: Ray options per engine (`rlx.placement.plan(...).engines`); default: CPU."""
        self.cfg = cfg
        self.seed = seed
        self.tokenizer = tokenizer
        self.reward_fn = load_reward_fn(cfg.reward_fn)
        options = actor_options or [{"num_cpus": 0}] * cfg.num_engines
        self.actors = [
            ray.remote(EngineActor).options(**options[i]).remote(cfg, model_path, seed=seed + i)
            for i in range(len(options))
        ]
        self.router: Router | None = None
        self._loop = asyncio.new_event_loop()
        self.engine_urls = ray.get([a.url.remote() for a in self.actors])
        if len(self.engine_urls) >= 2:
            self.router = Router(self.engine_urls, extra_args=dict(cfg.router_args))
            self.router.start()
        self.url = self.router.url if self.router else self.engine_urls[0]
        self.client = EngineClient(self.url)
        self.engine_clients = [EngineClient(u) for u in self.engine_urls]
        self.sampling_params = {
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
            "max_new_tokens": cfg.max_response_len,
            "stop_token_ids": list(cfg.stop_token_ids),
            "ignore_eos": cfg.ignore_eos,
            "skip_special_tokens": True,
        }

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    # ---- generation --------------------------------------------------------------------------

    def generate(
        self, prompts: list[Sample], version: int, step: int = 0
    ) -> tuple[list[Sample], dict[str, float]]:
        """n_samples_per_prompt responses per prompt, ordered by (group, index), with rewards.

        With one engine (addressed directly), each sample is drawn with its own sampling seed, a
        function of (run seed, `step`, group, index), so what a sample gets does not depend on how
        the engine batched requests and a seeded run repeats exactly. sglang-router 0.3.2 accepts
        only one `sampling_params` object per batch request, so behind the router a group shares
        the engines' own random streams instead (one seed for all would repeat one sample n times).

        Raises RuntimeError naming the first failure when every request of the step failed (an
        engine that is down or rejects the requests), rather than training on nothing."""
        start = time.perf_counter()
        samples = []
        for g, prompt in enumerate(prompts):
            for i in range(self.cfg.n_samples_per_prompt):
                s = copy.copy(prompt)
                s.metadata = dict(prompt.metadata)
                s.group, s.index = g, i
                samples.append(s)
        self._run(self._generate_all(samples, version, step))
        if all(s.status is Status.FAILED for s in samples):
            raise RuntimeError(
                f"every rollout request of step {step} failed; the first: {samples[0].status_reason}"
            )
        for s in samples:
            self._reward(s)
        elapsed = time.perf_counter() - start
        return samples, self._metrics(samples, elapsed)

    async def _generate_all(self, samples: list[Sample], version: int, step: int) -> None:
        semaphore = asyncio.Semaphore(self.cfg.max_concurrency)
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group, []).append(s)
        await asyncio.gather(*(self._generate_group(g, semaphore, version, step) for g in groups.values()))

    async def _generate_group(
        self, group: list[Sample], semaphore: asyncio.Semaphore, version: int, step: int
    ) -> None:
        params: dict | list[dict] = self.sampling_params
        if self.router is None:
            params = [self.sampling_params | {"sampling_seed": self._seed(step, s)} for s in group]
        async with semaphore:
            try:
                outs = await self.client.generate_batch([s.prompt_ids for s in group], params)
            except Exception as e:  # a failed request fails its group, not the run
                for s in group:
                    s.status, s.status_reason = Status.FAILED, f"{type(e).__name__}: {e}"
                return
        for s, out in zip(group, outs, strict=True):
            self._fill(s, out, version)

    def _seed(self, step: int, s: Sample) -> int:
        """A 63-bit sampling seed from (run seed, step, group, index): distinct per sample and step."""
        key = f"{self.seed}/{step}/{s.group}/{s.index}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1

    def _fill(self, s: Sample, out: dict, version: int) -> None:
        """Copy one SGLang /generate response into the sample."""
        meta = out.get("meta_info", {})
        token_logprobs = meta.get("output_token_logprobs") or []
        # SGLang omits output_ids (and logprobs) for a request aborted before it started
        s.response_ids = [int(t) for _, t, *_ in token_logprobs] or list(out.get("output_ids") or [])
        s.rollout_logprobs = [float(lp) for lp, *_ in token_logprobs]
        s.loss_mask = [1] * len(s.response_ids)
        s.response_text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        finish = meta.get("finish_reason") or {}
        s.status = _FINISH_STATUS.get(finish.get("type"), Status.COMPLETED)
        if s.status is Status.ABORTED or not s.response_ids:
            s.status = Status.ABORTED if s.status is Status.ABORTED else Status.FAILED
            s.status_reason = str(finish.get("message", "empty response"))
        weight_version = meta.get("weight_version")
        s.version = int(weight_version) if weight_version not in (None, "", "default") else version

    def _reward(self, s: Sample) -> None:
        if s.status in (Status.FAILED, Status.ABORTED):
            s.reward = 0.0
            return
        try:
            s.reward = float(self.reward_fn(s))
        except Exception as e:
            s.reward, s.status, s.status_reason = (
                0.0,
                Status.FAILED,
                f"reward_fn raised {type(e).__name__}: {e}",
            )

    @staticmethod
    def _metrics(samples: list[Sample], elapsed: float) -> dict[str, float]:
        n = len(samples)
        num_tokens = sum(s.response_len for s in samples)
        count = {st: sum(s.status == st for s in samples) for st in Status}
        return {
            "rollout/reward_mean": sum(s.reward for s in samples) / n,
            "rollout/response_len_mean": num_tokens / n,
            "rollout/truncated_frac": count[Status.TRUNCATED] / n,
            "rollout/failed_frac": (count[Status.FAILED] + count[Status.ABORTED]) / n,
            "rollout/num_tokens": float(num_tokens),
            "time/rollout_s": elapsed,
            "perf/rollout_tokens_per_s": num_tokens / max(elapsed, 1e-9),
        }

    # ---- weights and lifecycle ---------------------------------------------------------------

    def update_weights(self, path: str, version: int) -> None:
        """Every engine loads the HF weight shards at `path` and then serves `version`."""

        for url, result in zip(
            self.engine_urls,
            self._run(self._on_engines("update_weights_from_disk", path, weight_version=str(version))),
            strict=True,
        ):
            if not result.get("success", False):
                raise RuntimeError(
                    f"engine {url} failed to load weights from {path}: {result.get('message')}"
                )
        self.check_version(version)

    def check_version(self, version: int) -> None:
        """RuntimeError unless every engine now serves `version`."""
        served = self._run(self._on_engines("get_weight_version"))
        if any(v != str(version) for v in served):
            raise RuntimeError(f"engines serve versions {served} after updating to {version}")

    def join_weight_group(self, master_address: str, master_port: int, backend: str) -> None:
        """Every engine joins the trainer's broadcast group (ranks 1..N; the trainer is rank 0);
        returns once the group has formed, so the trainer must be joining at the same time."""
        world_size = 1 + len(self.engine_clients)
        joins = [
            c.init_weights_update_group(master_address, master_port, 1 + i, world_size, backend)
            for i, c in enumerate(self.engine_clients)
        ]

        async def all_join():
            await asyncio.gather(*joins)

        self._run(all_join())

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Every engine frees `tags` ("weights", "kv_cache"; all when None): a colocated trainer's turn."""
        self._run(self._on_engines("release_memory_occupation", tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Every engine allocates `tags` again (all when None)."""
        self._run(self._on_engines("resume_memory_occupation", tags))

    async def _on_engines(self, method: str, *args, **kwargs) -> list:
        """Call one client method on every engine at once."""
        return await asyncio.gather(*(getattr(c, method)(*args, **kwargs) for c in self.engine_clients))

    def shutdown(self) -> None:
        try:
            if self.router:
                self.router.stop()
            for c in [self.client, *self.engine_clients]:
                self._run(c.aclose())
            ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
        finally:
            for a in self.actors:
                ray.kill(a)
            self._loop.close()
