"""Every shipped config composes and validates; every rule fails with a message naming its keys. CPU."""

from __future__ import annotations

import json

import pytest
from test_from_checkpoint import SMOLLM2

from rlx.algo.config import AlgoConfig
from rlx.config import build
from rlx.config.compose import CONF_DIR, compose, to_object
from rlx.config.schema import RlxConfig
from rlx.config.validate import validate
from rlx.errors import ConfigError

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and not p.name.startswith("hydra"))
OPTIONS = [(group, p.stem) for group in GROUPS for p in sorted((CONF_DIR / group).glob("*.yaml"))]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "3 7 1 =", "label": "1 7 3"}) + "\n")
    return path


CLUSTER_NEEDS = {
    "1x8": ["rollout.num_engines=4"],
    "2x8": ["rollout.num_engines=8", "train.micro_batch_size=32"],
    "4x8": ["rollout.num_engines=16", "train.micro_batch_size=16"],
}


def needs(group: str, option: str, prompts) -> list[str]:
    """Overrides an option cannot do without (the values it leaves ??? or null by design)."""
    if (group, option) == ("data", "jsonl"):
        # a file source of no particular task: its reward, and a length the tiny model's 64 positions hold
        return [
            f"data.prompt_path={prompts}",
            "reward.fn=rlx.reward.toy.exact_match",
            "rollout.max_response_len=4",
        ]
    if (group, option) == ("data", "math"):
        # 1024-token answers need a real model's context (its checkpoint, as for the full-size models)
        return [f"data.prompt_path={prompts}", "model=qwen3_4b", *needs("model", "qwen3_4b", prompts)]
    if group == "model" and not option.startswith("tiny_"):
        # Full-size models need the user's downloaded checkpoint; validation wants a config.json.
        checkpoint = prompts.parent / "hf_checkpoint"
        checkpoint.mkdir(exist_ok=True)
        (checkpoint / "config.json").write_text("{}")
        return [f"model.hf_checkpoint={checkpoint}"]
    if (group, option) == ("experiment", "smollm2_arithmetic"):
        # its model and task live in rlx's cache once their tools wrote them; here: stand-ins
        checkpoint = prompts.parent / "smollm2"
        checkpoint.mkdir(exist_ok=True)
        (checkpoint / "config.json").write_text(json.dumps(SMOLLM2))
        return [f"model.hf_checkpoint={checkpoint}", f"data.prompt_path={prompts}",
                f"data.eval.test_greedy.path={prompts}", f"data.eval.test.path={prompts}"]  # fmt: skip
    if group == "cluster":
        # A GPU cluster's engines fill its rollout GPUs (rollout.num_engines is the rollout
        # group's key), and its data-parallel size must divide the default batch of 256.
        return CLUSTER_NEEDS.get(option, [])
    if (group, option) == ("rollout", "sglang"):
        # SGLang cannot be installed here: its launcher points at rlx's engine CLI, which takes
        # the same flags (tests/integration/test_e2e.py runs it); without it validation refuses.
        return ["rollout.server_module=rlx.engine.serve"]
    return []


def test_default_composes_to_the_embedded_job():
    cfg = compose()
    rc = to_object(cfg)
    assert isinstance(rc, RlxConfig)
    assert (rc.model.name, rc.model.num_layers, rc.model.hidden_size) == ("tiny_qwen3", 2, 64)
    assert rc.algo._target_ == "rlx.algo.grpo.GRPO"
    assert (rc.rollout.batch_size, rc.rollout.n_samples_per_prompt, rc.rollout.max_response_len) == (32, 8, 4)
    assert (rc.train.global_batch_size, rc.train.micro_batch_size, rc.train.lr) == (
        256,
        64,
        2e-3,
    )  # the toy task's
    assert rc.data._target_ == "rlx.data.toy.ToySource"


def test_a_file_task_trains_at_a_pretrained_models_learning_rate(prompts):
    rc = to_object(compose(["data=math", f"data.prompt_path={prompts}", "rollout.max_response_len=8"]))
    assert rc.train.lr == 1e-6  # not the toy task's 2e-3, which would wreck a pretrained model


