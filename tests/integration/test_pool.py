"""The rollout pool through Ray: two engines behind the real sglang-router serve one rollout."""

from __future__ import annotations

import asyncio

import pytest
from conftest import write_tiny_qwen3
from transformers import AutoTokenizer

from rlx.rollout.client import EngineClient
from rlx.rollout.config import RolloutConfig
from rlx.rollout.pool import RolloutPool
from rlx.sample import Sample, Status
from rlx.trainer.weights import write_weight_shards


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
    pool = RolloutPool(cfg, str(tiny_qwen3_dir), tokenizer, seed=0)
    try:
        assert pool.router is not None and pool.url == pool.router.url
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
        served = [_requests_served(url) for url in pool.engine_urls]
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
