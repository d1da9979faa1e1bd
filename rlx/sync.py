"""The driver's side of a weight sync: the trainer's new weights reach every engine as `version`,
by the path `rollout.weight_sync` names (see `rlx.weight_sync`'s docstring), and every engine is
checked to serve that version afterwards."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from rlx.cluster import ClusterConfig
from rlx.rollout.config import RolloutConfig


def choose_method(rollout: RolloutConfig, cluster: ClusterConfig) -> str:
    """`rollout.weight_sync`, with `auto` resolved: tensor when colocated, distributed on split
    GPUs, disk on CPU (the safe default where /dev/shm may be small)."""
    if rollout.weight_sync != "auto":
        return rollout.weight_sync
    if cluster.colocate:
        return "tensor"
    return "distributed" if cluster.gpus_per_node > 0 else "disk"


class WeightPublisher:
    """Publishes the trainer's weights to the pool's engines; `__call__(version)` -> seconds."""

    def __init__(self, trainer, pool, *, method: str, backend: str, bucket_bytes: int, disk_root: Path):
        self.trainer, self.pool, self.method, self.backend = trainer, pool, method, backend
        self.bucket_bytes, self.disk_root = bucket_bytes, disk_root
        self._previous: Path | None = None  # the last disk version, deleted once the next is loaded
        self._group_ready = False

    def __call__(self, version: int) -> float:
        start = time.perf_counter()
        if self.method == "disk":
            self._by_disk(version)
        else:
            if self.method == "distributed" and not self._group_ready:
                self._form_group()
            self.trainer.push_weights(self.method, self.pool.engine_urls, version, self.bucket_bytes)
            self.pool.check_version(version)
        return time.perf_counter() - start

    def _by_disk(self, version: int) -> None:
        path = self.disk_root / f"v{version:06d}"
        self.pool.update_weights(self.trainer.export_weights(str(path)), version)
        if self._previous is not None:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = path

    def _form_group(self) -> None:
        """Trainer rank 0 and every engine join one broadcast group, all at once; rank 0 hosts it
        on its own node's address, which the engines reach from theirs."""
        address, port = self.trainer.master_addr, self.trainer.free_port()
        world_size = 1 + len(self.pool.engine_urls)
        trainer_joins = self.trainer.async_init_weight_group(address, port, world_size, self.backend)
        self.pool.join_weight_group(address, port, self.backend)
        self.trainer.wait(trainer_joins, "init_weight_group()")
        self._group_ready = True

    def close(self) -> None:
        shutil.rmtree(self.disk_root, ignore_errors=True)  # transient: only engines read it
