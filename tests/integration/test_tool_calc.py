"""`+experiment=tool_calc` end to end on CPU: the tiny Qwen3 learns to call the sandboxed calculator
and copy its result, through the whole loop (Ray, the local engine, the Megatron trainer); the
GPU variant composes and validates. The full 100-step curve is in docs/tasks.md."""

from __future__ import annotations

import json

import pytest

from rlx.config.compose import compose, to_object
from rlx.config.validate import validate
from rlx.errors import ConfigError
from rlx.runtime import run

CALL, EOS = 15, 1  # "?" and <eos> in the tiny vocabulary


def test_both_experiments_compose_and_validate():
    cpu, gpu = (to_object(compose([f"+experiment={name}"])) for name in ("tool_calc", "tool_calc_gpu"))
    for rc in (cpu, gpu):
        validate(rc)
        assert rc.rollout.generate_fn == "examples.tool_calc.generate.generate"
        assert rc.reward.fn == "examples.tool_calc.reward.answer_reward"
        assert rc.data._target_ == "examples.tool_calc.data.CalcSource"
        # room for three turns of n + 2 tokens: call, calculator output, answer
        assert rc.rollout.max_response_len == 3 * (rc.data.toy_num_digits + 2)
    assert (cpu.cluster.gpus_per_node, cpu.model.num_layers, cpu.model.hidden_size) == (0, 2, 64)
    assert (gpu.cluster.gpus_per_node, gpu.cluster.colocate) == (1, True)
    assert (gpu.model.num_layers, gpu.model.hidden_size, gpu.model.vocab_size) == (16, 1024, 16)


def test_a_toy_task_the_calculator_source_does_not_know_fails_at_compose():
    with pytest.raises(
        ConfigError, match=r"data.toy_task='reverse' is not one of \['add', 'sub', 'add_sub'\]"
    ):
        validate(to_object(compose(["+experiment=tool_calc", "data.toy_task=reverse"])))


@pytest.mark.slow
def test_the_model_learns_to_call_the_calculator_and_copy_its_answer(tmp_path):
    num_steps = 30
    history = run(
        compose(
            [
                "+experiment=tool_calc",
                f"run.output_dir={tmp_path}",
                f"run.num_rollout={num_steps}",
                "run.progress=false",
            ]
        )
    )
    rewards = [h["rollout/reward_mean"] for h in history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first <= 0.05, rewards  # a random model rarely calls the tool, so it scores about 0
    # seeded: 0.02 -> 0.13 here (2026-11-23); the 100-step run reaches 0.31 (docs/tasks.md)
    assert last >= first + 0.08, rewards

    rows = [json.loads(line) for line in (tmp_path / "rollouts" / f"step_{num_steps - 1:06d}.jsonl").open()]
    called = [r for r in rows if r["metadata"].get("tool_calls")]
    assert len(called) >= len(rows) // 2, "most samples call the calculator by now"
    # the policy still samples: a rare call is malformed (seen on a loaded 2-core machine, 2026-11-27,
    # where the engine batches requests otherwise and a near-tie token can flip), so nearly every
    # call, not every one, is a single call that copies the prompt and gets an answer; those are
    # checked in detail
    copied = [
        r
        for r in called
        if len(calls := r["metadata"]["tool_calls"]) == 1
        and calls[0]["ok"]
        and calls[0]["input"] == r["prompt"].removesuffix(" =")
    ]
    assert len(copied) >= 0.9 * len(called), (len(copied), len(called))
    for r in copied:
        tool_ids = [t for t, m in zip(r["response_ids"], r["loss_mask"], strict=True) if m == 0]
        # the calculator's answer, n + 1 digits and "=", is the only untrained span, right after "?"
        start = r["loss_mask"].index(0)
        assert r["response_ids"][start - 1] == CALL and len(tool_ids) == 4
        assert r["loss_mask"][start : start + 4] == [0] * 4 and 0 not in r["loss_mask"][start + 4 :]
        assert r["rollout_logprobs"][start : start + 4] == [0.0] * 4
    assert all(r["reward"] == 0.0 for r in rows if r not in called)
