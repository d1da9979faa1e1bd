"""`with_engine_dtype`: which dtype rlx's engine serves a checkpoint in, by trainer precision."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rlx.rollout.config import RolloutConfig
from rlx.rollout.servers import with_engine_dtype


def checkpoint(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    return tmp_path


@pytest.mark.parametrize("config", [{"dtype": "float32"}, {"torch_dtype": "float32"}, {}])
def test_an_fp32_checkpoint_on_gpus_is_served_in_the_trainers_precision(tmp_path, config):
    cfg = RolloutConfig(engine_args={"mem_fraction_static": 0.5})
    out = with_engine_dtype(cfg, "bfloat16", checkpoint(tmp_path, **config), gpus=True)
    assert out.engine_args == {"mem_fraction_static": 0.5, "dtype": "bfloat16"}
    assert cfg.engine_args == {"mem_fraction_static": 0.5}  # the run's config is not changed


@pytest.mark.parametrize(
    "why, cfg, precision, config, gpus",
    [
        ("a bf16 checkpoint stays bf16 (auto)", RolloutConfig(), "bfloat16", {"dtype": "bfloat16"}, True),
        ("an fp32 trainer", RolloutConfig(), "float32", {"dtype": "float32"}, True),
        ("CPU engines are fp32", RolloutConfig(), "bfloat16", {"dtype": "float32"}, False),
        ("the user chose", RolloutConfig(engine_args={"dtype": "float32"}), "bfloat16", {}, True),
        ("SGLang has its own rule", RolloutConfig(_target_="rlx.rollout.servers.SGLangServer"), "bfloat16", {}, True),
    ],
)  # fmt: skip
def test_left_alone(tmp_path, why, cfg, precision, config, gpus):
    assert with_engine_dtype(cfg, precision, checkpoint(tmp_path, **config), gpus) == replace(cfg), why
