"""A run's engines answer only with the run's API key, on loopback too: every route that changes the
engine (weights, memory, aborts, cache) or runs it refuses a request without the key, or with
another, and changes nothing; with the key it works. Runs, one engine or two behind the router,
go on as before. CPU."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import httpx
import pytest
import torch

from rlx import ports
from rlx.config.compose import compose
from rlx.rollout import keyed_launch
from rlx.rollout.config import RolloutConfig
from rlx.rollout.engine_actor import EngineActor
from rlx.rollout.router import Router
from rlx.rollout.sglang import ServerProcess
from rlx.runtime import run
from rlx.weight_sync.tensor import TensorHandoff

KEY = ports.new_api_key()
PROMPT = [2, 3, 4, 5]
CACHED = list(range(2, 16)) * 3  # 42 tokens: two full KV blocks of 16, cached after a request
NORM = "model.norm.weight"  # the tensor the tensor-path update overwrites
WRONG_HEADERS = ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": KEY}, {"X-Api-Key": KEY})


@pytest.fixture
def engine(tiny_qwen3_dir, monkeypatch):
    """The run's engine as the pool starts it (EngineActor, rollout=local, the run's key), in-process."""
    monkeypatch.delenv(ports.HOST_ENV, raising=False)  # one node: loopback
    actor = EngineActor(RolloutConfig(), str(tiny_qwen3_dir), seed=0, api_key=KEY)
    assert urlsplit(actor.url()).hostname == ports.LOOPBACK
    yield actor.server.server  # the EngineServer
    actor.shutdown()


def state(server) -> dict:
    """What the protected routes could change."""
    engine = server.engine
    return {
        "version": engine.weight_version,
        "norm": engine.model.weight_views()[NORM].clone(),
        "embed": engine.model.weight_views()["model.embed_tokens.weight"].clone(),
        "released": set(engine._released),
        "cached": dict(engine.blocks.cached),
        "served": server.scheduler.num_requests_total,
        "receiver": getattr(server.app.state, "weight_receiver", None),
    }


def assert_same(before: dict, after: dict) -> None:
    for name, value in before.items():
        same = torch.equal(value, after[name]) if isinstance(value, torch.Tensor) else value == after[name]
        assert same, name


def refused(http: httpx.Client, method: str, path: str, body: dict | None = None) -> None:
    for headers in WRONG_HEADERS:
        reply = http.request(method, path, json=body, headers=headers)
        assert reply.status_code == 401, (method, path, headers, reply.text)
        assert reply.json() == {"error": {"message": "Unauthorized"}}


def test_state_changing_routes_need_the_run_key_on_loopback(engine, tiny_qwen3_factory):
    other_dir = str(tiny_qwen3_factory(1))
    new_norm = [(NORM, torch.full_like(engine.engine.model.weight_views()[NORM], 0.5))]
    group = {"master_address": ports.LOOPBACK, "master_port": ports.free_port(), "rank_offset": 1,
             "world_size": 2, "backend": "gloo"}  # fmt: skip
    keyed = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=engine.url, timeout=60) as http, TensorHandoff(new_norm) as payload:
        generate = {"input_ids": CACHED, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
        assert http.post("/generate", json=generate, headers=keyed).status_code == 200  # caches a prefix
        protected = [
            ("POST", "/generate", generate),
            ("GET", "/health_generate", None),
            ("POST", "/update_weights_from_disk", {"model_path": other_dir, "weight_version": "9"}),
            ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": [payload], "weight_version": "9"}),
            ("POST", "/init_weights_update_group", group),
            ("POST", "/update_weights_from_distributed", {"names": [NORM], "dtypes": ["float32"], "shapes": [[64]]}),
            ("POST", "/destroy_weights_update_group", {}),
            ("POST", "/update_weight_version", {"new_version": "9"}),
            ("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}),
            ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}),
            ("POST", "/abort_request", {"abort_all": True}),
            ("POST", "/flush_cache", None),
            ("GET", "/get_server_info", None),  # read-only, but SGLang's key covers it too
        ]  # fmt: skip
        before = state(engine)
        assert before["cached"] and before["served"] == 1
        for method, path, body in protected:
            refused(http, method, path, body)
        assert_same(before, state(engine))
        assert http.get("/health").status_code == 200  # sglang-router's liveness probe sends no key

        # With the key each one works (the group routes: test_weight_paths.py, with a trainer).
        def post(path: str, body: dict | None = None) -> httpx.Response:
            reply = http.post(path, json=body, headers=keyed)
            assert reply.status_code == 200, (path, reply.text)
            return reply

        post("/flush_cache")
        assert not engine.engine.blocks.cached
        post("/release_memory_occupation", {"tags": ["kv_cache"]})
        assert engine.engine._released == {"kv_cache"}
        refused(http, "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert engine.engine._released == {"kv_cache"}  # still released
        post("/resume_memory_occupation", {"tags": ["kv_cache"]})
        assert engine.engine._released == set()
        post("/update_weights_from_tensor", {"serialized_named_tensors": [payload], "weight_version": "3"})
        assert torch.equal(engine.engine.model.weight_views()[NORM], new_norm[0][1])
        post("/update_weights_from_disk", {"model_path": other_dir, "weight_version": "4"})
        assert not torch.equal(
            engine.engine.model.weight_views()["model.embed_tokens.weight"], before["embed"]
        )
        post("/update_weight_version", {"new_version": "5"})
        assert http.get("/get_weight_version", headers=keyed).json() == {"weight_version": "5"}
        post("/destroy_weights_update_group", {})
        assert post("/generate", generate).json()["meta_info"]["weight_version"] == "5"


def test_abort_needs_the_run_key(engine):
    """A request in flight goes on through a keyless abort, and stops at one with the key."""
    scheduler, step = engine.scheduler, engine.engine.step

    def slow_step():  # 20 ms a token: the abort lands mid-generation
        time.sleep(0.02)
        return step()

    engine.engine.step = slow_step
    keyed = {"Authorization": f"Bearer {KEY}"}
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}

    def abort_mid_generation(http: httpx.Client, headers: dict) -> tuple[int, str]:
        """(the abort's status, the request's finish reason)."""
        result = {}
        thread = threading.Thread(
            target=lambda: result.update(http.post("/generate", json=long, headers=keyed).json())
        )
        thread.start()
        deadline = time.monotonic() + 30
        while scheduler.num_running == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        status = http.post("/abort_request", json={"abort_all": True}, headers=headers).status_code
        thread.join()
        return status, result["meta_info"]["finish_reason"]["type"]

    with httpx.Client(base_url=engine.url, timeout=60) as http:
        for headers in WRONG_HEADERS:
            assert abort_mid_generation(http, headers) == (401, "length")
        assert abort_mid_generation(http, keyed) == (200, "abort")


def test_child_servers_and_the_router_take_the_key_from_their_environment_not_their_command_line(
    tiny_qwen3_dir, monkeypatch
):
    """rollout=sglang's path (SGLang's CLI, rlx's engine as the module) and sglang-router: a command
    line is every local user's to read (`ps`), so the key must not be on it."""
    keyed = {"Authorization": f"Bearer {KEY}"}
    generate = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    server = ServerProcess(
        str(tiny_qwen3_dir), engine_args={"random_seed": 0}, module="rlx.engine.serve",
        startup_timeout_s=120, api_key=KEY,
    )  # fmt: skip
    with server, Router([server.url], api_key=KEY) as router:
        assert "rlx.rollout.keyed_launch" in router.cmd and KEY not in " ".join(router.cmd)
        for pid in (server.pid, router._child.proc.pid):  # the router renames itself (setproctitle)
            assert KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"rlx.rollout.keyed_launch" in Path(f"/proc/{server.pid}/cmdline").read_bytes()
        for url in (server.url, router.url):
            assert httpx.post(url + "/generate", json=generate, timeout=60).status_code == 401
            assert httpx.post(url + "/generate", json=generate, headers=keyed, timeout=60).status_code == 200
    monkeypatch.delenv(ports.API_KEY_ENV, raising=False)  # the launcher takes the key out of its own
    with pytest.raises(
        SystemExit, match="RLX_ENGINE_API_KEY is not set, no key to hand to sglang.launch_server"
    ):
        keyed_launch.main(["sglang.launch_server", "--port", "1"])


