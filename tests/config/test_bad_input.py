"""The bad-input catalogue (docs/errors.md), the entries not covered by test_compose.py and
test_cluster.py: keys that do not exist, wrong types, unknown options, keys their switch leaves
unused, a GPU config without the GPUs, and broken checkpoints. Each asserts that the message names
the key (or file and tensor) and the fix. CPU, no Ray, no model built."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlx.config import build
from rlx.config.compose import compose, to_object
from rlx.config.layout import check_gpus, gpu_shortfall
from rlx.errors import CheckpointError, ConfigError, UserError
from rlx.models.checkpoint_checks import check_checkpoint

# id: (overrides, fragments the message must contain: the key, what is wrong, the fix)
CONFIG_CASES = {
    "misspelled key": (
        ["rollout.batch_szie=4"],
        ["rollout.batch_szie does not exist", "did you mean rollout.batch_size? set rollout.batch_size="],
    ),
    "unknown key added with +": (
        ["+run.eval_intervall=1"],
        ["run.eval_intervall does not exist", "leading +", "did you mean run.eval_interval?"],
    ),
    "unknown plugin key added with +": (
        ["+rollout.custom_generate_fn=my.module.generate"],
        ["rollout.custom_generate_fn does not exist", "rollout.engine_args", "set rollout."],
    ),
    "pass-through key without +": (
        ["model.megatron_overrides.recompute_granularity=full"],
        ["model.megatron_overrides.recompute_granularity", "+model.megatron_overrides.recompute_granularity="],
    ),
    "+group that does not exist": (
        ["+experimant=fast"],
        ["experimant is neither a config group", "conf/experimant", "remove +experimant="],
    ),
    "+experiment that does not exist": (
        ["+experiment=tool_calk"],
        ["experiment=tool_calk: no option tool_calk in experiment", "did you mean experiment=tool_calc?"],
    ),
    "misspelled key of an eval set": (
        ["+data.eval={math:{pth:/data/math.jsonl}}"],
        ["data.eval.math.pth does not exist", "did you mean data.eval.math.path? set data.eval.math.path="],
    ),
    "wrong type: number": (["train.lr=abc"], ["train.lr=abc", "not a number", "set train.lr to a number"]),
    "wrong type: integer": (["run.seed=1.5"], ["run.seed=1.5", "not an integer", "set run.seed to an integer"]),
    "wrong type: bool": (["cluster.colocate=maybe"], ["cluster.colocate=maybe", "set cluster.colocate to true or false"]),
    "wrong type: list item": (
        ["rollout.stop_token_ids=[1,eos]"],
        ["rollout.stop_token_ids[1] is not an integer", "set rollout.stop_token_ids to a list of integers"],
    ),
    "an empty stop string": (
        ['rollout.stop=["</answer>",""]'],
        ["rollout.stop=['</answer>', ''] must be a list of non-empty strings", "remove the empty string"],
    ),
    "unknown option": (["model=tiny_qwen"], ["model=tiny_qwen: no option tiny_qwen in model", "did you mean model=tiny_qwen3?"]),
    "MoE key on a dense model": (
        ["model.moe_router_topk=4"],
        ["model.moe_router_topk=4 takes effect only when model.num_moe_experts is set", "set model.num_moe_experts"],
    ),
    "RoPE scaling key without the scaling": (
        ["model.rope_scaling_low_freq_factor=2.0"],
        ["model.rope_scaling_low_freq_factor=2.0", "model.rope_scaling_factor=null", "set model.rope_scaling_factor"],
    ),
    "YaRN key without YaRN": (
        ["model.yarn_beta_fast=16"],
        ["model.yarn_beta_fast=16.0", "model.yarn_rotary_scaling_factor", "leave model.yarn_beta_fast at its default"],
    ),
    "unknown _target_ lists the options": (
        ["rollout._target_=rlx.rollout.launchers.VllmServer"],
        ["rollout._target_='rlx.rollout.launchers.VllmServer' cannot be imported", "rollout=local|sglang"],
    ),
    "a renamed _target_ names the new class": (
        ["rollout._target_=rlx.rollout.servers.LocalServer"],
        ["rollout._target_='rlx.rollout.servers.LocalServer' was renamed", "rollout._target_=rlx.rollout.launchers.LocalLauncher"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("overrides, fragments", CONFIG_CASES.values(), ids=CONFIG_CASES.keys())
def test_config_case_names_the_key_and_the_fix(overrides, fragments):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    for fragment in fragments:
        assert fragment in str(e.value)


def test_pass_through_maps_take_new_keys():
    cfg = compose([
        "+rollout.engine_args.mem_fraction_static=0.7",
        "+rollout.router_args.policy=round_robin",
        "+model.megatron_overrides.recompute_granularity=selective",
    ])  # fmt: skip
    rc = to_object(cfg)
    assert rc.rollout.engine_args == {"mem_fraction_static": 0.7}
    assert rc.rollout.router_args == {"policy": "round_robin"}
    assert rc.model.megatron_overrides == {"recompute_granularity": "selective"}


# ---- the config against the machine --------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_gpu_config_on_a_machine_without_gpus():
    with pytest.raises(ConfigError) as e:
        check_gpus(to_object(compose(["cluster=1gpu"])).cluster)
    for fragment in ("cluster.gpus_per_node=1", "needs 1 GPU", "this machine", "has 0", "set cluster=local"):
        assert fragment in str(e.value)


def test_ray_cluster_with_too_few_gpus():
    cluster = to_object(compose(["cluster=1x8", "rollout.num_engines=4"])).cluster
    message = gpu_shortfall(cluster, [4.0, 2.0], "the Ray cluster")
    for fragment in (
        "needs 8 GPUs (cluster.num_trainer_procs=4 + cluster.num_rollout_gpus=4)",
        "the Ray cluster has 6",
        "lower cluster.num_trainer_procs=4 or cluster.num_rollout_gpus=4",
    ):
        assert fragment in message
    assert gpu_shortfall(cluster, [8.0], "the Ray cluster") is None
    assert check_gpus(to_object(compose()).cluster) is None  # CPU: nothing to check


def test_ray_cluster_with_too_few_gpus_read_from_ray():
    """check_gpus with cluster.ray_address reads the connected Ray cluster (here a local one with
    2 logical GPUs; seconds)."""
    from helpers import own_ray  # tests/ is on sys.path

    with own_ray(num_cpus=1, num_gpus=2):
        cluster = to_object(
            compose(["cluster=1x8", "rollout.num_engines=4", "cluster.ray_address=auto"])
        ).cluster
        with pytest.raises(
            ConfigError, match=r"needs 8 GPUs .* the Ray cluster at cluster.ray_address=auto .* has 2"
        ):
            check_gpus(cluster)
        cluster.num_trainer_procs = cluster.num_rollout_gpus = 1
        check_gpus(cluster)  # 2 GPUs needed, 2 there


# ---- checkpoints ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dirs():
    """The cached tiny Qwen3 and Llama 3 checkpoints (written on first use)."""
    return {
        m: build(to_object(compose([f"model={m}"])).model).checkpoint_dir()
        for m in ("tiny_qwen3", "tiny_llama3")
    }


@pytest.fixture
def qwen3_copy(tiny_dirs, tmp_path):
    """A copy of the tiny Qwen3 checkpoint to break."""
    return shutil.copytree(tiny_dirs["tiny_qwen3"], tmp_path / "qwen3")


def _check(hf_dir, model="tiny_qwen3"):
    family = build(to_object(compose([f"model={model}", f"model.hf_checkpoint={hf_dir}"])).model)
    from transformers import AutoTokenizer

    check_checkpoint(family, hf_dir, AutoTokenizer.from_pretrained(str(hf_dir)))


def _rewrite(hf_dir, change):
    tensors = load_file(str(hf_dir / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})


def test_intact_checkpoints_pass(tiny_dirs):
    for model, hf_dir in tiny_dirs.items():
        _check(hf_dir, model)


def _fails(hf_dir, fragments, error=CheckpointError, model="tiny_qwen3"):
    with pytest.raises(error) as e:
        _check(hf_dir, model)
    for fragment in fragments:
        assert fragment in str(e.value)


def test_checkpoint_of_another_family(tiny_dirs):
    """A named full-size option states its family; a checkpoint of another is refused (a tiny option
    would take the checkpoint's family: tests/config/test_from_checkpoint.py)."""
    llama = tiny_dirs["tiny_llama3"]
    _fails(llama, [f"{llama}/config.json", "expects model_type=qwen3 but config.json has llama",
                   "model.hf_checkpoint alone reads the family (rlx.models.llama3.Llama3)"], error=ConfigError,
           model="qwen3_4b")  # fmt: skip


def test_checkpoint_tensor_of_another_shape(qwen3_copy):
    name = "model.layers.1.mlp.down_proj.weight"
    _rewrite(qwen3_copy, lambda t: t.__setitem__(name, t[name][:, :32].contiguous()))
    _fails(qwen3_copy, [str(qwen3_copy), f"{name} is [64, 32] in model.safetensors, the config gives [64, 128]",
                        "download or copy the checkpoint again"])  # fmt: skip


def test_checkpoint_tensor_missing(qwen3_copy):
    _rewrite(qwen3_copy, lambda t: t.pop("model.norm.weight"))
    _fails(qwen3_copy, ["1 tensors missing: model.norm.weight", "point model.hf_checkpoint at"])


def test_truncated_safetensors(qwen3_copy):
    path = qwen3_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    _fails(qwen3_copy, [str(path), f"truncated: the file has {len(data) - 100} bytes but its header describes {len(data)}",
                        "download or copy the checkpoint again"])  # fmt: skip


def test_safetensors_with_a_corrupt_header(qwen3_copy):
    path = qwen3_copy / "model.safetensors"
    path.write_bytes((20).to_bytes(8, "little") + b"{not json at all...}" + b"\0" * 64)
    _fails(qwen3_copy, [str(path), "corrupt safetensors header", "download or copy the checkpoint again"])


def test_index_names_a_missing_shard(qwen3_copy):
    names = load_file(str(qwen3_copy / "model.safetensors"))
    shard = "model-00002-of-00002.safetensors"
    weight_map = dict.fromkeys(names, "model.safetensors") | {"model.norm.weight": shard}
    (qwen3_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _fails(qwen3_copy, ["model.safetensors.index.json names 2 weight files", f"missing from {qwen3_copy}: {shard}",
                        "download or copy the checkpoint again"])  # fmt: skip


def test_checkpoint_without_safetensors(qwen3_copy):
    (qwen3_copy / "model.safetensors").unlink()
    (qwen3_copy / "pytorch_model.bin").write_bytes(b"")
    _fails(qwen3_copy, ["has neither model.safetensors nor model.safetensors.index.json", "pytorch_model.bin",
                        "save the model with transformers' save_pretrained"])  # fmt: skip


def test_tokenizer_larger_than_the_model_vocabulary(qwen3_copy):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_copy))
    tokenizer.add_tokens(["<tool_call>"])  # id 16 in a 16-row embedding
    tokenizer.save_pretrained(str(qwen3_copy))
    _fails(qwen3_copy, [f"the tokenizer in {qwen3_copy} has 17 tokens but model.vocab_size=16",
                        "use the tokenizer saved with these weights"])  # fmt: skip


def test_checkpoint_errors_are_user_errors():
    assert issubclass(CheckpointError, UserError)  # launch.py prints them without a traceback


def test_expected_shapes_are_remembered_by_the_config_and_a_tied_head_is_still_left_out(
    tmp_path, monkeypatch
):
    from rlx.models import checkpoint_checks

    monkeypatch.setenv("RLX_CACHE", str(tmp_path))
    tied = build(to_object(compose(["model=tiny_qwen3"])).model)
    shapes = checkpoint_checks.expected_shapes(tied)
    assert shapes["model.embed_tokens.weight"] == (tied.cfg.vocab_size, tied.cfg.hidden_size)
    assert "lm_head.weight" not in shapes and len(list((tmp_path / "hf_shapes").iterdir())) == 1

    monkeypatch.setattr(checkpoint_checks, "_model_shapes", lambda hf_config: pytest.fail("built again"))
    assert checkpoint_checks.expected_shapes(tied) == shapes
    untied = build(to_object(compose(["model=tiny_qwen3", "model.tie_word_embeddings=false"])).model)
    with pytest.raises(pytest.fail.Exception, match="built again"):  # another config
        checkpoint_checks.expected_shapes(untied)
