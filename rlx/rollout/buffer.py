"""The rollout buffer between the engines and the trainer: finished groups waiting to be trained
(first in, first out, each with the policy versions that generated it) and unfinished groups
carried over to the next batch (partial rollouts, over-sampled groups aborted when their batch
was full). Its `state_dict` holds both, so a resumed run continues with exactly what was pending.

Thread-safe: the producer puts from the rollout thread while the trainer's thread takes.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from rlx.sample import Sample


class RolloutBuffer:
    """Ready groups (FIFO) and carried-over groups (FIFO), with staleness checked on the way out."""

    def __init__(self) -> None:
        self._ready: deque[list[Sample]] = deque()
        self._carried: deque[list[Sample]] = deque()
        self._cond = threading.Condition()
        self.groups_in = 0  # groups ever put as ready (the producer paces on it)

    # ---- producer side -----------------------------------------------------------------------

    def put(self, group: list[Sample]) -> None:
        """A finished, kept group, ready to train on."""
        with self._cond:
            self._ready.append(group)
            self.groups_in += 1
            self._cond.notify_all()

    def carry(self, group: list[Sample]) -> None:
        """An unfinished group to continue (or restart) before any new prompt."""
        with self._cond:
            self._carried.append(group)

    def next_carried(self) -> list[Sample] | None:
        with self._cond:
            return self._carried.popleft() if self._carried else None

    def num_ready(self) -> int:
        with self._cond:
            return len(self._ready)

    # ---- trainer side ------------------------------------------------------------------------

    def take(
        self, num_groups: int, train_version: int, max_staleness: int | None, timeout_s: float | None = None
    ) -> tuple[list[list[Sample]], int]:
        """The first `num_groups` ready groups none of whose samples lags `train_version` by more
        than `max_staleness` versions (None: no limit), waiting for them; and how many samples
        were dropped for being too old on the way. TimeoutError after `timeout_s`."""
        taken: list[list[Sample]] = []
        dropped = 0
        with self._cond:
            while len(taken) < num_groups:
                if not self._ready:
                    if not self._cond.wait(timeout_s):
                        raise TimeoutError(
                            f"no rollout group became ready within {timeout_s} s "
                            f"({len(taken)} of {num_groups} taken)"
                        )
                    continue
                group = self._ready.popleft()
                if (
                    max_staleness is not None
                    and train_version - min(s.version for s in group) > max_staleness
                ):
                    dropped += len(group)
                    self._cond.notify_all()  # the producer may be waiting for room
                    continue
                taken.append(group)
            self._cond.notify_all()
        return taken, dropped

    def wait_for_room(self, max_ready: int, stop: threading.Event) -> None:
        """Block until fewer than `max_ready` groups are ready (or `stop` is set)."""
        with self._cond:
            while len(self._ready) >= max_ready and not stop.is_set():
                self._cond.wait(0.1)

    # ---- checkpoint --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        with self._cond:
            return {
                "ready": [[s.to_json() for s in g] for g in self._ready],
                "carried": [[s.to_json() for s in g] for g in self._carried],
                "groups_in": self.groups_in,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cond:
            self._ready = deque([Sample.from_json(r) for r in g] for g in state["ready"])
            self._carried = deque([Sample.from_json(r) for r in g] for g in state["carried"])
            self.groups_in = state["groups_in"]
