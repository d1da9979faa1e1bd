"""The trainer ranks as Ray actors, driven together.

Every call on the ranks is bounded by `cluster.trainer_call_timeout_s`, and a rank whose process
died (killed, out of memory) is named at once: both end the run with `TrainerRankError` instead of
a silent stall. After one, the group is broken and `shutdown` only kills what is left.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from rlx import actor_reuse, ports, process_clock
from rlx.trainer.rank import TrainerRank

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 30.0
DEATH_NOTICE_S = 5.0  # how long Ray may take to report a dead rank after its peers' collectives fail


class TrainerRankError(RuntimeError):
    """A trainer rank died or did not answer a call in time; the message names the rank and call."""


def _slowest_start(warm: list[dict], asked: float) -> str:
    """The start-up log's account of the rank that was ready last, from its `TrainerRank.warm_up`
    times and `asked`, when the driver asked Ray for the ranks."""
    w = max(warm, key=lambda w: w["loaded"] + w["imports_s"])
    then = f"Megatron and the kernels {w['imports_s']:.1f} s"
    how = process_clock.origin(w["started"], w["loaded"], asked)
    if how == "kept" and w["runs"]:  # a rank process an earlier run handed back
        return f" (the slowest rank: a process of an earlier run, {then})"
    if how == "kept":  # an idle worker of a Ray that preloads (rlx.trainer.preload)
        return f" (the slowest rank: an idle Ray worker with torch and Megatron preloaded, then the kernels {w['imports_s']:.1f} s)"
    first = {"pooled": "an idle Ray worker taking it and importing torch",
             "new": "a new process: Python, Ray's worker and torch"}[how]  # fmt: skip
    ready = w["loaded"] + w["imports_s"] - asked
    return f" (the slowest rank, ready {ready:.1f} s after it was asked for: {first} {w['loaded'] - asked:.1f} s, then {then})"


class TrainerGroup:
    """`cluster.num_trainer_procs` MegatronTrainer actors forming one torch.distributed world,
    rendezvousing on trainer rank 0's node (`master_addr`)."""

    def __init__(
        self,
        cfg,
        actor_options: list[dict] | None = None,
        profile_dir: Path | None = None,
        *,
        start: bool = True,
    ):
        """`actor_options`: Ray options per rank (`rlx.placement.plan(...).trainer`); default: CPU.
        `profile_dir`: where the steps of `debug.profile_train_steps` leave their profiles.
        `start=False`: only launch the ranks' processes (they import Megatron meanwhile:
        `TrainerRank.warm_up`, while the caller starts the engines, say); `start()` then sets them
        up. Inside `rlx.actor_reuse.keep_actors`, the first ranks take rank processes an earlier
        group handed back, new ones start for the rest."""
        options = actor_options or [{"num_cpus": 0}] * cfg.cluster.num_trainer_procs
        self.options = options
        self.cfg = cfg
        self.call_timeout_s = cfg.cluster.trainer_call_timeout_s
        self.profile_steps = set(cfg.debug.profile_train_steps) if profile_dir is not None else set()
        self.profile_dir = profile_dir
        self._broken = self._started = False
        actor_cls = ray.remote(TrainerRank)
        taken = actor_reuse.take("trainer", options)
        self.actors = taken + [actor_cls.options(**o).remote() for o in options[len(taken) :]]
        self._asked = time.time()
        self._warm_ups = [a.warm_up.remote(cfg.model.kernels) for a in self.actors]
        self.where = ["not started yet"] * len(options)  # then "pid P on NODE", for messages
        if start:
            self.start()

    def start(self) -> TrainerGroup:
        """Wait for the ranks' processes, rendezvous them on rank 0's node and build each rank's
        MegatronTrainer; once (later calls return at once). A failure kills the ranks."""
        if self._started:
            return self
        cfg, num_procs = self.cfg, len(self.actors)
        began = time.perf_counter()
        try:
            warm = self.wait(self._warm_ups, "start-up (imports)")
            endpoints = self.wait([a.endpoint.remote() for a in self.actors], "start-up")
            up = time.perf_counter()
            self.where = [f"pid {pid} on {node}" for node, pid in endpoints]
            self.pids = [pid for _, pid in endpoints]
            self.master_addr = endpoints[0][0]
            master_port = self.wait([self.actors[0].host_rendezvous.remote()], "host_rendezvous()")[0]
            kwargs = dict(
                world_size=num_procs, master_addr=self.master_addr, master_port=master_port,
                seed=cfg.run.seed, total_steps=cfg.run.num_rollout * cfg.train.num_steps_per_rollout,
                temperature=cfg.rollout.temperature, api_key=ports.api_key(),  # the run's: weight pushes
            )  # fmt: skip
            model_cfgs = (cfg.model, cfg.algo, cfg.train, cfg.cluster)
            setups = [a.setup.remote(*model_cfgs, rank=rank, **kwargs) for rank, a in enumerate(self.actors)]
            self.wait(setups, "setup()")
        except BaseException:
            self._kill()
            raise
        now = time.perf_counter()
        log.info("trainer ranks set up in %.1f s: their processes and imports %.1f s%s, then the models and optimizers %.1f s",
                 now - began, up - began, _slowest_start(warm, self._asked), now - up)  # fmt: skip
        self._started = True
        return self

    def wait(self, refs: list, call: str, timeout_s: float | None = None) -> list:
        """The results of `refs` (one per rank, in rank order), within `timeout_s` (default
        `cluster.trainer_call_timeout_s`). A rank's own exception is raised as it is; a dead rank
        or the time running out raises TrainerRankError naming the rank(s) and `call`."""
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, object] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                self._broken = True
                ranks = sorted(pending.values())
                raise TrainerRankError(
                    f"trainer rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} did not answer "
                    f"{call} within {timeout_s:g} s (cluster.trainer_call_timeout_s); "
                    + "; ".join(f"rank {r}: {self.where[r]}" for r in ranks)
                    + ". A rank stuck in a collective holds up the others: see each rank's log"
                )
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except RayActorError as e:
                    raise self._died(rank, call, e) from e
                except Exception:
                    # a survivor's collective fails when a peer dies: name the death, the cause
                    self._raise_if_died(pending, call)
                    raise
        return [results[rank] for rank in range(len(refs))]

    def _died(self, rank: int, call: str, error: RayActorError) -> TrainerRankError:
        self._broken = True
        return TrainerRankError(
            f"trainer rank {rank} ({self.where[rank]}) died during {call}; the run cannot go on "
            f"without it (run.resume_from=auto continues from the last checkpoint). "
            f"Ray: {str(error).strip().splitlines()[0]}"
        )

    def _raise_if_died(self, pending: dict, call: str, within_s: float = DEATH_NOTICE_S) -> None:
        """Raise TrainerRankError if one of the `pending` ranks turns out dead within `within_s`."""
        ready, _ = (
            ray.wait(list(pending), num_returns=len(pending), timeout=within_s) if pending else ([], [])
        )
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as e:
                raise self._died(pending[ref], call, e) from e
            except Exception:  # that rank's own error, like the one being raised
                pass

    def _call(self, method: str, *args) -> list:
        """`method(*args)` on every rank at once; their results in rank order."""
        return self.wait([a.call.remote(method, *args) for a in self.actors], f"{method}()")

    def train(self, samples, step: int | None = None) -> dict[str, float]:
        """Every rank trains on `samples` (rollout step `step`: profiled when it is one of
        `debug.profile_train_steps`); rank 0's metrics."""
        samples_ref = ray.put(samples)  # one copy in the object store, shared by every rank
        profile = (str(self.profile_dir), step) if step in self.profile_steps else None
        return self._call("train", samples_ref, profile)[0]

    def offload(self, move_state: bool = True, keep_params: bool = False) -> dict[str, float]:
        """Colocated GPUs: every rank frees its gradient buffers and cached memory and (`move_state`)
        moves its models and optimizer state to CPU (`keep_params`: all but the parameters, until
        the next call); rank 0's memory figures."""
        return self._call("offload", move_state, keep_params)[0]

    def onload(self) -> dict[str, float]:
        """Colocated GPUs: every rank back onto its GPU; rank 0's memory figures from just before."""
        return self._call("onload")[0]

    def push_weights(self, method: str, engine_urls: list[str], version: int, bucket_bytes: int) -> int:
        """The policy's weights straight to the engines (`tensor` or `distributed`); tensors sent."""
        return self._call("push_weights", method, engine_urls, version, bucket_bytes)[0]

    def host_weight_group(self) -> int:
        """Rank 0 starts hosting the engines' broadcast group on its node (`master_addr`), on a
        port the OS picks and rank 0 holds; that port (then `async_init_weight_group`)."""
        (port,) = self.wait(
            [self.actors[0].call.remote("host_weight_group", self.master_addr)], "host_weight_group()"
        )
        return port

    def async_init_weight_group(self, master_address: str, master_port: int, world_size: int, backend: str):
        """Rank 0 starts hosting the engines' broadcast group; Ray refs (they resolve once all
        joined: pass them to `wait`)."""
        return [
            a.call.remote("init_weight_group", master_address, master_port, world_size, backend)
            for a in self.actors
        ]

    def export_weights(self, out_dir: str) -> str:
        return self._call("export_weights", out_dir)[0]

    def export_adapter(self, out_dir: str) -> str:
        return self._call("export_adapter", out_dir)[0]

    def save(self, ckpt_dir: str) -> None:
        self._call("save", ckpt_dir)

    def load(self, ckpt_dir: str) -> None:
        self._call("load", ckpt_dir)

    def shutdown(self) -> None:
        """Leave the process groups cleanly (a broken group is only killed), then end the actors;
        inside `rlx.actor_reuse.keep_actors`, hand the ones placed without GPUs back instead."""
        if actor_reuse.keeping(self.options):
            actors = self.release()
            actor_reuse.hand_back("trainer", self.options[: len(actors)], actors)
            return
        try:
            self._leave_groups()
        finally:
            self._kill()

    def release(self) -> list:
        """Like `shutdown`, every rank leaves its process groups, but the rank processes are handed
        back, for another group (`rlx.actor_reuse.keep_actors`) to set up again without starting processes (seconds
        each: the Megatron import); a group that broke or never set up ends them and hands back none."""
        if not self._started or self._broken:
            self._kill()
            return []
        try:
            self._leave_groups()
        except BaseException:
            self._kill()
            raise
        actors, self.actors, self._started = self.actors, [], False  # no longer this group's
        return actors

    def _leave_groups(self) -> None:
        if self._started and not self._broken:  # ranks never set up have no groups to leave
            self.wait(
                [a.shutdown.remote() for a in self.actors],
                "shutdown()",
                min(SHUTDOWN_TIMEOUT_S, self.call_timeout_s),
            )

    def _kill(self) -> None:
        for a in self.actors:
            actor_reuse.kill_quietly(a)
