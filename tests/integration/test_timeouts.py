"""A trainer rank killed or hung ends the call naming the rank, instead of a silent stall (CPU, gloo)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray
from aiohttp import web

from rlx.config.compose import compose, to_object
from rlx.rollout.client import EngineClient, EngineTimeout
from rlx.sample import Sample
from rlx.trainer.group import TrainerGroup, TrainerRankError

# Far above what Ray takes to report a dead process: an error naming the death, not the time
# limit, shows the death was noticed at once.
CALL_TIMEOUT_S = 300


@pytest.fixture
def group(ray_session, tmp_path, monkeypatch):
    """Two CPU trainer ranks (DP=2) of the tiny default model."""
    monkeypatch.setenv("RLX_CACHE", os.environ.get("RLX_CACHE", str(tmp_path / "cache")))
    cfg = to_object(
        compose(
            [
                f"run.output_dir={tmp_path}",
                "rollout.batch_size=2",
                "rollout.n_samples_per_prompt=2",
                "train.micro_batch_size=2",
                "cluster.num_trainer_procs=2",
                f"cluster.trainer_call_timeout_s={CALL_TIMEOUT_S}",
            ]
        )
    )
    group = TrainerGroup(cfg)
    yield group
    group.shutdown()


def _batch() -> list[Sample]:
    return [
        Sample(
            prompt="",
            prompt_ids=[2, 3, 4],
            response_ids=[5, 6],
            rollout_logprobs=[-1.0, -1.0],
            loss_mask=[1, 1],
            reward=float(i % 2),
            group=i // 2,
            index=i % 2,
        )  # fmt: skip
        for i in range(4)
    ]


def _gone(pid: int, within_s: float = 30.0) -> bool:
    """Whether process `pid` has exited (polled up to `within_s`: Ray reaps it asynchronously)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_hung_rank_times_out_and_a_killed_rank_is_named(group):
    # the rendezvous address is the node's as Ray reports it, not a hard-coded loopback
    assert group.master_addr == ray.util.get_node_ip_address()
    assert "train/loss" in group.train(_batch())  # the group works before anything goes wrong

    group.call_timeout_s = 3  # start-up is done: a train step of this batch takes well under 1 s
    os.kill(group.pids[1], signal.SIGSTOP)  # alive, but never answers; rank 0 waits in a collective
    with pytest.raises(
        TrainerRankError, match=r"trainer ranks 0, 1 did not answer train\(\) within 3 s"
    ) as e:
        group.train(_batch())
    assert f"rank 1: pid {group.pids[1]} on " in str(e.value)

    group.call_timeout_s = CALL_TIMEOUT_S
    os.kill(group.pids[1], signal.SIGKILL)
    with pytest.raises(TrainerRankError, match=r"trainer rank 1 \(pid \d+ on [\d.]+\) died during train\(\)"):
        group.train(_batch())
    group.shutdown()  # broken: the survivor is killed, not asked to leave a world that lost a rank
    assert _gone(group.pids[0]) and _gone(group.pids[1])


def test_an_engine_that_never_answers_is_named_with_the_call():
    """A /generate that hangs ends after the client's limit, naming the engine and the call, and
    is not sent again (a hang is not a transient failure)."""
    calls = []

    async def drive():
        release = asyncio.Event()

        async def hang(request):
            calls.append(request.path)
            await release.wait()  # until the test is over
            return web.json_response({})

        app = web.Application()
        app.router.add_post("/generate", hang)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with EngineClient(url, timeout=1.0) as client:
                with pytest.raises(EngineTimeout) as e:
                    await client.generate([2, 3], {"max_new_tokens": 1})
        finally:
            release.set()
            await runner.cleanup()
        return url, str(e.value)

    url, message = asyncio.run(drive())
    assert message == f"{url} did not answer POST /generate within 1 s"
    assert calls == ["/generate"]
