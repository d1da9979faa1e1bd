"""Engine fault tolerance (`rollout.fault_tolerance=true`): an engine killed (kill -9) or hung
(SIGSTOP) in the middle of a rollout is restarted at the published weights, and its requests are
sent again, so the batch comes back whole. CPU, tiny Qwen3, real sglang-router on loopback."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from urllib.parse import urlparse

import aiohttp
import httpx
import psutil
import pytest
from helpers import write_tiny_qwen3
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from rlx.config.compose import compose
from rlx.reward.config import RewardConfig
from rlx.rollout.client import EngineError, EngineTimeout, is_engine_failure
from rlx.rollout.config import RolloutConfig
from rlx.rollout.pool import RolloutPool
from rlx.runtime import _prepare
from rlx.sample import Sample, Status
from rlx.trainer.group import TrainerGroup
from rlx.trainer.weights import write_weight_shards
from rlx.weight_sync.publisher import WeightPublisher

TOY_REWARD = RewardConfig(fn="rlx.reward.toy.position_match")  # the prompts are toy digits

NUM_GROUPS, GROUP_SIZE, MAX_LEN = 16, 4, 40


@pytest.fixture(scope="module")
def weights_v1(tmp_path_factory, tiny_qwen3_dir):
    """Version 1 of the policy as the trainer publishes it on disk (other weights than the start)."""
    root = tmp_path_factory.mktemp("ft")
    other = write_tiny_qwen3(root / "other", seed=1)
    write_weight_shards(load_file(other / "model.safetensors").items(), root / "v1", bucket_bytes=64 << 10)
    return str(root / "v1")


def _cfg(num_engines: int) -> RolloutConfig:
    return RolloutConfig(
        num_engines=num_engines,
        n_samples_per_prompt=GROUP_SIZE,
        max_response_len=MAX_LEN,
        ignore_eos=True,  # every request decodes MAX_LEN tokens: long enough to be caught mid-way
        fault_tolerance=True,
        health_check_interval_s=0.5,
        health_check_timeout_s=2.0,
        health_check_failures=2,
        engine_restart_timeout_s=60.0,
        # the router must not hide the failure by retrying on the other engine itself
        router_args={"disable_retries": True} if num_engines > 1 else {},
    )


def _prompts(tokenizer) -> list[Sample]:
    texts = [f"{d % 10} {d % 7}" for d in range(NUM_GROUPS)]
    return [Sample(prompt=f"{t} =", prompt_ids=tokenizer(f"{t} =")["input_ids"], label=t) for t in texts]


def _server_pid(url: str) -> int:
    """The process listening on `url`'s port (the engine actor, which serves in-process)."""
    port = urlparse(url).port
    return next(c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN")


def _when_busy(url: str, act) -> threading.Thread:
    """Call `act()` as soon as the engine at `url` has requests running (in a thread)."""

    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            load = httpx.get(url + "/get_load", timeout=10).json()[0]
            if load["num_reqs"] > 0:
                act()
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _wait_all_serving(pool: RolloutPool, timeout_s: float = 60.0) -> None:
    """Until every engine is back in rotation (a restart finishes in the background)."""
    deadline = time.monotonic() + timeout_s
    while len(pool.engines.serving) < len(pool.engines.urls):
        assert time.monotonic() < deadline, pool.engines.describe()
        time.sleep(0.1)


def _version(url: str) -> str:
    return httpx.get(url + "/get_weight_version", timeout=10).json()["weight_version"]


def _check_batch(samples: list[Sample]) -> None:
    assert [(s.group, s.index) for s in samples] == [
        (g, i) for g in range(NUM_GROUPS) for i in range(GROUP_SIZE)
    ]
    bad = [(s.group, s.index, s.status, s.status_reason) for s in samples if s.status is not Status.TRUNCATED]
    assert not bad, bad
    assert all(s.response_len == MAX_LEN and len(s.rollout_logprobs) == MAX_LEN for s in samples)
    assert {s.version for s in samples} == {1}  # the restarted engine served the published weights too


def test_engine_killed_mid_rollout_behind_the_router(ray_session, tiny_qwen3_dir, weights_v1):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))
    pool = RolloutPool(_cfg(2), str(tiny_qwen3_dir), tokenizer, seed=0, reward=TOY_REWARD)
    try:
        pool.update_weights(weights_v1, version=1)
        assert pool.metrics() == {"rollout/engine_restarts": 0.0, "rollout/request_retries": 0.0}
        victim = pool.engines.urls[0]
        pid = _server_pid(victim)
        watcher = _when_busy(victim, lambda: os.kill(pid, signal.SIGKILL))
        samples, _ = pool.generate(_prompts(tokenizer), version=1)
        watcher.join()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        _check_batch(samples)  # all of it from the other engine, meanwhile
        _wait_all_serving(pool)
        counts = pool.metrics()
        assert counts["rollout/engine_restarts"] == 1.0
        assert counts["rollout/request_retries"] >= 1.0  # its in-flight groups were sent again
        assert pool.metrics() == {"rollout/engine_restarts": 0.0, "rollout/request_retries": 0.0}  # reset

        # the new engine: another process and port, at version 1, back behind the router
        restarted = pool.engines.urls[0]
        assert restarted != victim and _server_pid(restarted) != pid
        assert _version(restarted) == "1"
        workers = httpx.get(pool.engines.url + "/workers", timeout=10).json()["workers"]
        assert sorted(w["url"] for w in workers) == sorted(pool.engines.urls)
        before = httpx.get(restarted + "/get_server_info", timeout=10).json()["internal_states"][0]
        samples, _ = pool.generate(_prompts(tokenizer), version=1)
        after = httpx.get(restarted + "/get_server_info", timeout=10).json()["internal_states"][0]
        assert after["num_requests_total"] > before["num_requests_total"]  # it takes requests again
        _check_batch(samples)

        # a later weight update reaches it like any engine
        pool.update_weights(weights_v1, version=2)
        assert [_version(u) for u in pool.engines.urls] == ["2", "2"]

        # weights pushed by the trainer (tensor/distributed: no directory to reload): a restarted
        # engine stays out of rotation until the next push reaches it
        _push(pool, weights_v1, version=3)
        victim, pid = pool.engines.urls[1], _server_pid(pool.engines.urls[1])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while 1 not in pool.engines.behind:
            assert time.monotonic() < deadline, pool.engines.describe()
            time.sleep(0.1)
        assert pool.engines.serving == {0} and pool.engines.urls[1] != victim
        assert _version(pool.engines.urls[1]) == "default"  # the checkpoint's weights, not version 3
        assert [w["url"] for w in httpx.get(pool.engines.url + "/workers", timeout=10).json()["workers"]] == [
            pool.engines.urls[0]
        ]
        samples, _ = pool.generate(_prompts(tokenizer)[:2], version=3)
        assert {s.version for s in samples} == {3}  # never from the engine left behind
        _push(pool, weights_v1, version=4)  # reaches every engine, the restarted one too
        assert pool.engines.serving == {0, 1} and not pool.engines.behind
        workers = httpx.get(pool.engines.url + "/workers", timeout=10).json()["workers"]
        assert sorted(w["url"] for w in workers) == sorted(pool.engines.urls)
        assert pool.metrics()["rollout/engine_restarts"] == 1.0
    finally:
        pool.shutdown()


