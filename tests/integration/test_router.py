"""Two local engines behind the real sglang-router (a child process), all on loopback."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from rlx.engine.local import LocalEngine
from rlx.engine.serve import EngineServer
from rlx.rollout.client import EngineClient
from rlx.rollout.router import Router
from rlx.rollout.sglang import cli_flags


@pytest.fixture(scope="module")
def engines(tiny_qwen3_dir):
    servers = [EngineServer(LocalEngine(str(tiny_qwen3_dir), seed=i)).start() for i in range(2)]
    yield servers
    for server in servers:
        server.stop()


def num_served(url: str) -> int:
    info = httpx.get(url + "/get_server_info", timeout=10).json()
    return info["internal_states"][0]["num_requests_total"]


def test_requests_through_router_reach_both_engines(engines):
    before = [num_served(s.url) for s in engines]
    router = Router([s.url for s in engines], policy="round_robin")
    with router:
        assert httpx.get(router.url + "/health", timeout=10).status_code == 200

        async def drive():
            async with EngineClient(router.url) as client:
                return await asyncio.gather(
                    *(
                        client.generate(
                            [2 + i % 10, 3, 4], {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}
                        )
                        for i in range(16)
                    )
                )

        outputs = asyncio.run(drive())
        pid = router._child.proc.pid
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 4} for o in outputs)
    assert all(len(o["meta_info"]["output_token_logprobs"]) == 4 for o in outputs)
    served = [num_served(s.url) - b for s, b in zip(engines, before, strict=True)]
    assert sum(served) == 16 and min(served) > 0, served
    assert not router.running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # terminated and reaped


def test_router_start_failure_shows_its_output(engines):
    router = Router([engines[0].url], extra_args={"no_such_router_flag": 1}, startup_timeout_s=30)
    with pytest.raises(RuntimeError, match="unrecognized arguments"):
        router.start()
    assert not router.running()


def test_extra_router_args_become_flags(engines):
    router = Router(
        [s.url for s in engines],
        port=31234,
        policy="cache_aware",
        extra_args={
            "cache_threshold": 0.3,
            "disable_retries": True,
            "dp_aware": False,
            "request_id_headers": ["x-a", "x-b"],
        },
    )
    flags = router.cmd[router.cmd.index("sglang_router.launch_router") + 1 :]
    assert flags == [
        "--host",
        "127.0.0.1",
        "--port",
        "31234",
        "--worker-urls",
        engines[0].url,
        engines[1].url,
        "--policy",
        "cache_aware",
        "--log-level",
        "warn",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        flags[flags.index("--prometheus-port") + 1],  # a free one
        "--cache-threshold",
        "0.3",
        "--disable-retries",
        "--request-id-headers",
        "x-a",
        "x-b",
    ]
    assert cli_flags({"a_b": None, "c": False}) == []
    with pytest.raises(ValueError):
        Router([engines[0].url], extra_args={"worker_urls": ["x"]})
    manual = Router([engines[0].url], extra_args={"policy": "manual"})  # rollout.router_args.policy
    assert manual.cmd[manual.cmd.index("--policy") + 1] == "manual"


def test_the_readiness_probe_waits_through_answers_that_are_not_the_worker_list():
    """In a run of the suite the router answered /workers with 200 and an empty body: the probe
    must keep waiting (not raise), and be done once every worker is listed healthy."""
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    bodies = iter(
        [b"", b"<html>", b'{"other": 1}', b'{"workers": [{"url": "http://127.0.0.1:1", "is_healthy": true}]}']
    )
    listed = b'{"workers": [{"url": "http://127.0.0.1:1/", "is_healthy": true}, {"url": "http://127.0.0.1:2", "is_healthy": true}]}'

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, content=next(bodies, listed))

    router = Router(urls)
    with httpx.Client(transport=httpx.MockTransport(answer)) as http:
        waits = [router._all_registered(http) for _ in range(5)]
    assert waits == [False, False, False, False, True]
    assert router._missing == []
