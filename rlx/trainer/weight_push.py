"""Trainer side of the fast weight paths: HF-named tensors in bounded buckets straight to the
engines, over SGLang's HTTP endpoints (`rlx.engine.serve.weight_routes` serves them in rlx's engine).

    tensor       each rank hands its engines (r, r + R, r + 2R, ...: colocated, the one on its own
                 GPU) CUDA IPC handles, or shared memory on CPU; the engine copies and replies
    distributed  rank 0 broadcasts each bucket to every engine over a NCCL (gloo on CPU) group
                 of its own, announced by one POST per engine and bucket

Every rank iterates the export (a collective over the model-parallel group) whether it sends or not,
and to its end also when a send failed (an engine died: the driver retries without it), so that
no other rank is left waiting in a gather.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch

from rlx.ports import auth_headers
from rlx.weight_sync.buckets import BucketMeta, iter_buckets
from rlx.weight_sync.distributed import WeightSender
from rlx.weight_sync.tensor import TensorHandoff

HTTP_TIMEOUT_S = 600.0  # a bucket of a large model over a slow link; a hang still ends


class WeightPusher:
    """One per trainer rank; each send's `bucket_bytes` bounds the memory a bucket holds on either side."""

    def __init__(self, api_key: str | None = None) -> None:
        """`api_key`: the run's, sent with every request (`Authorization: Bearer KEY`)."""
        self.sender = WeightSender()
        self.http = httpx.Client(timeout=HTTP_TIMEOUT_S, headers=auth_headers(api_key))
        self._posts = ThreadPoolExecutor(max_workers=16)  # announcements go out while we broadcast

    def post(self, url: str, path: str, body: dict[str, Any]) -> None:
        """POST SGLang's weight request; RuntimeError naming the engine unless it succeeded."""
        reply = self.http.post(f"{url}{path}", json=body)
        result = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else {}
        if reply.status_code != 200 or not result.get("success", False):
            raise RuntimeError(f"engine {url}{path} failed: {result.get('message') or reply.text[:300]}")

    def tensor(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        urls: list[str],
        version: int,
        bucket_bytes: int,
        flat: bool = False,
    ) -> int:
        """Hand every bucket to each engine in `urls` ("" for one left out; none: just take part
        in the export); `flat`: as one buffer (`TensorHandoff(flat=True)`: rlx's engines)."""
        urls = [url for url in urls if url]
        named = iter(named)
        num = 0
        with _drained_on_error(named):
            for bucket in iter_buckets(named, bucket_bytes):
                num += len(bucket)
                if not urls:
                    continue
                with TensorHandoff(bucket, flat=flat) as payload:  # held until every engine has copied it
                    body = {
                        "serialized_named_tensors": [payload],
                        "load_format": None,
                        "weight_version": str(version),
                    }
                    for url in urls:
                        self.post(url, "/update_weights_from_tensor", body)
        return num

    def host_group(self, master_address: str) -> int:
        """Rank 0 starts hosting the next broadcast group's store; its port (picked by the OS)."""
        return self.sender.host(master_address)

    def init_group(self, master_address: str, master_port: int, world_size: int, backend: str) -> None:
        """Rank 0 hosts the broadcast group (blocks until every engine has joined), in place of
        the one it hosted before, if any (formed again after an engine was restarted)."""
        self.sender.close()
        self.sender.init(master_address, master_port, world_size, backend)

    def distributed(
        self, named: Iterable[tuple[str, torch.Tensor]], urls: list[str], version: int, bucket_bytes: int
    ) -> int:
        """Rank 0: broadcast every bucket to the engines at `urls` (ranks 1..N of the group, in
        that order), announcing each first. A failed send leaves the group (see `_left_on_error`)."""
        named = iter(named)
        with _drained_on_error(named), _left_on_error(self.sender):
            metas = self.sender.send(named, bucket_bytes, announce=self._announcer(urls, version))
        return sum(len(meta.specs) for meta in metas)

    def _announcer(self, urls: list[str], version: int) -> Callable[[BucketMeta], Callable[[], None]]:
        def announce(meta: BucketMeta) -> Callable[[], None]:
            body = {**meta.to_fields(), "load_format": "flattened_bucket", "weight_version": str(version)}
            futures = [
                self._posts.submit(self.post, url, "/update_weights_from_distributed", body) for url in urls
            ]
            return lambda: [f.result() for f in futures]

        return announce

    def close(self) -> None:
        self.sender.close()
        self.http.close()
        self._posts.shutdown(wait=False)


@contextlib.contextmanager
def _left_on_error(sender: WeightSender):
    """On an error, rank 0 leaves the broadcast group before raising. A broadcast that failed on
    a dead engine may never have reached a live one, whose receive would wait out the group's
    timeout (300 s), and the driver's `leave_weight_group` with it (an engine's group is destroyed
    only once its receive returns); with rank 0 gone it fails at once. The driver forms the group
    again, without the dead engine, before the next push."""
    try:
        yield
    except BaseException:
        sender.close()
        raise


@contextlib.contextmanager
def _drained_on_error(named: Iterator):
    """On an error, iterate what is left of the export (the other ranks' gathers) before raising."""
    try:
        yield
    except BaseException:
        for _ in named:
            pass
        raise