def _push(pool: RolloutPool, path: str, version: int) -> None:
    """What the trainer's tensor or distributed push does: new weights to every engine URL, then
    the publisher's `check_version`."""
    for url in pool.engines.urls:
        body = {"model_path": path, "weight_version": str(version)}
        assert httpx.post(url + "/update_weights_from_disk", json=body, timeout=60).json()["success"]
    pool.check_version(version)


def test_one_engine_hung_mid_rollout_is_restarted(ray_session, tiny_qwen3_dir, weights_v1):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))
    pool = RolloutPool(_cfg(1), str(tiny_qwen3_dir), tokenizer, seed=0, reward=TOY_REWARD)
    pid = None
    try:
        pool.update_weights(weights_v1, version=1)
        victim = pool.engines.urls[0]
        pid = _server_pid(victim)
        watcher = _when_busy(victim, lambda: os.kill(pid, signal.SIGSTOP))  # hung, not gone
        samples, _ = pool.generate(_prompts(tokenizer), version=1)  # requests wait for the restart
        watcher.join()
        _check_batch(samples)
        counts = pool.metrics()
        assert counts["rollout/engine_restarts"] == 1.0 and counts["rollout/request_retries"] >= 1.0
        assert pool.engines.url == pool.engines.urls[0] != victim and _version(pool.engines.url) == "1"
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if pid is not None and psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)
        pool.shutdown()


@pytest.mark.parametrize(
    "error, failed",
    [
        (aiohttp.ClientConnectionError("refused"), True),
        (EngineTimeout("no answer"), True),
        (EngineError(503, "no worker", "http://r/generate"), True),
        (EngineError(400, "bad sampling params", "http://r/generate"), False),
        (ValueError("a generate_fn bug"), False),
    ],
)
def test_which_errors_are_engine_failures(error, failed):
    assert is_engine_failure(error) is failed
    wrapped = RuntimeError("tool turn failed")
    wrapped.__cause__ = error
    assert is_engine_failure(wrapped) is failed  # as a generate_fn may raise it


# ---- pushed weights: the trainer's broadcast group formed again around a restarted engine ------


