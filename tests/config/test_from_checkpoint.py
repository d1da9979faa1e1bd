"""`model.hf_checkpoint=DIR` alone: the family and every shape key come from DIR/config.json.

Checked against the published config.json files of every full-size option (tests/config/
test_model_sizes.py and test_moe_sizes.py hold them, as released): the checkpoint alone composes to
exactly what naming the option does. Then SmolLM2-135M-Instruct's config.json against hand-written
values, the tiny options through transformers-5 files, a Hugging Face repo id through a local hub
cache, and every refusal. CPU, config files only: no weights are read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_model_sizes import PUBLISHED_CONFIGS
from test_moe_sizes import DEEPSEEK_V3, QWEN3_30B_A3B

from rlx.config import build
from rlx.config.compose import compose, to_object
from rlx.errors import ConfigError
from rlx.models.hf_checkpoint import SHAPE_KEYS

ROOT = Path(__file__).resolve().parents[2]
RELEASED = PUBLISHED_CONFIGS | {
    "qwen3_30b_a3b": QWEN3_30B_A3B,
    # the released weights are fp8; rlx trains a bf16 copy, whose config.json drops quantization_config
    "deepseek_v3": {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"},
}
# SmolLM2-135M-Instruct's config.json as rlx.tools.example_model writes it (transformers 5 form)
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "max_position_embeddings": 8192,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "pad_token_id": 2,
    "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}


def model_of(overrides) -> dict:
    model = to_object(compose(overrides)).model
    return {key: getattr(model, key) for key in ("_target_", *SHAPE_KEYS)}


def checkpoint(tmp_path, config_json: dict, name: str = "ckpt") -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config_json))
    return path


@pytest.mark.parametrize("option", sorted(RELEASED))
def test_a_released_checkpoint_alone_composes_to_its_named_option(option, tmp_path):
    path = checkpoint(tmp_path, RELEASED[option], name=f"{option}-download")
    named = model_of([f"model={option}", f"model.hf_checkpoint={path}"])
    assert model_of([f"model.hf_checkpoint={path}"]) == named
    rc = to_object(compose([f"model.hf_checkpoint={path}"]))
    assert (rc.model.name, rc.model.tiny, rc.model.hf_checkpoint) == (f"{option}-download", False, str(path))


def test_smollm2_config_json_gives_its_shape(tmp_path):
    path = checkpoint(tmp_path, SMOLLM2, name="SmolLM2-135M-Instruct")
    model = to_object(compose([f"model.hf_checkpoint={path}"])).model
    assert model._target_ == "rlx.models.llama3.Llama3"
    got = {key: getattr(model, key) for key in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
        "vocab_size", "max_position_embeddings", "tie_word_embeddings", "rotary_base", "rope_scaling_factor",
        "qk_layernorm", "add_qkv_bias",
    )}  # fmt: skip
    assert got == dict(
        num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9, num_query_groups=3,
        kv_channels=64, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
        rotary_base=1e5, rope_scaling_factor=None, qk_layernorm=False, add_qkv_bias=False,
    )  # fmt: skip
    assert model.norm_epsilon == 9.999999747378752e-06  # as stored, not rounded to 1e-5
    build(model).check_hf_config(path)  # what the run checks again before it starts


@pytest.mark.parametrize(
    "option", ["tiny_qwen3", "tiny_llama3", "tiny_glm4", "tiny_qwen3_moe", "tiny_deepseek_v3"]
)
def test_a_transformers_5_config_json_gives_back_the_shape_it_was_written_from(option, tmp_path):
    """Each family's own config (llama3 RoPE scaling, GLM-4's half-head RoPE and biases, MoE routing,
    MLA with YaRN) written by transformers 5 (rope_parameters), read back from the default option."""
    family = build(to_object(compose([f"model={option}"])).model)
    family.hf_config().save_pretrained(tmp_path)
    want = model_of([f"model={option}"])
    got = model_of(
        [
            "model=tiny_qwen3_moe" if option == "tiny_qwen3" else "model=tiny_qwen3",
            f"model.hf_checkpoint={tmp_path}",
        ]
    )
    assert got == want


def test_the_tiny_option_given_its_own_checkpoint_is_left_as_it_is(tmp_path):
    hf_dir = build(to_object(compose(["model=tiny_llama3"])).model).checkpoint_dir()
    rc = to_object(compose(["model=tiny_llama3", f"model.hf_checkpoint={hf_dir}"]))
    assert (rc.model.name, rc.model.tiny) == ("tiny_llama3", True)  # a recorded config reruns unchanged


def test_a_shape_key_on_the_command_line_must_agree_with_config_json(tmp_path):
    path = checkpoint(tmp_path, SMOLLM2)
    assert model_of([f"model.hf_checkpoint={path}", "model.num_layers=30"])["num_layers"] == 30
    with pytest.raises(ConfigError) as e:
        compose([f"model.hf_checkpoint={path}", "model.num_layers=4", "model.kv_channels=32"])
    for fragment in (f"model.num_layers=4 but {path}/config.json gives 30", "model.kv_channels=32 but",
                     "drop these overrides"):  # fmt: skip
        assert fragment in str(e.value)
    # keys that choose how to train, not what the model is, stay the user's
    rc = to_object(compose([f"model.hf_checkpoint={path}", "model.kernels=torch", "model.init_seed=3"]))
    assert (rc.model.kernels, rc.model.init_seed) == ("torch", 3)


def _fails(overrides, *fragments):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)


SUPPORTED = (
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "LlamaForCausalLM",
    "Glm4ForCausalLM",
    "DeepseekV3ForCausalLM",
)


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path):
    mistral = checkpoint(
        tmp_path, SMOLLM2 | {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    )
    _fails([f"model.hf_checkpoint={mistral}"], "architectures=['MistralForCausalLM'] model_type=mistral",
           "rlx cannot train", *SUPPORTED)  # fmt: skip
    classifier = checkpoint(tmp_path, SMOLLM2 | {"architectures": ["LlamaForSequenceClassification"]}, "rm")
    _fails(
        [f"model.hf_checkpoint={classifier}"],
        "LlamaForSequenceClassification",
        "LlamaForCausalLM (model_type llama)",
    )


def test_other_rope_scaling_a_missing_key_and_bad_json_are_refused(tmp_path):
    yarn = SMOLLM2 | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e5}}
    _fails([f"model.hf_checkpoint={checkpoint(tmp_path, yarn, 'yarn')}"], "RoPE scaling of type yarn",
           "default, llama3 for LlamaForCausalLM")  # fmt: skip
    no_layers = {k: v for k, v in SMOLLM2.items() if k != "num_hidden_layers"}
    _fails([f"model.hf_checkpoint={checkpoint(tmp_path, no_layers, 'short')}"], "lacks keys",
           "model.num_layers (num_hidden_layers)")  # fmt: skip
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama",\n "num_hidden_layers": }')
    _fails([f"model.hf_checkpoint={broken}"], f"{broken}/config.json: not valid JSON (line 2")
    for option in ("tiny_llama3", "tiny_deepseek_v3"):  # a family's own check of the file names it too
        family = build(to_object(compose([f"model={option}"])).model)
        with pytest.raises(ConfigError, match=r"config.json: not valid JSON \(line 2"):
            family.check_hf_config(broken)


def test_a_gguf_file_or_directory_says_how_to_convert_it(tmp_path):
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    how = "python -m rlx.tools.example_model --gguf"
    _fails([f"model.hf_checkpoint={gguf}"], "is a GGUF file", f"{how} {gguf} --out DIR", "rlx[example]")
    _fails([f"model.hf_checkpoint={tmp_path}"], "has no config.json but a GGUF file", f"{how} {gguf}")


def test_paths_that_are_neither_a_directory_nor_a_repo_id(tmp_path):
    _fails([f"model.hf_checkpoint={tmp_path}/no/such/dir"], "is not a directory",
           "nor a Hugging Face repo id (org/name)")  # fmt: skip
    (tmp_path / "file").write_text("x")
    _fails([f"model.hf_checkpoint={tmp_path}/file"], "is a file, not a directory")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache (HF_HUB_CACHE's layout) holding one snapshot of org/SmolLM2-test."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--org--SmolLM2-test"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text(json.dumps(SMOLLM2))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / commit


def test_a_repo_id_resolves_through_the_hub_cache_offline(hub_cache):
    rc = to_object(compose(["model.hf_checkpoint=org/SmolLM2-test"]))
    assert rc.model.hf_checkpoint == str(hub_cache)  # what the run records and every process loads
    assert (rc.model.num_layers, rc.model.hidden_size, rc.model.name) == (30, 576, hub_cache.name)


def test_a_repo_id_neither_cached_nor_reachable_is_named(hub_cache):
    _fails(["model.hf_checkpoint=Qwen/Qwen3-0.6B"], "model.hf_checkpoint='Qwen/Qwen3-0.6B' is neither a local directory",
           f"nor a Hugging Face repo in the cache ({hub_cache.parents[2]})", "HF_HUB_OFFLINE is set",
           "hf download Qwen/Qwen3-0.6B")  # fmt: skip


def test_launch_py_refuses_a_gguf_checkpoint_before_anything_starts(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    cmd = [sys.executable, "launch.py", f"hydra.run.dir={tmp_path}", f"model.hf_checkpoint={gguf}"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "error: model.hf_checkpoint=" in result.stderr and "is a GGUF file" in result.stderr
    assert "Traceback" not in result.stderr
