"""What engine launchers declare about themselves (`rlx.rollout.launchers`): the engine arguments a
run adds for its trainer's precision and its placement (`for_run`), read through the run's
`rollout._target_` as the loop reads them, never from the class's name."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rlx.rollout.config import RolloutConfig
from rlx.rollout.launchers import EngineLauncher, for_run

SGLANG = "rlx.rollout.launchers.SGLangLauncher"


def checkpoint(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    return tmp_path


SIZED = ("max_running_requests", "cuda_graph_max_bs")  # `engine_args_for_batch`'s keys, tested on their own


def run(tmp_path, cfg, *, precision="bfloat16", config=None, gpus=True, colocated=False, sized=False):
    """`for_run`'s config; without `sized`, less the batch-sized keys rlx's engine gets on GPUs."""
    hf_dir = checkpoint(tmp_path, **(config or {}))
    out = for_run(cfg, colocated=colocated, precision_dtype=precision, hf_dir=hf_dir, gpus=gpus)
    if sized or not gpus:
        return out
    return replace(
        out, engine_args={k: v for k, v in out.engine_args.items() if k not in SIZED or k in cfg.engine_args}
    )


@pytest.mark.parametrize("config", [{"dtype": "float32"}, {"torch_dtype": "float32"}, {}])
def test_an_fp32_checkpoint_on_gpus_is_served_in_the_trainers_precision(tmp_path, config):
    cfg = RolloutConfig(engine_args={"mem_fraction_static": 0.5})
    out = run(tmp_path, cfg, config=config)
    assert out.engine_args == {"mem_fraction_static": 0.5, "dtype": "bfloat16"}
    assert cfg.engine_args == {"mem_fraction_static": 0.5}  # the run's config is not changed


@pytest.mark.parametrize(
    "why, cfg, precision, config, gpus",
    [
        ("a bf16 checkpoint stays bf16 (auto)", RolloutConfig(), "bfloat16", {"dtype": "bfloat16"}, True),
        ("an fp32 trainer", RolloutConfig(), "float32", {"dtype": "float32"}, True),
        ("CPU engines are fp32", RolloutConfig(), "bfloat16", {"dtype": "float32"}, False),
        ("the user chose", RolloutConfig(engine_args={"dtype": "float32"}), "bfloat16", {}, True),
        ("SGLang has its own rule", RolloutConfig(_target_=SGLANG), "bfloat16", {}, True),
    ],
)  # fmt: skip
def test_dtype_left_alone(tmp_path, why, cfg, precision, config, gpus):
    assert run(tmp_path, cfg, precision=precision, config=config, gpus=gpus) == replace(cfg), why


def test_colocated_sglang_engines_get_the_memory_saver(tmp_path):
    """Without it SGLang's /release_memory_occupation frees nothing and the trainer finds its GPU full."""
    cfg = RolloutConfig(_target_=SGLANG, engine_args={"mem_fraction_static": 0.5})
    out = run(tmp_path, cfg, colocated=True)
    assert out.engine_args == {"mem_fraction_static": 0.5, "enable_memory_saver": True}
    assert cfg.engine_args == {"mem_fraction_static": 0.5}


@pytest.mark.parametrize(
    "why, cfg, colocated",
    [
        ("split engines keep their memory", RolloutConfig(_target_=SGLANG), False),
        ("rlx's engine on CPUs: no CUDA graphs", RolloutConfig(engine_args={"dtype": "float32"}), True),
        ("the user chose", RolloutConfig(engine_args={"dtype": "float32", "enable_memory_saver": False}), True),
        ("the user chose", RolloutConfig(_target_=SGLANG, engine_args={"enable_memory_saver": True}), True),
    ],
)  # fmt: skip
def test_memory_saver_left_alone(tmp_path, why, cfg, colocated):
    gpus = "CPUs" not in why
    assert run(tmp_path, cfg, colocated=colocated, gpus=gpus) == replace(cfg), why


