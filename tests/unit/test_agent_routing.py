"""Session affinity through the real sglang-router (0.3.2): under `--policy manual`, every turn of a
conversation (same `X-SMG-Routing-Key`, sent by rlx.agent's model turns) reaches one worker, and
different conversations spread over the workers; round robin ignores the key. Each router gets its
own metrics port (its default, 29000, is taken by any other router running on the machine). Two minimal
SGLang-API workers on loopback stand in for engines; CPU, a few seconds."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest
from aiohttp import web

from rlx.agent.turns import ROUTING_KEY_HEADER, generate_in_session
from rlx.ports import free_port
from rlx.rollout.client import EngineClient
from rlx.rollout.router import Router


class Worker:
    """Answers the router's start-up probes and /generate (naming itself), in a thread."""

    def __init__(self, name: str, info_delay_s: float = 0.0):
        self.name, self.keys, self.info_delay_s = name, Counter(), info_delay_s
        self.loop = asyncio.new_event_loop()
        app = web.Application()
        info = {"model_path": "scripted", "tokenizer_path": None, "is_generation": True}

        async def answer(_request, body=info):
            await asyncio.sleep(self.info_delay_s)  # a slow engine: the router registers it late
            return web.json_response(body)

        app.router.add_get("/health", lambda _, body=info: web.json_response(body))
        for path in ("/model_info", "/get_model_info", "/server_info", "/get_server_info"):
            app.router.add_get(path, answer)
        app.router.add_post("/generate", self.generate)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    async def generate(self, request: web.Request) -> web.Response:
        self.keys[request.headers.get(ROUTING_KEY_HEADER)] += 1
        meta = {"output_token_logprobs": [[-0.1, 2, None]], "finish_reason": {"type": "stop"}}
        return web.json_response({"worker": self.name, "output_ids": [2], "meta_info": meta})

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def workers():
    pair = [Worker("a"), Worker("b")]
    yield pair
    for w in pair:
        w.stop()


class Ctx:
    """The part of GenerateContext a session uses: `generate` through a real EngineClient."""

    def __init__(self, url: str):
        self.client = EngineClient(url)

    async def generate(self, input_ids, params, **kwargs):
        return await self.client.generate(input_ids, params, **kwargs)


def conversations(url: str, num_sessions: int, num_turns: int) -> dict[str, list[str]]:
    """session -> the worker that answered each of its turns (turns in order, sessions at once)."""

    async def session(ctx, key: str) -> list[str]:
        return [
            (await generate_in_session(ctx, [2, 3], {"max_new_tokens": 1}, key))["worker"]
            for _ in range(num_turns)
        ]

    async def drive():
        ctx = Ctx(url)
        keys = [f"s{i}" for i in range(num_sessions)]
        try:
            return dict(zip(keys, await asyncio.gather(*(session(ctx, k) for k in keys)), strict=True))
        finally:
            await ctx.client._http().close()

    return asyncio.run(drive())


def test_manual_policy_keeps_each_conversation_on_one_worker(workers):
    args = {"assignment_mode": "min_group", "prometheus_port": free_port()}
    router = Router([w.url for w in workers], policy="manual", extra_args=args)
    with router:
        served = conversations(router.url, num_sessions=8, num_turns=4)
    assert all(len(set(turns)) == 1 for turns in served.values()), served  # every turn on one worker
    # min_group gives a new key to the worker holding fewer keys: the sessions use both workers
    assert set(Counter(turns[0] for turns in served.values())) == {"a", "b"}, served


def test_round_robin_ignores_the_key_and_starts_even_when_a_worker_registers_late():
    # "a" answers /server_info a second late: the router answers /health before it has registered
    # "a", and a request sent then went to "b" only (CI saw b, b, a, b). start() waits for both.
    pair = [Worker("a", info_delay_s=1.0), Worker("b")]
    try:
        router = Router(
            [w.url for w in pair], policy="round_robin", extra_args={"prometheus_port": free_port()}
        )
        with router:
            served = conversations(router.url, num_sessions=1, num_turns=4)
    finally:
        for w in pair:
            w.stop()
    assert served["s0"] in (["a", "b", "a", "b"], ["b", "a", "b", "a"])  # the one session alternates


def test_a_worker_that_never_registers_is_named_when_the_router_gives_up(workers):
    dead = f"http://127.0.0.1:{free_port()}"
    router = Router([workers[0].url, dead], startup_timeout_s=10, extra_args={"prometheus_port": free_port()})
    with pytest.raises(TimeoutError, match=f"did not list \\['{dead}'\\] as healthy workers"):
        router.start()
    assert not router.running()  # the router child is stopped, not left behind


def test_a_port_taken_before_the_router_binds_it_is_picked_again(workers, monkeypatch):
    import socket

    import rlx.rollout.router as router_module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    picks = iter([taken_port])  # the first pick is taken by the time the router binds it
    real = router_module.free_port
    monkeypatch.setattr(router_module, "free_port", lambda host: next(picks, None) or real(host))
    router = Router([workers[0].url])
    assert router.port == taken_port
    try:
        with router:
            served = conversations(router.url, num_sessions=1, num_turns=1)
    finally:
        taken.close()
    assert router.port != taken_port  # it serves on a port picked again
    assert served["s0"] == ["a"]
