"""The rollout pool through Ray: two engines behind the real sglang-router serve one rollout."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
from helpers import write_tiny_qwen3
from transformers import AutoTokenizer

import rlx.actor_reuse
from rlx.reward.config import RewardConfig
from rlx.rollout.client import EngineClient
from rlx.rollout.config import RolloutConfig
from rlx.rollout.engines import EarlyEngines
from rlx.rollout.pool import RolloutPool
from rlx.sample import Sample, Status
from rlx.trainer.weights import write_weight_shards

TOY_REWARD = RewardConfig(fn="rlx.reward.toy.position_match")  # the prompts are toy digits


def _requests_served(url: str) -> int:
    async def ask():
        client = EngineClient(url)
        try:
            return (await client.get_server_info())["internal_states"][0]["num_requests_total"]
        finally:
            await client.aclose()

    return asyncio.run(ask())


def test_two_engines_behind_the_router_serve_one_rollout(ray_session, tiny_qwen3_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))
    cfg = RolloutConfig(num_engines=2, batch_size=8, n_samples_per_prompt=4, max_response_len=4)
    pool = RolloutPool(cfg, str(tiny_qwen3_dir), tokenizer, seed=0, reward=TOY_REWARD)
    try:
        assert pool.engines.router is not None and pool.engines.url == pool.engines.router.url
        prompts = [
            Sample(
                prompt=f"{d} {d} {d} =",
                prompt_ids=tokenizer(f"{d} {d} {d} =")["input_ids"],
                label=f"{d} {d} {d}",
            )
            for d in range(8)
        ]
        samples, metrics = pool.generate(prompts, version=0)
        assert [(s.group, s.index) for s in samples] == [(g, i) for g in range(8) for i in range(4)]
        for s in samples:
            assert s.status in (Status.COMPLETED, Status.TRUNCATED)
            assert 1 <= s.response_len <= 4 and len(s.rollout_logprobs) == s.response_len
            assert all(lp <= 0.0 for lp in s.rollout_logprobs)
            assert s.reward is not None and 0.0 <= s.reward <= 1.0
            assert s.version == 0
        assert metrics["rollout/reward_mean"] == pytest.approx(sum(s.reward for s in samples) / 32)
        # the router spread the 8 group requests (4 prompts each) over both engines
        served = [_requests_served(url) for url in pool.engines.urls]
        assert sum(served) == 32 and all(n > 0 for n in served), served

        # weight sync: new weights as HF shards, every engine serves version 1 afterwards
        other = write_tiny_qwen3(tmp_path / "other", seed=1)
        from safetensors.torch import load_file

        write_weight_shards(
            load_file(other / "model.safetensors").items(), tmp_path / "v1", bucket_bytes=64 << 10
        )
        pool.update_weights(str(tmp_path / "v1"), version=1)
        samples, _ = pool.generate(prompts[:2], version=1)
        assert {s.version for s in samples} == {1}
    finally:
        pool.shutdown()


def test_two_engines_without_a_router_that_can_start_stop_before_they_serve(
    ray_session, tiny_qwen3_dir, monkeypatch
):
    """sglang-router missing a dependency (as on the GPU machine: `setproctitle`) stops the pool's
    start with the import's error while its engines start, not after they have loaded the model and
    the router exited; the engines it launched are gone."""
    import rlx.rollout.engines as engines
    from rlx.rollout import router

    def missing(module: str = router.LAUNCHER):
        return router.start_import_check("rlx_no_such_router_dependency")

    monkeypatch.setattr(engines, "start_import_check", missing)
    monkeypatch.setattr(
        engines,
        "finish_import_check",
        lambda check: router.finish_import_check(check, "rlx_no_such_router_dependency"),
    )
    killed = []
    kill = rlx.actor_reuse.kill_quietly
    monkeypatch.setattr(rlx.actor_reuse, "kill_quietly", lambda actor: (killed.append(actor), kill(actor)))
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))
    cfg = RolloutConfig(num_engines=2, batch_size=8, n_samples_per_prompt=4, max_response_len=4)
    with pytest.raises(RuntimeError, match="No module named 'rlx_no_such_router_dependency'") as refused:
        RolloutPool(cfg, str(tiny_qwen3_dir), tokenizer, seed=0, reward=TOY_REWARD)
    assert "rollout.num_engines=1" in str(refused.value)
    assert len(killed) == 2  # both engines it launched


def test_a_kept_engine_process_serves_exactly_as_a_new_one(ray_session, tiny_qwen3_factory):
    """keep_actors: the next pool sets the first pool's engine process up again (the same actor),
    and after it served another model with another seed, it generates for the first model what a
    new process generated, token for token and log-prob for log-prob (to float noise): nothing
    of the server before is left."""
    first, second = tiny_qwen3_factory(0), tiny_qwen3_factory(1)
    tokenizer = AutoTokenizer.from_pretrained(str(first))
    cfg = RolloutConfig(num_engines=1, batch_size=4, n_samples_per_prompt=4, max_response_len=6)
    prompts = [
        Sample(prompt=f"{d} 3 {d} =", prompt_ids=tokenizer(f"{d} 3 {d} =")["input_ids"], label=f"{d} 3 {d}")
        for d in range(4)
    ]

    def rollout(model_dir, seed: int) -> list:
        pool = RolloutPool(cfg, str(model_dir), tokenizer, seed=seed, reward=TOY_REWARD)
        try:
            samples, _ = pool.generate(prompts, version=0)
        finally:
            pool.shutdown()
        return [(s.response_ids, s.rollout_logprobs) for s in samples]

    with rlx.actor_reuse.keep_actors():  # a pool of its own, empty: the first pool starts a new process
        fresh = rollout(first, seed=0)
        (kept,) = rlx.actor_reuse._kept["engine"]
        other = rollout(second, seed=7)
        again = rollout(first, seed=0)
        assert rlx.actor_reuse._kept["engine"] == [kept]  # the same process each time, handed back after
    assert other != fresh  # the second set-up really served something else
    # the same tokens; log-probs equal but for the last bit, which on CPU moves with the requests
    # that happen to share a batch (timing)
    assert [ids for ids, _ in again] == [ids for ids, _ in fresh]
    for (_, a), (_, b) in zip(again, fresh, strict=True):
        assert a == pytest.approx(b, abs=1e-6)


def test_a_kept_engine_that_fails_to_set_up_raises_its_error_and_ends(ray_session, tiny_qwen3_dir, tmp_path):
    """A kept engine process set up again with a model that is not there: the pool raises the
    set-up's own error (not a missing server's) and ends the process instead of keeping it idle."""
    import ray

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))
    cfg = RolloutConfig(num_engines=1, batch_size=4, n_samples_per_prompt=4, max_response_len=4)
    missing = tmp_path / "no_model_here"
    with rlx.actor_reuse.keep_actors():
        RolloutPool(cfg, str(tiny_qwen3_dir), tokenizer, seed=0, reward=TOY_REWARD).shutdown()
        ((_, _, engine),) = rlx.actor_reuse._kept["engine"]
        with pytest.raises(Exception, match="no_model_here") as failed:
            RolloutPool(cfg, str(missing), tokenizer, seed=0, reward=TOY_REWARD)
        assert "NoneType" not in str(failed.value)
        assert rlx.actor_reuse._kept["engine"] == []  # taken, and not handed back
        # ray.kill is asynchronous: a call that arrives before it lands is still served (the
        # set-up's error again); the process must be gone within a bounded time
        deadline = time.monotonic() + 60
        with pytest.raises(ray.exceptions.RayActorError):
            while time.monotonic() < deadline:
                try:
                    ray.get(engine.url.remote(), timeout=60)
                except ray.exceptions.RayActorError:
                    raise
                except Exception:
                    pass
                time.sleep(0.2)


WARM = ("rlx.engine.serve", "rlx.engine.model_runner", "transformers.models.auto.tokenization_auto")


def _engine_process(actor) -> tuple[int, bool]:
    """(the engine actor's pid, whether its process has imported the engine's code and what it
    loads before the weights: the runner, transformers' tokenizer classes)."""
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: (os.getpid(), all(m in sys.modules for m in WARM))))