def test_colocated_local_engines_on_gpus_get_the_memory_saver(tmp_path):
    """rlx's engine keeps its addresses through a release (its decode graphs survive); split
    engines are never released and are left as configured."""
    cfg = RolloutConfig(engine_args={"dtype": "bfloat16"})
    assert run(tmp_path, cfg, colocated=True).engine_args == {
        "dtype": "bfloat16",
        "enable_memory_saver": True,
    }
    assert run(tmp_path, cfg, colocated=False) == replace(cfg)
    fp32 = run(tmp_path, RolloutConfig(), colocated=True, config={"dtype": "float32"})
    assert fp32.engine_args == {"enable_memory_saver": True, "dtype": "bfloat16"}


@pytest.mark.parametrize(
    "rollout, running, graphs",
    [
        (dict(batch_size=32, n_samples_per_prompt=8), 256, 256),  # the defaults: 256 samples
        (dict(batch_size=10, n_samples_per_prompt=3), 256, 256),  # never below the engine's default
        (dict(batch_size=64, n_samples_per_prompt=8), 512, 512),
        (dict(batch_size=33, n_samples_per_prompt=8), 272, 272),  # 264, up to a multiple of 16
        (dict(batch_size=128, n_samples_per_prompt=16, num_engines=2), 1024, 1024),  # 1,024 an engine
        (dict(batch_size=300, n_samples_per_prompt=16), 1024, 1024),  # 4,800: at most 1,024
        (dict(batch_size=32, over_sampling_batch_size=48, n_samples_per_prompt=8), 384, 384),
        (dict(batch_size=64, engine_args={"max_running_requests": 128}), 128, 128),  # the user's cap
        (dict(batch_size=64, engine_args={"cuda_graph_max_bs": 64}), 512, 64),  # the user's graphs
        (dict(batch_size=64, engine_args={"max_batch_size": 128}), 128, 128),  # SGLang's alias too
    ],
)  # fmt: skip
def test_local_engines_on_gpus_decode_their_share_of_the_batch_at_once(tmp_path, rollout, running, graphs):
    """rlx's engine on GPUs: the running cap is the engine's share of a step's samples (groups
    launched x samples a group / engines), from 256 to 1,024; decode graphs up to it.
    The memory plan reads the same values (`rlx.memory.engine.engine_arg`)."""
    from rlx.memory.engine import engine_arg
    from rlx.memory.terms import Setup

    cfg = RolloutConfig(**rollout)
    out = run(tmp_path, cfg, sized=True)
    assert (out.engine_args["max_running_requests"], out.engine_args["cuda_graph_max_bs"]) == (
        running,
        graphs,
    )
    setup = Setup(model=None, train=None, cluster=None, rollout=cfg)
    assert (engine_arg(setup, "max_running_requests"), engine_arg(setup, "cuda_graph_max_bs")) == (
        running,
        graphs,
    )
    assert run(tmp_path, cfg, gpus=False) == replace(cfg)  # CPU engines: as set
    sglang = run(tmp_path, replace(cfg, _target_=SGLANG), sized=True)  # SGLang sizes its own
    assert sglang.engine_args == cfg.engine_args


class BareLauncher:
    """A user's launcher that declares nothing: its engines get the config as written."""


class OneGpuFp16(EngineLauncher):
    max_gpus_per_engine = 1

    @classmethod
    def for_run(cls, cfg, **run):
        return replace(cfg, engine_args={"dtype": "float16"})


def test_a_launcher_of_the_users_own_is_read_by_what_it_declares(tmp_path):
    bare = RolloutConfig(_target_=f"{__name__}.BareLauncher")
    assert run(tmp_path, bare, colocated=True) == replace(bare)
    own = RolloutConfig(_target_=f"{__name__}.OneGpuFp16")
    assert run(tmp_path, own).engine_args == {"dtype": "float16"}


def test_a_launchers_gpu_limit_and_placement_needs_are_checked_when_composing(tmp_path):
    """The composer reads `max_gpus_per_engine` and `placement_errors` of whatever class
    `rollout._target_` names (here a user's launcher capped at one GPU, over two)."""
    from rlx.config.compose import compose
    from rlx.errors import ConfigError

    target = f"rollout._target_={__name__}.OneGpuFp16"
    with pytest.raises(ConfigError) as e:
        compose(["cluster=1x8", target, "rollout.gpus_per_engine=2", "rollout.num_engines=2"])
    assert "rollout.gpus_per_engine=2" in str(e.value) and "at most 1 GPU" in str(e.value)
