"""The driver's side of a weight sync: the trainer's new weights reach every engine as `version`,
by the path `rollout.weight_sync` names (see `rlx.weight_sync`'s docstring), and every engine is
checked to serve that version afterwards."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from rlx.cluster import ClusterConfig
from rlx.rollout.config import RolloutConfig

log = logging.getLogger(__name__)


def choose_method(rollout: RolloutConfig, cluster: ClusterConfig) -> str:
    """`rollout.weight_sync`, with `auto` resolved: tensor when colocated, distributed on split
    GPUs, disk on CPU (the safe default where /dev/shm may be small)."""
    if rollout.weight_sync != "auto":
        return rollout.weight_sync
    if cluster.colocate:
        return "tensor"
    return "distributed" if cluster.gpus_per_node > 0 else "disk"


PUSH_ATTEMPTS = 3  # with fault tolerance: a push that failed because an engine died, tried again


class WeightPublisher:
    """Publishes the trainer's weights to the pool's engines; `__call__(version)` -> seconds.

    With `rollout.fault_tolerance` a pushed update (tensor, distributed) goes to the engines in
    rotation and those restarted and waiting for it; the broadcast group is formed again whenever
    those are other engines than the group's (one was restarted, or is being restarted), and a
    push that failed because an engine died meanwhile is tried again without it."""

    def __init__(self, trainer, pool, *, method: str, backend: str, bucket_bytes: int, disk_root: Path):
        self.trainer, self.pool, self.method, self.backend = trainer, pool, method, backend
        self.bucket_bytes, self.disk_root = bucket_bytes, disk_root
        self._previous: Path | None = None  # the last disk version, deleted once the next is loaded
        self._members: dict[int, str] = {}  # the broadcast group's engines (index -> URL), in rank order

    def __call__(self, version: int) -> float:
        start = time.perf_counter()
        if self.method == "disk":
            self._by_disk(version)
        else:
            self._push(version)
            self.pool.check_version(version)
        return time.perf_counter() - start

    def _push(self, version: int) -> None:
        tolerant = self.pool.health is not None
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            targets = {i: self.pool.engine_urls[i] for i in self.pool.weight_targets()}
            if not targets:
                raise RuntimeError(
                    f"no engine to publish version {version} to: {self.pool.health.describe()}"
                )
            try:
                if self.method == "distributed":
                    if targets != self._members:
                        self._form_group(targets)
                    urls = list(targets.values())
                else:  # tensor: rank r serves engines r, r + R, ... by index; "" skips one
                    urls = [targets.get(i, "") for i in range(len(self.pool.engine_urls))]
                self.trainer.push_weights(self.method, urls, version, self.bucket_bytes)
                return
            except Exception as e:
                if not tolerant or attempt == PUSH_ATTEMPTS:
                    raise
                self.pool.probe_engines()
                now = {i: self.pool.engine_urls[i] for i in self.pool.weight_targets()}
                lost = [url for i, url in targets.items() if now.get(i) != url]
                if not lost:
                    raise  # no engine failed: the push itself did
                log.warning("weight push %d failed (%r) as engines %s failed; trying again without them",
                            version, e, lost)  # fmt: skip

    def _by_disk(self, version: int) -> None:
        path = self.disk_root / f"v{version:06d}"
        self.pool.update_weights(self.trainer.export_weights(str(path)), version)
        if self._previous is not None:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = path

    def _form_group(self, engines: dict[int, str]) -> None:
        """Trainer rank 0 and `engines` join one broadcast group, all at once (the members of the
        previous one, if any, leave it first); rank 0 hosts it on its own node's address, which
        the engines reach from theirs."""
        staying = [i for i, url in self._members.items() if engines.get(i) == url]
        self._members = {}
        if staying:
            self.pool.leave_weight_group(staying)
        address, port = self.trainer.master_addr, self.trainer.free_port()
        world_size = 1 + len(engines)
        trainer_joins = self.trainer.async_init_weight_group(address, port, world_size, self.backend)
        self.pool.join_weight_group(address, port, self.backend, list(engines))
        self.trainer.wait(trainer_joins, "init_weight_group()")
        self._members = dict(engines)

    def close(self) -> None:
        shutil.rmtree(self.disk_root, ignore_errors=True)  # transient: only engines read it
