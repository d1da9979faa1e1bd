"""`with_engine_dtype` and `with_memory_saver`: how a run's engine arguments follow its trainer precision and placement."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rlx.rollout.config import RolloutConfig
from rlx.rollout.servers import with_engine_dtype, with_memory_saver


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


SGLANG = "rlx.rollout.servers.SGLangServer"


def test_colocated_sglang_engines_get_the_memory_saver():
    """Without it SGLang's /release_memory_occupation frees nothing and the trainer finds its GPU full."""
    cfg = RolloutConfig(_target_=SGLANG, engine_args={"mem_fraction_static": 0.5})
    out = with_memory_saver(cfg, colocated=True)
    assert out.engine_args == {"mem_fraction_static": 0.5, "enable_memory_saver": True}
    assert cfg.engine_args == {"mem_fraction_static": 0.5}


@pytest.mark.parametrize(
    "why, cfg, colocated",
    [
        ("split engines keep their memory", RolloutConfig(_target_=SGLANG), False),
        ("rlx's engine releases memory itself", RolloutConfig(), True),
        ("the user chose", RolloutConfig(_target_=SGLANG, engine_args={"enable_memory_saver": True}), True),
    ],
)  # fmt: skip
def test_memory_saver_left_alone(why, cfg, colocated):
    assert with_memory_saver(cfg, colocated) == replace(cfg), why