@pytest.fixture
def split_run(ray_session, tmp_path, monkeypatch):
    """A CPU trainer rank and two engines behind the router publishing by `distributed` (gloo),
    with fault tolerance. The engines start from other weights than the trainer's, so a pushed
    update shows in what they generate."""
    monkeypatch.setenv("RLX_CACHE", os.environ.get("RLX_CACHE", str(tmp_path / "cache")))
    job = _prepare(compose(["model=tiny_qwen3", f"run.output_dir={tmp_path / 'run'}"]))
    engines_dir = tmp_path / "engines"
    shutil.copytree(job.hf_dir, engines_dir)
    weights = load_file(engines_dir / "model.safetensors")
    save_file({k: v * 0.5 for k, v in weights.items()}, engines_dir / "model.safetensors")
    cfg = _cfg(2)
    cfg.weight_sync = "distributed"
    cfg.health_check_interval_s = 30.0  # the push, not the monitor, finds the second engine dead
    trainer = TrainerGroup(job.cfg)
    pool = RolloutPool(cfg, str(engines_dir), job.tokenizer, seed=0, reward=TOY_REWARD)
    publish = WeightPublisher(
        trainer,
        pool,
        method="distributed",
        backend="gloo",
        bucket_bytes=64 << 10,
        disk_root=tmp_path / "disk",
    )
    try:
        yield trainer, pool, publish, job.tokenizer
    finally:
        pool.shutdown()
        trainer.shutdown()


def _greedy_logprobs(url: str, ids: list[int]) -> list[float]:
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}}  # fmt: skip
    meta = httpx.post(url + "/generate", json=body, timeout=60).json()["meta_info"]
    return [lp for lp, *_ in meta["output_token_logprobs"]]


def test_restarted_engine_rejoins_the_broadcast_group(split_run):
    trainer, pool, publish, tokenizer = split_run
    ids = tokenizer("3 4 =")["input_ids"]
    before = _greedy_logprobs(pool.engines.urls[0], ids)
    publish(1)  # the group forms with both engines; they now serve the trainer's weights
    trained = _greedy_logprobs(pool.engines.urls[0], ids)
    assert trained != pytest.approx(before)
    assert _greedy_logprobs(pool.engines.urls[1], ids) == pytest.approx(trained)
    assert publish._members == dict(enumerate(pool.engines.urls))

    # dead when the push begins, before the monitor noticed: the push fails (its broadcast or its
    # announcement), the engines are pinged, and it is tried again without the dead one
    victim = pool.engines.urls[1]
    os.kill(_server_pid(victim), signal.SIGKILL)
    publish(2)
    assert list(publish._members) == [0] and _version(pool.engines.urls[0]) == "2"
    assert pool.engines.serving == {0}

    # restarted at the checkpoint's weights, out of rotation until a push reaches it
    deadline = time.monotonic() + 60
    while 1 not in pool.engines.behind:
        assert time.monotonic() < deadline, pool.engines.describe()
        time.sleep(0.1)
    assert pool.engines.urls[1] != victim
    assert _greedy_logprobs(pool.engines.urls[1], ids) == pytest.approx(before)
    samples, _ = pool.generate(_prompts(tokenizer)[:2], version=2)
    assert {s.version for s in samples} == {2}  # never from the engine left behind

    publish(3)  # the group is formed again with the new engine, which gets the weights and rejoins
    assert publish._members == dict(enumerate(pool.engines.urls))
    assert pool.engines.serving == {0, 1} and not pool.engines.behind
    assert [_version(u) for u in pool.engines.urls] == ["3", "3"]
    assert _greedy_logprobs(pool.engines.urls[1], ids) == pytest.approx(trained)
    assert pool.metrics()["rollout/engine_restarts"] == 1.0


def test_engines_half_resumed_between_colocated_turns_are_not_probed(ray_session, tiny_qwen3_dir, weights_v1):
    """A colocated publish resumes the engines' weights, syncs them, and only then their KV cache:
    until every released tag is back the monitor must not ping (an engine without its KV cache, or
    with weights not loaded yet, cannot generate, and two failed pings would restart it)."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))
    pool = RolloutPool(_cfg(1), str(tiny_qwen3_dir), tokenizer, seed=0, reward=TOY_REWARD)
    try:
        url = pool.engines.urls[0]
        pool.release_memory()
        assert pool.engines.memory_released
        pool.resume_memory(["weights"])  # weights back uninitialized (no CPU backup), no KV cache
        assert pool.engines.memory_released
        time.sleep(4 * pool.cfg.health_check_interval_s)  # pings would have failed twice by now
        pool.update_weights(weights_v1, version=1)  # the sync of a colocated step
        pool.resume_memory(["kv_cache"])
        assert not pool.engines.memory_released
        samples, _ = pool.generate(_prompts(tokenizer)[:2], version=1)  # it serves again
        assert [s.status for s in samples] == [Status.TRUNCATED] * 2 * GROUP_SIZE
        assert {s.version for s in samples} == {1} and all(s.response_len == MAX_LEN for s in samples)
        assert pool.metrics()["rollout/engine_restarts"] == 0.0 and pool.engines.urls[0] == url
    finally:
        pool.shutdown()
