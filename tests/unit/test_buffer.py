"""The rollout buffer: first in, first out, staleness dropped on the way out, exact state."""

from __future__ import annotations

import json
import threading

import pytest

from rlx.rollout.buffer import RolloutBuffer
from rlx.rollout.producer import _mask_old_tokens, _restart
from rlx.sample import Sample, Status


def _group(tag: int, version: int, n: int = 2) -> list[Sample]:
    return [
        Sample(prompt=f"p{tag}", prompt_ids=[tag], group=tag, index=i, response_ids=[7, 8],
               rollout_logprobs=[-0.5, -0.25], loss_mask=[1, 1], reward=float(i), status=Status.COMPLETED,
               version=version, token_versions=[version, version])
        for i in range(n)
    ]  # fmt: skip


def test_take_is_fifo_and_drops_groups_older_than_the_cap():
    buf = RolloutBuffer()
    for tag, version in [(0, 3), (1, 1), (2, 4), (3, 2), (4, 5)]:
        buf.put(_group(tag, version))
    # trained at version 5 with cap 2: version 3 (lag 2) is kept, 1 (lag 4) and 2 (lag 3) dropped
    groups, dropped = buf.take(3, train_version=5, max_staleness=2)
    assert [g[0].group for g in groups] == [0, 2, 4]
    assert dropped == 4  # two groups of two samples
    assert buf.num_ready() == 0 and buf.groups_in == 5


def test_take_without_cap_keeps_everything_and_times_out_when_short():
    buf = RolloutBuffer()
    buf.put(_group(0, 0))
    groups, dropped = buf.take(1, train_version=9, max_staleness=None)
    assert len(groups) == 1 and dropped == 0
    with pytest.raises(TimeoutError, match="0 of 1 taken"):
        buf.take(1, train_version=9, max_staleness=None, timeout_s=0.05)


def test_take_waits_for_the_producer():
    buf = RolloutBuffer()
    threading.Timer(0.05, buf.put, args=(_group(0, 1),)).start()
    groups, _ = buf.take(1, train_version=1, max_staleness=0, timeout_s=5)
    assert groups[0][0].version == 1


def test_state_dict_round_trips_ready_and_carried_groups_through_json():
    buf = RolloutBuffer()
    buf.put(_group(0, 2))
    partial = _group(1, 1)
    partial[0].status, partial[0].response_ids = Status.ABORTED, [7]
    buf.carry(partial)
    state = json.loads(json.dumps(buf.state_dict()))  # what a checkpoint stores
    other = RolloutBuffer()
    other.load_state_dict(state)
    assert other.groups_in == 1
    assert other.next_carried() == partial
    assert other.take(1, 2, 0)[0] == [_group(0, 2)]


def test_restart_forgets_the_response_and_keeps_the_prompt():
    s = _group(3, 4)[1]
    fresh = _restart(s)
    assert (fresh.prompt_ids, fresh.group, fresh.index) == ([3], 3, 1)
    assert fresh.response_ids == [] and fresh.token_versions == [] and fresh.reward is None
    assert fresh.status is Status.PENDING and fresh.version == -1
    assert s.response_ids == [7, 8]  # the original is untouched


def test_mask_old_tokens_masks_what_an_older_policy_generated():
    s = _group(0, 1)[0]
    s.response_ids, s.loss_mask, s.token_versions = [1, 2, 3, 4], [1, 0, 1, 1], [1, 1, 2, 2]
    assert _mask_old_tokens(s) == 2
    assert s.loss_mask == [0, 0, 1, 1]  # tokens 0-1 came from version 1, the newest is 2
