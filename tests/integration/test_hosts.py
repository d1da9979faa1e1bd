"""Nothing assumes one host: across nodes engines bind their node's address, on one node loopback;
either way they require the run's API key, which the router forwards and every client sends.
The multi-node cases run on a Ray whose node has this machine's routable address, as a node of a
multi-node run has (the shared Ray of the other tests is on loopback)."""

from __future__ import annotations

import asyncio
import os
from urllib.parse import urlsplit

import httpx
import pytest
import ray
from helpers import own_ray  # tests/ is on sys.path
from starlette.routing import Route

from rlx import ports
from rlx.cluster import ClusterConfig
from rlx.config.compose import compose
from rlx.engine.local import LocalEngine
from rlx.engine.serve import EngineServer
from rlx.engine.serve.app import ROUTERS
from rlx.engine.serve.generate_routes import GenerateEndpoint
from rlx.errors import ConfigError
from rlx.placement import plan
from rlx.rollout.client import EngineClient, EngineError
from rlx.rollout.config import RolloutConfig
from rlx.rollout.engine_actor import EngineActor
from rlx.rollout.router import Router
from rlx.runtime import run

pytestmark = pytest.mark.own_ray  # a routable Ray of its own, not the shared one (tests/conftest.py)

KEY = "run-key-123"
GENERATE = {"input_ids": [2, 3, 4], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}