PROBED: list[tuple[str, int]] = []
KEYLESS = {"/generate": {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}},
           "/abort_request": {"abort_all": True}, "/update_weights_from_disk": {"model_path": "/nonexistent"}}  # fmt: skip


async def keyless_probe(ctx, sample, sampling_params):
    """rollout.generate_fn: first what any other local process could send the run's engines (or
    router), without the key; then the sample, through the run's client."""
    async with aiohttp.ClientSession() as http:
        for path, body in KEYLESS.items():
            async with http.post(ctx.url + path, json=body) as reply:
                PROBED.append((path, reply.status))
    ctx.append_output(sample, await ctx.generate(sample.tokens, sampling_params))
    return sample


@pytest.mark.parametrize("num_engines", [1, 2], ids=["one-engine", "two-behind-the-router"])
def test_a_run_keys_its_engines_and_router_and_goes_on(tmp_path, num_engines, monkeypatch):
    monkeypatch.delenv(ports.API_KEY_ENV, raising=False)
    PROBED.clear()
    history = run(
        compose(
            [f"run.output_dir={tmp_path}", "run.num_rollout=2", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
             "train.micro_batch_size=4", f"rollout.num_engines={num_engines}", "run.progress=false",
             "run.loggers=[jsonl]", "rollout.generate_fn=test_engine_auth.keyless_probe"]
        )
    )  # fmt: skip
    assert [h["version"] for h in history] == [1, 2]  # trained, weights pushed with the key, served
    assert all(h["rollout/failed_frac"] == 0.0 for h in history)
    assert history[1]["train/logprob_abs_diff"] <= 1e-5  # the engines loaded the trainer's weights
    # the router answers a keyless /generate itself; of the engine-only routes it may know none (404)
    wanted = {path: {401} if num_engines == 1 or path == "/generate" else {401, 404} for path in KEYLESS}
    assert PROBED and all(status in wanted[path] for path, status in PROBED), PROBED
    assert ports.API_KEY_ENV not in os.environ  # the key lived as long as the run