def test_every_group_has_options():
    assert set(GROUPS) >= {"model", "algo", "cluster", "rollout", "data"}


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_shipped_option_composes_and_validates(group, option, prompts):
    # experiments are overlays (`# @package _global_`) added with `+experiment=NAME`
    prefix = "+" if group == "experiment" else ""
    overrides = [f"{prefix}{group}={option}", *needs(group, option, prompts)]
    cfg = compose(overrides)
    validate(to_object(cfg))  # the dataclass form validates too


def test_global_batch_size_follows_the_rollout_batch_in_sweeps():
    assert compose(["rollout.n_samples_per_prompt=4"]).train.global_batch_size == 32 * 4
    assert compose(["train.global_batch_size=128", "rollout.batch_size=16"]).train.global_batch_size == 128


def test_build_passes_the_dataclass():
    algo = build(compose().algo)
    assert type(algo).__name__ == "GRPO"
    assert isinstance(algo.cfg, AlgoConfig)


def test_misspelled_key_fails_naming_it():
    with pytest.raises(ConfigError, match=r"rollout\.batch_szie"):
        compose(["rollout.batch_szie=4"])


def test_wrong_type_fails_naming_the_key():
    with pytest.raises(ConfigError, match=r"train\.lr=abc: abc is not a number; set train\.lr to a number"):
        compose(["train.lr=abc"])


def test_unknown_option_fails_listing_the_options():
    with pytest.raises(ConfigError, match=r"model=nope: no option nope in model.*the options: .*tiny_qwen3"):
        compose(["model=nope"])


def test_broken_batch_equation_names_all_four_keys_and_the_fix():
    with pytest.raises(ConfigError) as e:
        compose(["train.global_batch_size=128"])
    msg = str(e.value)
    for part in (
        "rollout.batch_size=32",
        "rollout.n_samples_per_prompt=8",
        "train.global_batch_size=128",
        "train.num_steps_per_rollout=1",
        "set train.global_batch_size=256 or rollout.batch_size=16",
    ):
        assert part in msg


