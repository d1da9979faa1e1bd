"""Every dense family (Qwen3, Llama 3, GLM-4) on megatron-core equals itself in transformers. CPU, gloo.

Per family, on its tiny variant (`model=tiny_<family>`): Megatron logits == transformers logits
(fp32), HF -> Megatron -> HF returns the checkpoint's tensors, TP=2 == TP=1, the local rollout
engine's logprobs == transformers', the parameter count formula == both models, and a config.json
that disagrees is refused naming the field. The 2-step GRPO run through the real loop, for every
family, is in test_family_loops.py.

Each family writes its tiny checkpoint on first use (under a temporary RLX_CACHE). The parity
tests then use a copy with every tensor redrawn (norm weights 1 + N(0, 0.2^2), everything else
N(0, 0.2^2)): a fresh checkpoint has norms exactly 1, biases 0 and weights at std 0.02, which
would hide a misplaced norm or bias and barely exercise RoPE.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import helpers  # tests/ is on sys.path (conftest)
import pytest
import torch
from helpers import assert_same_tensors, megatron_logits, megatron_world, spawn_ranks, token_batch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rlx.config import build
from rlx.config.compose import compose, to_object
from rlx.engine import GenerateRequest, SamplingParams
from rlx.engine.local import LocalEngine
from rlx.errors import ConfigError
from rlx.models.attention import SDPAttention
from rlx.models.config import ModelConfig
from rlx.models.layers import PostNormTransformerLayer

# model option -> the transformers class its checkpoint loads as
FAMILIES = {
    "tiny_qwen3": "Qwen3ForCausalLM",
    "tiny_llama3": "LlamaForCausalLM",
    "tiny_glm4": "Glm4ForCausalLM",
}
REDRAW_STD = 0.2


def redraw(src: Path, dst: Path) -> Path:
    """Copy the HF checkpoint `src` to `dst` with every tensor redrawn (seeded)."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, tensor in sorted(load_file(src / "model.safetensors").items()):
        noise = torch.randn(tensor.shape, generator=generator) * REDRAW_STD
        tensors[name] = 1.0 + noise if name.endswith("norm.weight") else noise
    dst.mkdir(parents=True)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    for file in src.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, dst / file.name)
    return dst


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, ModelConfig]:
    """model option -> its composed config, pointed at a redrawn copy of the tiny checkpoint."""
    cache, root = tmp_path_factory.mktemp("rlx_cache"), tmp_path_factory.mktemp("redrawn")
    configs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLX_CACHE", str(cache))
        for option in FAMILIES:
            written = build(compose([f"model={option}"]).model).checkpoint_dir()
            assert written.is_relative_to(cache) and (written / "model.safetensors").is_file()
            hf_dir = redraw(written, root / option)
            configs[option] = to_object(compose([f"model={option}", f"model.hf_checkpoint={hf_dir}"])).model
    return configs


def load_megatron(cfg: ModelConfig):
    family = build(cfg)
    return family, helpers.load_megatron(family, cfg.hf_checkpoint)


def load_hf(cfg: ModelConfig):
    return AutoModelForCausalLM.from_pretrained(cfg.hf_checkpoint, dtype=torch.float32).eval()


def on_disk(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return load_file(Path(cfg.hf_checkpoint) / "model.safetensors")


@pytest.mark.parametrize("option", FAMILIES)
def test_logits_match_transformers(world, configs, option):
    cfg = configs[option]
    _, model = load_megatron(cfg)
    layer = model.decoder.layers[0]
    assert isinstance(layer.self_attention.core_attention, SDPAttention)
    assert isinstance(layer, PostNormTransformerLayer) == (option == "tiny_glm4")
    hf_model = load_hf(cfg)
    assert type(hf_model).__name__ == FAMILIES[option]
    ids = token_batch()
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits
    logits = megatron_logits(model, ids)
    assert logits.shape == expected.shape == (2, 12, 16)
    assert expected.std() > 1.0  # far from uniform: every part of the model moves the logits
    assert (logits - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("option", FAMILIES)
def test_round_trip_returns_the_checkpoint(world, configs, option):
    family, model = load_megatron(configs[option])
    assert_same_tensors(dict(family.export_hf_weights(model)), on_disk(configs[option]))


@pytest.mark.parametrize("option", FAMILIES)
def test_num_parameters_counts_both_models(world, configs, option):
    family, model = load_megatron(configs[option])
    num_hf = sum(p.numel() for p in load_hf(configs[option]).parameters())
    assert family.num_parameters() == num_hf == sum(p.numel() for p in model.parameters())


# kv_channels != hidden_size / heads, so a head dim that is not passed through would show.
RESHAPE = {
    "num_layers": 3,
    "hidden_size": 32,
    "ffn_hidden_size": 48,
    "num_attention_heads": 4,
    "num_query_groups": 1,
    "kv_channels": 16,
}
HF_NAMES = {
    "num_layers": "num_hidden_layers",
    "ffn_hidden_size": "intermediate_size",
    "num_query_groups": "num_key_value_heads",
    "kv_channels": "head_dim",
}


@pytest.mark.parametrize("option", FAMILIES)
def test_tiny_model_reshapes_from_the_command_line(world, option, tmp_path, monkeypatch):
    monkeypatch.setenv("RLX_CACHE", str(tmp_path))
    cfg = to_object(compose([f"model={option}", *(f"model.{k}={v}" for k, v in RESHAPE.items())])).model
    family = build(cfg)
    hf_dir = family.checkpoint_dir()
    written = json.loads((hf_dir / "config.json").read_text())
    assert {key: written[HF_NAMES.get(key, key)] for key in RESHAPE} == RESHAPE
    model = family.build_model()
    family.load_hf_weights(model, hf_dir)  # config.json checked, every tensor's shape checked
    assert family.num_parameters() == sum(p.numel() for p in model.parameters())


def _tp2_rank(rank: int, world_size: int, port: int, configs: dict[str, ModelConfig], out_dir: Path) -> None:
    torch.set_num_threads(1)
    results = {}
    with megatron_world(rank, world_size, port, tp=2):
        for option, cfg in configs.items():
            family, model = load_megatron(cfg)
            results[option] = {
                "local_vocab": model.output_layer.output_size_per_partition,
                "logits": megatron_logits(model, token_batch()),
                "weights": dict(family.export_hf_weights(model)),
            }
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def tp2_results(configs, tmp_path_factory) -> list[dict]:
    """Each TP=2 rank's logits and exported weights per family (one spawn for all families)."""
    out = tmp_path_factory.mktemp("tp2")
    spawn_ranks(_tp2_rank, 2, configs, out)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("option", FAMILIES)
def test_tp2_matches_tp1(world, configs, tp2_results, option):
    _, model = load_megatron(configs[option])
    expected = megatron_logits(model, token_batch())
    for results in tp2_results:
        result = results[option]
        assert result["local_vocab"] == 8  # really sharded: half the vocabulary per rank
        torch.testing.assert_close(result["logits"], expected, atol=1e-5, rtol=1e-5)
        # Every TP rank gets the full tensors back, identical to the checkpoint.
        assert_same_tensors(result["weights"], on_disk(configs[option]))


@pytest.mark.parametrize("option", FAMILIES)
def test_local_engine_logprobs_match_transformers(configs, option):
    cfg = configs[option]
    engine = LocalEngine(cfg.hf_checkpoint, seed=0)
    prompts = [[5], [2, 3, 4], [9, 8, 7, 6, 5, 4, 12]]  # mixed lengths: left padding in one batch
    sampling = dict(max_new_tokens=12, temperature=1.0, ignore_eos=True)
    outputs = engine.generate([GenerateRequest(p, SamplingParams(**sampling)) for p in prompts])
    hf_model = load_hf(cfg)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out.output_ids) == len(out.output_logprobs) == 12
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1 : -1]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(out.output_ids)[:, None])[:, 0]
        assert (torch.tensor(out.output_logprobs) - expected).abs().max().item() <= 1e-4
    assert all(len(set(out.output_ids)) > 3 for out in outputs)  # sampled text, not one repeated token