def test_engines_started_early_warm_up_and_are_the_ones_the_pool_sets_up(ray_session, tiny_qwen3_dir):
    """A colocated run starts its engines' processes while the trainer sets up (`EarlyEngines`):
    each imports the engine's code and reads the checkpoint's config and tokenizer before it is set
    up; the pool then sets up those processes
    (no new one) and they serve; processes no pool took are ended by `kill()`, a kept one too."""

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))
    cfg = RolloutConfig(num_engines=1, batch_size=4, n_samples_per_prompt=4, max_response_len=4)
    options = [{"num_cpus": 0}]
    with rlx.actor_reuse.keep_actors():  # a pool of its own, empty: new processes
        early = EarlyEngines(cfg, options, str(tiny_qwen3_dir))
        (actor,) = early.actors
        pid, warm = _engine_process(actor)  # answered after `warm_up` (an actor's calls run in order)
        assert warm
        pool = RolloutPool(cfg, str(tiny_qwen3_dir), tokenizer, seed=0, reward=TOY_REWARD, actor_options=options,
                           early=early)  # fmt: skip
        try:
            assert pool.engines.actors == [actor] and _engine_process(actor)[0] == pid
            prompt = Sample(prompt="1 2 3 =", prompt_ids=tokenizer("1 2 3 =")["input_ids"], label="1 2 3")
            samples, _ = pool.generate([prompt], version=0)
            assert len(samples) == 4 and all(1 <= s.response_len <= 4 for s in samples)
            early.kill()  # taken: not this one's to end
            assert _engine_process(actor)[0] == pid
        finally:
            pool.shutdown()
        unused = EarlyEngines(
            cfg, options, str(tiny_qwen3_dir)
        )  # takes the process the pool handed back (keep_actors)
        assert unused.actors == [actor] and rlx.actor_reuse._kept["engine"] == []
        unused.kill()
        assert _dies(actor), "the engine process outlived EarlyEngines.kill by 60 s"


def _dies(actor, within_s: float = 60.0) -> bool:
    """Whether calls to `actor` fail as a dead actor's within `within_s`: `ray.kill` is asynchronous,
    and a call sent right after it may still be served (here: a handed-back engine, whose server is
    stopped, raising AttributeError) before the kill lands."""
    import time

    import ray

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.url.remote(), timeout=within_s)
        except ray.exceptions.RayActorError:
            return True
        except ray.exceptions.RayTaskError:  # served by the still-living process
            time.sleep(0.1)
    return False


def test_an_engine_warm_up_that_fails_leaves_the_error_to_the_set_up(tmp_path, caplog):
    """A checkpoint the warm-up cannot read: it logs and returns (the set-up raises the error)."""
    from rlx.rollout.engine_actor import EngineActor

    missing = tmp_path / "no_model_here"
    with caplog.at_level("WARNING", logger="rlx.rollout.engine_actor"):
        EngineActor().warm_up("rlx.rollout.launchers.LocalLauncher", str(missing))
    assert "warm-up" in caplog.text and "no_model_here" in caplog.text