# (overrides, fragments the one message must contain) for each other rule
FAILURES = {
    "micro batch x DP": (
        ["cluster.num_trainer_procs=2", "train.micro_batch_size=256"],
        [
            "train.global_batch_size=256",
            "train.micro_batch_size=256",
            "data-parallel size 2",
            "set train.micro_batch_size=128",
        ],
    ),
    "procs vs TP x PP": (
        ["cluster.num_trainer_procs=3", "cluster.tensor_parallel_size=2"],
        [
            "cluster.num_trainer_procs=3",
            "cluster.tensor_parallel_size=2",
            "cluster.pipeline_parallel_size=1",
            "multiple of 2",
        ],
    ),
    "procs vs GPUs": (
        ["cluster.gpus_per_node=2", "cluster.num_trainer_procs=4"],
        ["cluster.gpus_per_node=2", "set cluster.num_trainer_procs <= 2"],
    ),
    "kl_loss_type": (
        ["algo.kl_loss_type=k4"],
        ["algo.kl_loss_type='k4'", "low_var_kl", "set algo.kl_loss_type=k1"],
    ),
    "loss_agg": (
        ["algo.loss_agg=seq_mean"],
        ["algo.loss_agg='seq_mean'", "token_mean", "sample_mean", "set algo.loss_agg=token_mean"],
    ),
    "precision": (["train.precision=fp8"], ["train.precision='fp8'", "bf16", "set train.precision=fp32"]),
    "on_bad_sample": (
        ["data.on_bad_sample=ignore"],
        ["data.on_bad_sample='ignore'", "skip", "set data.on_bad_sample=error"],
    ),
    "temperature": (
        ["rollout.temperature=-0.5"],
        ["rollout.temperature=-0.5", "set rollout.temperature to a value >= 0"],
    ),
    "top_p zero": (["rollout.top_p=0"], ["rollout.top_p=0.0", "set rollout.top_p to a value in (0, 1]"]),
    "top_p above 1": (["rollout.top_p=1.5"], ["rollout.top_p=1.5", "set rollout.top_p to a value in (0, 1]"]),
    "eps_clip": (["algo.eps_clip=0"], ["algo.eps_clip=0.0", "set algo.eps_clip to a value > 0"]),
    "lr": (["train.lr=-1e-3"], ["train.lr=-0.001", "set train.lr to a value > 0"]),
    "group size": (
        ["rollout.n_samples_per_prompt=1", "train.global_batch_size=32"],
        ["rollout.n_samples_per_prompt=1", "needs >= 2", "set rollout.n_samples_per_prompt=8"],
    ),
    "response vs context": (
        ["rollout.max_response_len=64"],
        ["rollout.max_response_len=64", "model.max_position_embeddings=64", "lower rollout.max_response_len"],
    ),
    "prompt + response filling the context": (
        ["data.max_prompt_len=60"],
        ["data.max_prompt_len=60", "reaches model.max_position_embeddings=64", "set data.max_prompt_len=59"],
    ),
    "prompt + response vs context": (
        ["data.max_prompt_len=62"],
        ["data.max_prompt_len=62", "rollout.max_response_len=4", "set data.max_prompt_len=59"],
    ),
    "checkpoint not a dir": (
        ["model.hf_checkpoint=/no/such/dir"],
        ["model.hf_checkpoint='/no/such/dir'", "not a directory", "point it at an HF model directory"],
    ),
    "checkpoint without config.json": (
        ["model.hf_checkpoint={tmp}"],
        ["model.hf_checkpoint=", "no config.json", "point it at an HF model directory"],
    ),
    "no checkpoint and not tiny": (
        ["model.tiny=false"],
        [
            "model.hf_checkpoint is not set",
            "model.tiny=false",
            "set model.hf_checkpoint=/path/to/hf_model_dir",
        ],
    ),
    "target does not import": (
        ["algo._target_=rlx.algo.nope.Nope"],
        [
            "algo._target_='rlx.algo.nope.Nope'",
            "cannot be imported",
            "set algo._target_ to an importable class",
            "algo=dr_grpo|grpo",
        ],
    ),
    "target is not a class": (
        ["data._target_=rlx.reward.toy.exact_match"],
        ["data._target_=", "not a class", "set data._target_ to an importable class"],
    ),
    "reward fn does not import": (
        ["reward.fn=rlx.reward.toy.nope"],
        ["reward.fn='rlx.reward.toy.nope'", "fix: give the dotted path of a function"],
    ),
    "jsonl without prompt_path": (["data=jsonl"], ["data.prompt_path is not set", "set data.prompt_path="]),
    "jsonl prompt_path missing": (
        ["data=jsonl", "data.prompt_path=/no/such.jsonl"],
        ["data.prompt_path='/no/such.jsonl'", "no such file"],
    ),
    "toy task": (["data.toy_task=sort"], ["data.toy_task='sort'", "reverse"]),
    "weight_sync": (
        ["rollout.weight_sync=nccl"],
        ["rollout.weight_sync='nccl'", "distributed", "set rollout.weight_sync=auto"],
    ),
    "CUDA IPC across GPUs": (
        ["cluster=1x8", "rollout.num_engines=4", "rollout.weight_sync=tensor"],
        ["rollout.weight_sync=tensor", "cluster.colocate=false", "set rollout.weight_sync=distributed"],
    ),
    "colocate on CPU": (
        ["cluster.colocate=true"],
        ["cluster.colocate=true", "cluster.gpus_per_node=0", "set cluster.colocate=false"],
    ),
    "colocate over engines of 2 GPUs": (
        [
            "cluster=1x8",
            "cluster.colocate=true",
            "rollout.num_engines=2",
            "rollout.gpus_per_engine=2",
            "rollout._target_=rlx.rollout.launchers.SGLangLauncher",
            "rollout.server_module=rlx.engine.serve",
        ],
        ["cluster.colocate=true", "rollout.gpus_per_engine=2", "set rollout.gpus_per_engine=1"],
    ),  # fmt: skip
    "an argument of rlx's engine given to SGLang's": (
        [
            "rollout=sglang",
            "rollout.server_module=rlx.tools.export",
            "+rollout.engine_args.admission_group=8",
        ],
        [
            "rollout.engine_args.admission_group is an argument of rlx's engine (rollout=local)",
            "rlx.tools.export does not take",
            "remove it or use rollout=local",
        ],
    ),  # fmt: skip
    "a KV cache dtype rlx's engine lacks": (
        ["+rollout.engine_args.kv_cache_dtype=fp4_e2m1"],
        [
            "rollout.engine_args.kv_cache_dtype=fp4_e2m1 is no KV cache dtype of rlx's engine (rollout=local)",
            "set it to auto or one of fp8_e4m3, fp8_e5m2, bf16, bfloat16",
        ],
    ),  # fmt: skip
    "colocated SGLang without its memory saver": (
        [
            "cluster=1gpu",
            "rollout=sglang",
            "rollout.server_module=rlx.engine.serve",
            "+rollout.engine_args.enable_memory_saver=false",
        ],
        ["cluster.colocate=true", "rollout.engine_args.enable_memory_saver=false", "remove that key"],
    ),  # fmt: skip
    "lr_decay": (
        ["train.lr_decay=linear"],
        ["train.lr_decay='linear'", "cosine", "set train.lr_decay=constant"],
    ),
    "lr_warmup_steps": (
        ["train.lr_warmup_steps=-1"],
        ["train.lr_warmup_steps=-1", "set train.lr_warmup_steps to a value >= 0"],
    ),
    "Dr. GRPO without its divisor": (
        ["algo=dr_grpo", "algo.loss_norm_len=null"],
        ["algo.loss_agg=seq_mean_token_sum_norm", "algo.loss_norm_len", "set algo.loss_norm_len"],
    ),
}