# (option, config.json change, the message naming it): a shape key every family has, then each
# family's own keys; rope entries are written in both config.json generations.
MISMATCHES = [
    ("tiny_qwen3", {"num_attention_heads": 8}, "model.num_attention_heads=4 but config.json has 8"),
    ("tiny_llama3", {"num_attention_heads": 8}, "model.num_attention_heads=4 but config.json has 8"),
    ("tiny_glm4", {"num_attention_heads": 8}, "model.num_attention_heads=4 but config.json has 8"),
    ("tiny_qwen3", {"attention_bias": True}, "model.add_qkv_bias=False but config.json has True"),
    ("tiny_llama3", {"mlp_bias": True}, "config.json has mlp_bias=True but Llama3 implements only False"),
    (
        "tiny_llama3",
        {"rope_parameters": {"low_freq_factor": 2.0}},
        "model.rope_scaling_low_freq_factor=1.0 but config.json has 2.0",
    ),
    (
        "tiny_llama3",
        {"rope_parameters": None, "rope_theta": 500000.0},
        "model.rope_scaling_factor=8.0 but config.json has rope_type=default",
    ),
    ("tiny_glm4", {"attention_bias": False}, "model.add_qkv_bias=True but config.json has False"),
    (
        "tiny_glm4",
        {"rope_parameters": {"partial_rotary_factor": 1.0}},
        "model.rotary_percent=0.5 but config.json has 1.0",
    ),
    (
        "tiny_glm4",
        {"rope_parameters": None, "partial_rotary_factor": 1.0},
        "model.rotary_percent=0.5 but config.json has 1.0",
    ),
]


@pytest.mark.parametrize(
    ("option", "change", "message"), MISMATCHES, ids=[f"{o}-{'+'.join(c)}" for o, c, _ in MISMATCHES]
)
def test_mismatched_config_json_names_the_field(configs, tmp_path, option, change, message):
    family = build(configs[option])
    config = json.loads((Path(configs[option].hf_checkpoint) / "config.json").read_text())
    family.check_hf_config(configs[option].hf_checkpoint)  # the real one passes
    for key, value in change.items():
        if isinstance(value, dict):
            config[key] |= value
        elif value is None:
            del config[key]
        else:
            config[key] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as error:
        family.check_hf_config(tmp_path)
    assert message in str(error.value)
    assert "num_query_groups" not in str(error.value)  # an agreeing key is not named


@pytest.mark.parametrize(
    ("option", "override", "message"),
    [
        (
            "tiny_llama3",
            "model.qk_layernorm=true",
            "model.qk_layernorm=true: Llama3 models need model.qk_layernorm=false",
        ),
        ("tiny_glm4", "model.post_sublayer_norms=false", "Glm4 models need model.post_sublayer_norms=true"),
        (
            "tiny_qwen3",
            "model.rotary_percent=0.5",
            "model.rotary_percent=0.5: Qwen3 models need model.rotary_percent=1.0",
        ),
    ],
)
def test_family_refuses_an_architecture_its_checkpoints_cannot_hold(option, override, message):
    with pytest.raises(ConfigError, match="model._target_=") as error:
        build(compose([f"model={option}", override]).model)
    assert message in str(error.value)
