"""Full-size dense model configs: they compose, agree with the published config.json, have the
published parameter count, and give transformers' RoPE frequencies. CPU, no weights.

References (the models' Hugging Face pages, their config.json and safetensors metadata):

| option    | model           | published size              |
|-----------|-----------------|-----------------------------|
| glm4_9b   | GLM-4-9B-0414   | 9.4B (9,400,279,040)        |
| qwen3_4b  | Qwen3-4B        | 4.0B (4,022,468,096)        |
| qwen3_8b  | Qwen3-8B        | 8.2B (8,190,735,360)        |
| llama3_8b | Llama-3.1-8B    | 8.03B (8,030,261,248)       |

The config.json texts below are the published files in their original (pre-transformers-5)
form: top-level rope_theta / rope_scaling / partial_rotary_factor, no head_dim for Llama.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from rlx.config import build
from rlx.config.compose import compose

PUBLISHED_SIZES = {"glm4_9b": 9.4e9, "qwen3_4b": 4.0e9, "qwen3_8b": 8.2e9, "llama3_8b": 8.03e9}

_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
PUBLISHED_CONFIGS = {
    "glm4_9b": {
        "architectures": ["Glm4ForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": [151329, 151336, 151338],
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 13696,
        "max_position_embeddings": 32768,
        "model_type": "glm4",
        "num_attention_heads": 32,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "pad_token_id": 151329,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 151552,
    },
    "qwen3_4b": _QWEN3 | {"hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
    "qwen3_8b": _QWEN3 | {"hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
    "llama3_8b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    },
}
OPTIONS = sorted(PUBLISHED_SIZES)


@pytest.fixture(params=OPTIONS)
def option(request) -> str:
    return request.param


@pytest.fixture
def published_dir(option, tmp_path):
    """A directory holding the option's published config.json (what a download contains)."""
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_CONFIGS[option]))
    return tmp_path


@pytest.fixture
def family(option, published_dir):
    """The option's model family, composed as a user would: `model=<option> model.hf_checkpoint=...`."""
    cfg = compose([f"model={option}", f"model.hf_checkpoint={published_dir}"])
    assert cfg.model.tiny is False and cfg.model.name == option
    return build(cfg.model)


def test_config_matches_the_published_config_json(family, published_dir):
    family.check_hf_config(published_dir)  # raises, naming every field, on any disagreement


def test_parameter_count_is_the_published_size(family, option):
    published = PUBLISHED_SIZES[option]
    assert abs(family.num_parameters() - published) <= 0.01 * published


def test_derived_hf_config_passes_its_own_check(family, tmp_path):
    derived = tmp_path / "derived"
    family.hf_config().save_pretrained(derived)  # transformers-5 form: rope_parameters
    assert "rope_parameters" in json.loads((derived / "config.json").read_text())
    family.check_hf_config(derived)


def test_full_size_config_without_a_checkpoint_is_refused(option):
    with pytest.raises(ValueError, match="model.hf_checkpoint is not set and model.tiny=false"):
        compose([f"model={option}"])


def test_rope_frequencies_equal_transformers(family):
    """Megatron's RoPE inverse frequencies (partial rotary, llama3 scaling) == transformers'."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import AutoModelForCausalLM

    from rlx.models.layers import apply_llama3_rope_scaling

    cfg = family.cfg
    rotary = RotaryEmbedding(
        kv_channels=cfg.kv_channels,
        rotary_percent=cfg.rotary_percent,
        rotary_base=cfg.rotary_base,
        use_cpu_initialization=True,
    )
    if cfg.rope_scaling_factor is not None:
        apply_llama3_rope_scaling(torch.nn.ModuleDict({"rotary_pos_emb": rotary}), cfg)
    hf_config = family.hf_config()
    model_class = AutoModelForCausalLM._model_mapping[type(hf_config)]
    modeling = sys.modules[model_class.__module__]
    (rotary_class,) = [v for k, v in vars(modeling).items() if k.endswith("RotaryEmbedding")]
    expected = rotary_class(hf_config)
    assert expected.attention_scaling == 1.0
    assert (
        rotary.inv_freq.shape == expected.inv_freq.shape == (int(cfg.kv_channels * cfg.rotary_percent) // 2,)
    )
    assert torch.equal(rotary.inv_freq, expected.inv_freq)
