"""The local engine behind SGLang's HTTP API on loopback: shapes, values, weight updates, abort, client."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import aiohttp
import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlx.engine.local import LocalEngine
from rlx.engine.serve import EngineServer
from rlx.engine.serve.cli import arg_parser
from rlx.rollout.client import EngineClient, EngineError
from rlx.rollout.sglang import ServerProcess, launch_server_cmd

PROMPT = [2, 3, 4, 5]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir):
    server = EngineServer(LocalEngine(str(tiny_qwen3_dir), seed=0)).start()
    yield server
    server.stop()


@pytest.fixture
def fresh_server(tiny_qwen3_dir):
    """A server of its own, for tests that change weights or slow the engine down."""
    server = EngineServer(LocalEngine(str(tiny_qwen3_dir), seed=0)).start()
    yield server
    server.stop()


def reference_logprobs(model_dir, prompt: list[int], output: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_generate_response_has_sglang_shape_and_real_logprobs(server, tiny_qwen3_dir):
    r = post(
        server,
        "/generate",
        {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "rid": "req-1"},
    )
    assert r.status_code == 200
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["id"] == "req-1"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == 6 and meta["cached_tokens"] == 0
    assert meta["weight_version"] == "default" and meta["e2e_latency"] > 0
    assert meta["input_token_logprobs"] == [[None, PROMPT[-1], None]]  # SGLang's logprob_start_len=-1
    triples = meta["output_token_logprobs"]
    assert [t for _, t, _ in triples] == out["output_ids"] and all(x is None for *_, x in triples)
    ref = reference_logprobs(tiny_qwen3_dir, PROMPT, out["output_ids"])
    assert (torch.tensor([lp for lp, *_ in triples]) - ref).abs().max().item() <= 1e-4
    tokenizer = server.engine.tokenizer
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_generate_batch_of_texts_and_stop_token_trimmed_from_text(server):
    free = post(server, "/generate", {"text": "3 7 1 =", "sampling_params": GREEDY}).json()
    stop = free["output_ids"][1]
    r = post(
        server,
        "/generate",
        {
            "text": ["3 7 1 =", "2 ="],
            "return_logprob": [True, False],
            "sampling_params": [
                {**GREEDY, "ignore_eos": False, "stop_token_ids": [stop]},
                {"max_new_tokens": 2},
            ],
        },
    )
    first, second = r.json()
    assert first["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert first["output_ids"][-1] == stop  # kept in the ids, trimmed from the text (SGLang's detokenizer)
    assert first["text"] == server.engine.decode(first["output_ids"][:-1])
    assert (
        "output_token_logprobs" not in second["meta_info"] and second["meta_info"]["completion_tokens"] <= 2
    )
    assert first["meta_info"]["id"] != second["meta_info"]["id"]


def test_bad_requests_answer_400_with_sglang_error_body(server):
    for body in (
        {"sampling_params": {}},
        {"input_ids": [], "sampling_params": {}},
        {"input_ids": [2], "sampling_params": {"no_such_param": 1}},
        {"input_ids": [2] * 64},
    ):
        r = post(server, "/generate", body)
        assert r.status_code == 400 and r.json()["error"]["message"]
    # max_new_tokens past the context (64): SGLang's error, and the server serves the next request
    past = post(server, "/generate", {"input_ids": [2] * 60, "sampling_params": {"max_new_tokens": 4}})
    assert (
        past.status_code == 400 and "maximum context length of 64 tokens" in past.json()["error"]["message"]
    )
    fits = post(server, "/generate", {"input_ids": [2] * 60, "sampling_params": {"max_new_tokens": 3}})
    assert fits.status_code == 200 and len(fits.json()["output_ids"]) <= 3


def test_generate_takes_put_streams_one_event_and_refuses_a_body_that_is_no_json_object(server):
    body = {"input_ids": [PROMPT, PROMPT[:2]], "sampling_params": GREEDY}
    posted = post(server, "/generate", body).json()
    put = httpx.put(server.url + "/generate", json=body, timeout=60)
    assert put.status_code == 200 and [o["output_ids"] for o in put.json()] == [
        o["output_ids"] for o in posted
    ]
    # stream: SGLang's server-sent events, here the whole answer in one event per prompt, then [DONE]
    stream = post(server, "/generate", body | {"stream": True})
    assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in stream.text.split("\n\n") if line]
    assert events[-1] == "[DONE]" and len(events) == 3
    for index, (event, want) in enumerate(zip(events[:2], posted, strict=True)):
        got = json.loads(event)
        assert got["index"] == index and got["output_ids"] == want["output_ids"]
    for raw, message in ((b"{not json", "invalid JSON body"), (b"[1, 2]", "the JSON body must be an object")):
        reply = httpx.post(server.url + "/generate", content=raw, timeout=60)
        assert reply.status_code == 400 and message in reply.json()["error"]["message"]


def test_info_and_health_endpoints(server):
    get = lambda path: httpx.get(server.url + path, timeout=30)  # noqa: E731
    assert get("/health").status_code == 200 and get("/health_generate").status_code == 200
    for path in ("/get_model_info", "/model_info"):
        info = get(path).json()
        assert info["model_path"] == server.engine.model_path and info["is_generation"] is True
        assert info["weight_version"] == "default" and info["architectures"] == ["Qwen3ForCausalLM"]
    for path in ("/get_server_info", "/server_info"):
        info = get(path).json()
        assert info["port"] == server.port and info["internal_states"][0]["num_requests_total"] >= 0
        assert info["admission_group"] == 1 and info["internal_states"][0]["num_preempted_total"] == 0  # CPU
        assert info["enable_memory_saver"] is False and info["cuda_graph_max_bs"] == 0  # CPU: no graphs
        assert info["internal_states"][0]["num_cuda_graphs_captured"] == 0
    assert get("/get_weight_version").json() == {"weight_version": "default"}
    (load,) = get("/get_load").json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    assert get("/flush_cache").status_code == 200 and post(server, "/flush_cache", {}).status_code == 200


def test_update_weights_from_disk_changes_logprobs_and_version(fresh_server, tiny_qwen3_factory):
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    before = post(fresh_server, "/generate", body).json()
    other_dir = tiny_qwen3_factory(1)
    r = post(fresh_server, "/update_weights_from_disk", {"model_path": str(other_dir), "weight_version": "7"})
    assert r.status_code == 200
    assert r.json() == {
        "success": True,
        "message": "Succeeded to update model weights. Weight version updated to 7.",
        "num_paused_requests": 0,
    }
    assert httpx.get(fresh_server.url + "/get_weight_version").json() == {"weight_version": "7"}
    after = post(fresh_server, "/generate", body).json()
    assert after["meta_info"]["weight_version"] == "7"
    lp_before = [lp for lp, *_ in before["meta_info"]["output_token_logprobs"]]
    lp_after = [lp for lp, *_ in after["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(lp_after, lp_before, strict=True)) > 1e-3
    ref = reference_logprobs(other_dir, PROMPT, after["output_ids"])
    assert (torch.tensor(lp_after) - ref).abs().max().item() <= 1e-4

    bad = post(
        fresh_server, "/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "8"}
    )
    assert bad.status_code == 400 and bad.json()["success"] is False

    # the client turns that answer into an error naming the engine and the directory
    async def load():
        async with EngineClient(fresh_server.url) as client:
            await client.update_weights_from_disk("/nonexistent", weight_version="8")

    with pytest.raises(
        RuntimeError, match=f"engine {fresh_server.url} failed to load weights from /nonexistent"
    ):
        asyncio.run(load())
    assert httpx.get(fresh_server.url + "/get_weight_version").json() == {"weight_version": "7"}


def test_abort_running_and_queued_requests(fresh_server):
    engine, scheduler = fresh_server.engine, fresh_server.scheduler
    step, steps = engine.step, []

    def slow_step():  # ~59 decode steps of 20 ms: long enough to abort mid-generation
        steps.append(engine.num_running)
        time.sleep(0.02)
        return step()

    engine.step = slow_step
    long = {"max_new_tokens": 59, "ignore_eos": True}
    with httpx.Client(base_url=fresh_server.url, timeout=60) as http:
        results = {}
        threads = [
            threading.Thread(
                target=lambda rid=rid: results.__setitem__(
                    rid,
                    http.post(
                        "/generate", json={"input_ids": PROMPT, "sampling_params": long, "rid": rid}
                    ).json(),
                )
            )
            for rid in ("running-1", "running-2")
        ]
        gate = threading.Event()
        scheduler.call(gate.wait)  # hold the scheduler so both requests join one batch
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30  # a request refused at parse time never waits: fail, not hang
        while scheduler.num_waiting() < 2:
            assert time.monotonic() < deadline, results
            time.sleep(0.01)
        gate.set()
        deadline = time.monotonic() + 30
        while sum(n == 2 for n in steps) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # both requests in one batch, a few tokens in
        assert http.post("/abort_request", json={"rid": "running-1"}).status_code == 200
        for t in threads:
            t.join()
        assert results["running-1"]["meta_info"]["finish_reason"]["type"] == "abort"
        assert 0 < len(results["running-1"]["output_ids"]) < 59
        assert results["running-2"]["meta_info"]["finish_reason"] == {"type": "length", "length": 59}

        # Queued behind a blocked scheduler, then aborted: never started (SGLang's "before prefill").
        gate = threading.Event()
        scheduler.call(gate.wait)
        queued = {}
        thread = threading.Thread(
            target=lambda: queued.update(
                http.post(
                    "/generate", json={"input_ids": PROMPT, "sampling_params": long, "rid": "queued-1"}
                ).json()
            )
        )
        thread.start()
        deadline = time.monotonic() + 30
        while scheduler.num_waiting() < 1:
            assert time.monotonic() < deadline, queued
            time.sleep(0.01)
        assert http.post("/abort_request", json={"rid": "", "abort_all": True}).status_code == 200
        gate.set()
        thread.join()
        assert queued["meta_info"]["finish_reason"]["type"] == "abort" and queued["output_ids"] == []


def test_client_that_goes_away_has_its_batch_aborted(fresh_server):
    """A batch request whose client disconnects mid-generation is aborted, every prompt of it
    (SGLang does the same), so the engine stops spending steps on answers nobody reads."""
    engine, scheduler = fresh_server.engine, fresh_server.scheduler
    step, steps = engine.step, []

    def slow_step():  # 59 tokens (the tiny model's context allows no more) at 60 ms: 3.5 s unaborted
        steps.append(engine.num_running)
        time.sleep(0.06)
        return step()

    engine.step = slow_step
    body = {"input_ids": [PROMPT] * 3, "sampling_params": {"max_new_tokens": 59, "ignore_eos": True}}
    with pytest.raises(httpx.TimeoutException):  # the client gives up and closes its connection
        httpx.post(fresh_server.url + "/generate", json=body, timeout=0.5)
    assert steps and steps[-1] == 3  # all three were running when the client left
    deadline = time.monotonic() + 10  # the server looks for the client once a second
    while scheduler.num_waiting() + engine.num_running > 0:
        assert time.monotonic() < deadline, f"still running after the client left: {engine.num_running}"
        time.sleep(0.05)
    assert len(steps) < 45  # aborted well before the 59 steps of a finished batch


def test_an_engine_step_that_raises_fails_its_requests_with_500_and_the_server_goes_on(fresh_server):
    engine = fresh_server.engine
    step = engine.step

    def broken_step():
        engine.step = step  # once
        raise RuntimeError("a kernel fell over")

    engine.step = broken_step
    body = {"input_ids": [PROMPT, PROMPT], "sampling_params": GREEDY}
    failed = post(fresh_server, "/generate", body)
    assert failed.status_code == 500
    assert failed.json() == {"error": {"message": "generation failed: a kernel fell over"}}
    again = post(fresh_server, "/generate", body)
    assert again.status_code == 200 and [len(o["output_ids"]) for o in again.json()] == [6, 6]


def test_client_against_server(server, tiny_qwen3_dir):
    async def drive():
        async with EngineClient(server.url) as client:
            assert await client.health()
            await client.wait_healthy(10)
            outs = await asyncio.gather(*(client.generate([2, 3 + i], GREEDY) for i in range(8)))
            assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
            assert len(outs[0]["meta_info"]["output_token_logprobs"]) == 6
            assert (await client.get_model_info())["model_path"] == str(tiny_qwen3_dir)
            assert await client.get_weight_version() == "default"
            assert await client.flush_cache() is True
            await client.abort("no-such-rid")
            with pytest.raises(EngineError) as info:
                await client.generate([], GREEDY)
            assert info.value.status_code == 400

    asyncio.run(drive())


def test_client_retries_and_falls_back_to_model_info():
    from aiohttp import web

    calls = {"/generate": 0}

    async def generate(request):
        calls["/generate"] += 1
        if calls["/generate"] < 3:  # the router's "no worker available" while engines come up
            return web.json_response({"error": {"message": "busy"}}, status=503)
        return web.json_response({"text": "", "output_ids": [], "meta_info": {}})

    async def model_info(request):
        return web.json_response({"weight_version": "3"})

    async def drive():
        # a real HTTP server on loopback that answers like an older router / newer SGLang:
        # no /get_weight_version (404), the version only in the model info
        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/get_model_info", model_info)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        client = EngineClient(f"http://127.0.0.1:{port}", max_retries=3, retry_backoff_s=0.001)
        assert (await client.generate([1], {}))["output_ids"] == []
        assert calls["/generate"] == 3
        assert await client.get_weight_version() == "3"
        await client.aclose()
        await runner.cleanup()
        dead = EngineClient("http://127.0.0.1:9", max_retries=1, retry_backoff_s=0.001)
        assert await dead.health() is False
        with pytest.raises(aiohttp.ClientConnectionError):
            await dead.generate([1], {})
        with pytest.raises(TimeoutError):
            await dead.wait_healthy(0.2, interval_s=0.05)
        await dead.aclose()

    asyncio.run(drive())


def test_a_flag_value_that_starts_with_a_dash_reaches_the_server_intact():
    # secrets.token_urlsafe starts with "-" one time in 64: passed apart, argparse took it for a flag
    # and the engine exited with "--api-key: expected one argument" (a multi-node CI run did)
    args = {"api_key": "-Ab_9", "random_seed": -3, "log_level": "info"}
    cmd = launch_server_cmd("/m", 1234, args, module="rlx.engine.serve")
    assert cmd[-4:] == ["--api-key=-Ab_9", "--random-seed=-3", "--log-level", "info"]
    parsed, unknown = arg_parser().parse_known_args(cmd[3:])
    assert (parsed.api_key, parsed.random_seed, parsed.log_level, unknown) == ("-Ab_9", -3, "info", [])


def test_server_process_runs_the_local_engine_cli(tiny_qwen3_dir):
    args = {"random_seed": 0, "num_threads": 1, "mem_fraction_static": 0.5, "enable_metrics": True}
    cmd = launch_server_cmd(str(tiny_qwen3_dir), 1234, args, module="rlx.engine.serve")
    assert cmd[1:] == [
        "-m",
        "rlx.engine.serve",
        "--model-path",
        str(tiny_qwen3_dir),
        "--port",
        "1234",
        "--host",
        "127.0.0.1",
        "--random-seed",
        "0",
        "--num-threads",
        "1",
        "--mem-fraction-static",
        "0.5",
        "--enable-metrics",
    ]
    process = ServerProcess(
        str(tiny_qwen3_dir), engine_args=args, module="rlx.engine.serve", startup_timeout_s=120
    )
    with process:
        pid = process.pid
        r = httpx.post(
            process.url + "/generate",
            json={"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 6
    assert not process.running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped and gone, not a zombie or a straggler
