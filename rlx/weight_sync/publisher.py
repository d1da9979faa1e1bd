"""The driver's side of a weight sync: the trainer's new weights reach every engine as `version`,
by the path `rollout.weight_sync` names (see `rlx.weight_sync`'s docstring), and every engine is
checked to serve that version afterwards."""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from rlx.cluster import ClusterConfig
from rlx.rollout.config import RolloutConfig
from rlx.rollout.launchers import flat_tensor_buckets

log = logging.getLogger(__name__)


def choose_method(rollout: RolloutConfig, cluster: ClusterConfig) -> str:
    """`rollout.weight_sync`, with `auto` resolved: tensor when colocated, distributed on split
    GPUs, disk on CPU (the safe default where /dev/shm may be small)."""
    if rollout.weight_sync != "auto":
        return rollout.weight_sync
    if cluster.colocate:
        return "tensor"
    return "distributed" if cluster.gpus_per_node > 0 else "disk"


CLOSE_TIMEOUT_S = 60.0  # at most, a background load finishing at shutdown
PUSH_ATTEMPTS = 3  # with fault tolerance: a push that failed because an engine died, tried again


class WeightPublisher:
    """Publishes the trainer's weights to the pool's engines; `__call__(version)` -> the seconds
    the trainer waited. `on_served(version)` is called once the engines serve it.

    `overlap` (async mode, disk): the engines load a version in the background while the trainer
    goes on with its next step; the trainer waits only for the export. The next publish, an
    evaluation (`wait`) or the end of the run waits for that load first, so versions are served in
    order and one failed load stops the run.

    With `rollout.fault_tolerance` a pushed update (tensor, distributed) goes to the engines in
    rotation and those restarted and waiting for it; the broadcast group is formed again whenever
    those are other engines than the group's (one was restarted, or is being restarted), and a
    push that failed because an engine died meanwhile is tried again without it."""

    def __init__(
        self,
        trainer,
        pool,
        *,
        method: str,
        backend: str,
        bucket_bytes: int,
        disk_root: Path,
        overlap: bool = False,
    ):
        self.trainer, self.pool, self.method, self.backend = trainer, pool, method, backend
        # tensor: one flat buffer a bucket where the engines read that form (rlx's), else one
        # CUDA IPC handle a tensor (SGLang's)
        self.push_method = "tensor_flat" if method == "tensor" and flat_tensor_buckets(pool.cfg) else method
        self.bucket_bytes, self.disk_root = bucket_bytes, disk_root
        self.overlap = overlap and method == "disk"
        self.on_served: Callable[[int], None] = lambda version: None
        self._previous: Path | None = None  # the last disk version, deleted once the next is loaded
        self._members: dict[int, str] = {}  # the broadcast group's engines (index -> URL), in rank order
        self._loading: tuple[Path, Future] | None = None  # overlap: the directory loading, its load
        self._load_s: float | None = None  # overlap: how long the last finished load took

    def __call__(self, version: int) -> float:
        start = time.perf_counter()
        if self.method == "disk":
            self._by_disk(version)
        else:
            self._push(version)
            self.pool.check_version(version)
            self.on_served(version)
        return time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """overlap: `time/weight_load_overlapped_s`, the last finished background load's time."""
        load_s, self._load_s = self._load_s, None
        return {} if load_s is None else {"time/weight_load_overlapped_s": load_s}

    def wait(self) -> None:
        """Until the engines serve the last published version (overlap); its error, if it failed."""
        if self._loading is None:
            return
        path, load = self._loading
        self._loading = None
        load.result()
        self._replace_previous(path)

    def _by_disk(self, version: int) -> None:
        self.wait()  # versions load in order
        path = Path(self.trainer.export_weights(str(self.disk_root / f"v{version:06d}")))
        if self.overlap:  # the producer is told by the load's callback
            self._loading = (path, self._load_in_background(path, version))
            return
        self.pool.update_weights(str(path), version)
        self._replace_previous(path)
        self.on_served(version)

    def _load_in_background(self, path: Path, version: int) -> Future:
        start = time.perf_counter()
        load = self.pool.update_weights_in_background(str(path), version)

        def done(load: Future) -> None:  # on the pool's thread, once the engines serve `version`
            self._load_s = time.perf_counter() - start
            if load.exception() is None:
                self.on_served(version)  # the producer learns of it now, not at the next wait

        load.add_done_callback(done)
        return load

    def _replace_previous(self, path: Path) -> None:
        """`path` is served now: the directory before it goes."""
        if self._previous is not None:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = path

    def _push(self, version: int) -> None:
        tolerant = self.pool.health is not None
        for attempt in range(1, PUSH_ATTEMPTS + 1):
            targets = {i: self.pool.engines.urls[i] for i in self.pool.weight_targets()}
            if not targets:
                raise RuntimeError(
                    f"no engine to publish version {version} to: {self.pool.engines.describe()}"
                )
            try:
                if self.method == "distributed":
                    if targets != self._members:
                        self._form_group(targets)
                    urls = list(targets.values())
                else:  # tensor: rank r serves engines r, r + R, ... by index; "" skips one
                    urls = [targets.get(i, "") for i in range(len(self.pool.engines.urls))]
                self.trainer.push_weights(self.push_method, urls, version, self.bucket_bytes)
                return
            except Exception as e:
                if not tolerant or attempt == PUSH_ATTEMPTS:
                    raise
                self.pool.probe_engines()
                now = {i: self.pool.engines.urls[i] for i in self.pool.weight_targets()}
                lost = [url for i, url in targets.items() if now.get(i) != url]
                if not lost:
                    raise  # no engine failed: the push itself did
                log.warning("weight push %d failed (%r) as engines %s failed; trying again without them",
                            version, e, lost)  # fmt: skip

    def _form_group(self, engines: dict[int, str]) -> None:
        """Trainer rank 0 and `engines` join one broadcast group, all at once (the members of the
        previous one, if any, leave it first); rank 0 hosts it on its own node's address, which
        the engines reach from theirs."""
        staying = [i for i, url in self._members.items() if engines.get(i) == url]
        self._members = {}
        if staying:
            self.pool.leave_weight_group(staying)
        address, port = self.trainer.master_addr, self.trainer.host_weight_group()
        world_size = 1 + len(engines)
        trainer_joins = self.trainer.async_init_weight_group(address, port, world_size, self.backend)
        self.pool.join_weight_group(address, port, self.backend, list(engines))
        self.trainer.wait(trainer_joins, "init_weight_group()")
        self._members = dict(engines)

    def close(self) -> None:
        """After the run (or its failure): a load still going on is waited for, then the
        directory goes (transient: only engines read it)."""
        if self._loading is not None:
            with contextlib.suppress(Exception):  # the run ends anyway; an error was raised already
                self._loading[1].result(timeout=CLOSE_TIMEOUT_S)
        shutil.rmtree(self.disk_root, ignore_errors=True)