@pytest.fixture(scope="module")
def keyed_server(tiny_qwen3_dir):
    server = EngineServer(LocalEngine(str(tiny_qwen3_dir), seed=0), api_key=KEY).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def routable_ray():
    """A Ray whose node address is this machine's routable one (not loopback), without a token:
    RAY_AUTH_MODE=disabled for its start, since Ray 2.60 turns token authentication on for a new
    local Ray where the variable is unset (and writes ~/.ray/auth_token). Unset, the module's tests
    passed only after another module's run had set it (`rlx.launcher.ray_start.start_local`)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")
        with own_ray(loopback=False, num_cpus=2):
            yield


@pytest.fixture
def no_run_key(monkeypatch):
    monkeypatch.delenv(ports.API_KEY_ENV, raising=False)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_engine_server_requires_the_key_on_every_route_but_health(keyed_server):
    url = keyed_server.url
    # SGLang's native API, the weight routes and FastAPI's own (/docs, /openapi.json)
    every = [*(route for router in ROUTERS for route in router.routes), *keyed_server.app.routes]
    routes = [(m, r.path) for r in every if isinstance(r, Route) for m in r.methods]
    routes += [(m, "/generate") for m in GenerateEndpoint.METHODS]  # plain ASGI, ahead of the routes
    assert len({path for _, path in routes}) >= 20 and ("POST", "/update_weights_from_tensor") in routes
    with httpx.Client(timeout=30) as http:
        for method, path in routes:
            if path == "/health":
                continue
            for headers in ({}, bearer("wrong-key"), {"Authorization": KEY}):
                reply = http.request(method, url + path, headers=headers, json={})
                assert reply.status_code == 401, (method, path, headers)
                if method != "HEAD":  # a HEAD answer has no body
                    assert reply.json() == {"error": {"message": "Unauthorized"}}
        # sglang-router probes liveness without the key, as SGLang allows
        assert http.get(url + "/health").status_code == 200
        assert http.get(url + "/get_model_info", headers=bearer(KEY)).status_code == 200
        reply = http.post(url + "/generate", headers=bearer(KEY), json=GENERATE)
        assert reply.status_code == 200 and len(reply.json()["output_ids"]) == 2


def test_client_sends_the_key_and_names_a_missing_one(keyed_server, no_run_key):
    async def drive():
        async with EngineClient(keyed_server.url, api_key=KEY) as client:
            out = await client.generate([2, 3], {"max_new_tokens": 3, "ignore_eos": True})
        async with EngineClient(keyed_server.url) as keyless:
            with pytest.raises(EngineError, match=f"answered 401.*{ports.API_KEY_ENV} unset") as e:
                await keyless.get_weight_version()
        return out, e.value.status_code

    out, status = asyncio.run(drive())
    assert len(out["output_ids"]) == 3 and status == 401


def test_router_requires_and_forwards_the_key(keyed_server, no_run_key):
    with Router([keyed_server.url], api_key=KEY) as router:
        assert httpx.post(router.url + "/generate", json=GENERATE, timeout=30).status_code == 401
        assert (
            httpx.post(router.url + "/generate", json=GENERATE, headers=bearer("x"), timeout=30).status_code
            == 401
        )

        async def drive():
            async with EngineClient(router.url, api_key=KEY) as client:
                return await client.generate([2, 3], {"max_new_tokens": 3, "ignore_eos": True})

        # the router passed the key on: the engine refuses anything without it
        assert len(asyncio.run(drive())["output_ids"]) == 3


def test_across_nodes_engines_bind_the_node_address_and_require_a_fresh_key(
    routable_ray, tiny_qwen3_dir, no_run_key
):
    rollout = RolloutConfig()
    one_node = plan(ClusterConfig(), rollout)
    # one node: a key too, and nothing in Ray's options (its processes may be kept for the next run)
    assert len(one_node.api_key) >= 32 and "runtime_env" not in one_node.engines[0]
    assert os.environ[ports.API_KEY_ENV] == one_node.api_key
    one_node.remove()
    assert ports.API_KEY_ENV not in os.environ

    earlier = plan(ClusterConfig(num_nodes=2), rollout)
    earlier_key = earlier.api_key
    earlier.remove()
    placement = plan(ClusterConfig(num_nodes=2, num_trainer_procs=2), rollout)
    key = placement.api_key
    assert key and len(key) >= 32 and key not in (earlier_key, one_node.api_key)  # a fresh key per run
    for options in [*placement.trainer, *placement.engines]:  # the key stays out of Ray's options
        assert options["runtime_env"]["env_vars"] == {ports.HOST_ENV: "node"}
    assert os.environ[ports.API_KEY_ENV] == key  # the driver's own clients (pool, router, trainer group)

    engine = (
        ray.remote(EngineActor)
        .options(**placement.engines[0])
        .remote(rollout, str(tiny_qwen3_dir), seed=0, api_key=key)
    )
    try:
        url = ray.get(engine.url.remote(), timeout=120)
        host = urlsplit(url).hostname
        assert host == ray.util.get_node_ip_address() and host != ports.LOOPBACK
        with pytest.raises(httpx.ConnectError):  # not on loopback
            httpx.get(url.replace(host, ports.LOOPBACK) + "/health", timeout=10)
        assert httpx.get(url + "/get_model_info", timeout=10).status_code == 401

        async def version():
            async with EngineClient(url) as client:  # the run's key, from the driver's environment
                return await client.get_weight_version()

        assert asyncio.run(version()) == "default"
    finally:
        ray.get(engine.shutdown.remote(), timeout=30)
        ray.kill(engine)
        placement.remove()
    assert ports.API_KEY_ENV not in os.environ


MULTI_NODE = ["cluster.num_nodes=2", "cluster.ray_address=auto", "rollout=sglang",
              "rollout.server_module=rlx.engine.serve", "rollout.num_engines=2", "run.num_rollout=2",
              "rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "train.micro_batch_size=16",
              "run.progress=false", "run.loggers=[jsonl]"]  # fmt: skip


def test_a_run_of_several_nodes_refuses_a_ray_without_authentication(routable_ray, tmp_path):
    """This process's Ray requires no token (the run joins it: ray_address): a run of several nodes
    refuses it before any process starts, naming the variables and the key to opt out."""
    with pytest.raises(ConfigError) as e:
        run(compose([f"run.output_dir={tmp_path}", *MULTI_NODE]))
    message = str(e.value)
    assert "cluster.num_nodes=2" in message and "without token authentication" in message
    assert "RAY_AUTH_MODE=token" in message and "RAY_AUTH_TOKEN" in message
    assert "cluster.ray_allow_unauthenticated=true" in message
    assert ray.is_initialized()  # a Ray the run did not start, it leaves up


def test_a_run_in_multi_node_mode_generates_and_syncs_through_keyed_engines(
    routable_ray, tmp_path, no_run_key
):
    """cluster.num_nodes=2 on this one machine: two SGLang-CLI engine processes (rlx's engine as the
    module) on the node's address with the run's --api-key, the router with it in front of them;
    every request and weight update of the loop carries the key. This process's Ray requires no
    token: cluster.ray_allow_unauthenticated=true lets the run use it."""
    assert ray.is_initialized()  # this process's Ray (routable_ray): the run joins it (ray_address)
    history = run(
        compose([f"run.output_dir={tmp_path}", *MULTI_NODE, "cluster.ray_allow_unauthenticated=true"])
    )
    assert [h["version"] for h in history] == [1, 2]
    assert all(h["rollout/failed_frac"] == 0.0 for h in history)  # no request was refused
    assert history[1]["train/logprob_abs_diff"] <= 1e-5  # the engines loaded the trainer's weights
    assert ports.API_KEY_ENV not in os.environ  # the key lived as long as the run
    assert ray.is_initialized()  # a Ray the run did not start, it leaves up