@pytest.mark.parametrize("overrides, fragments", FAILURES.values(), ids=FAILURES.keys())
def test_each_rule_fails_naming_its_keys(overrides, fragments, tmp_path):
    with pytest.raises(ConfigError) as e:
        compose([o.format(tmp=tmp_path) for o in overrides])
    for fragment in fragments:
        assert fragment in str(e.value)


def test_an_engine_switch_the_engine_would_refuse_is_refused_when_composing(monkeypatch):
    """RLX_ENGINE_PDL and RLX_ENGINE_SMALL_GEMM, which rlx's engines read from the environment they
    inherit, are checked before anything starts (the engine itself would refuse them mid-start)."""
    monkeypatch.setenv("RLX_ENGINE_PDL", "on")
    monkeypatch.setenv("RLX_ENGINE_SMALL_GEMM", "yes")
    with pytest.raises(ConfigError, match=r"invalid config \(2 problems\)") as e:
        compose([])
    for fragment in (
        "RLX_ENGINE_PDL='on': use 0 (off), 1 (wait) or 2 (wait, then launch the next), or unset it",
        "RLX_ENGINE_SMALL_GEMM='yes': use 1 (on, where it pays) or 0 (off), or unset it",
        "(the environment rlx's engines inherit, rollout=local)",
    ):
        assert fragment in str(e.value)
    monkeypatch.setenv("RLX_ENGINE_PDL", "0")
    monkeypatch.setenv("RLX_ENGINE_SMALL_GEMM", "0")
    compose([])


def test_all_violations_are_reported_together():
    with pytest.raises(ConfigError, match=r"invalid config \(3 problems\)") as e:
        compose(["algo.eps_clip=0", "train.lr=0", "train.precision=fp8"])
    for key in ("algo.eps_clip=0.0", "train.lr=0.0", "train.precision='fp8'"):
        assert key in str(e.value)


def test_expert_parallel_sizes_are_checked_before_anything_starts():
    from rlx.config.compose import compose
    from rlx.errors import ConfigError

    with pytest.raises(ConfigError, match="cluster.expert_parallel_size=2 needs model.num_moe_experts"):
        compose(["cluster.num_trainer_procs=2", "cluster.expert_parallel_size=2"])  # a dense model
    with pytest.raises(
        ConfigError, match="not divisible by cluster.tensor_parallel_size × cluster.expert_parallel_size"
    ):
        compose(["model=tiny_qwen3_moe", "cluster.num_trainer_procs=2", "cluster.tensor_parallel_size=2",
                 "cluster.expert_parallel_size=2"])  # fmt: skip
    compose(["model=tiny_qwen3_moe", "cluster.num_trainer_procs=2", "cluster.expert_parallel_size=2"])


def test_a_launch_validates_its_config_once(monkeypatch):
    """`compose` validates; the loop's own check (`validate_once`, rlx.runtime) passes the same
    unchanged config without running the rules again, and checks a config changed since."""
    import rlx.config.validate as v

    cfg = compose(["run.seed=3"])
    calls = []
    checked = v._targets
    monkeypatch.setattr(v, "_targets", lambda *a: calls.append(1) or checked(*a))
    v.validate_once(cfg)
    assert calls == []
    cfg.rollout.temperature = -1.0  # changed after composing: checked again, and refused
    with pytest.raises(ConfigError, match="rollout.temperature"):
        v.validate_once(cfg)
    assert calls == [1]
