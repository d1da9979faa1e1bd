"""The full-size MoE configs (qwen3_30b_a3b, deepseek_v3) describe the released models. CPU, no downloads.

Each config composes against the released config.json (written here from the model's public HF
repository, as published), and its parameter count, derived from the config alone by the
family's `num_parameters`, is within 1% of the published size:

- Qwen3-30B-A3B: 30.5B total (Qwen/Qwen3-30B-A3B model card);
- DeepSeek-V3: 671B without the multi-token-prediction module, 685B with it (DeepSeek-V3
  technical report and deepseek-ai/DeepSeek-V3 model card).

The formulas themselves are checked exactly against tiny checkpoints in
tests/integration/test_moe_families.py.
"""

from __future__ import annotations

import json

import pytest

from rlx.config import build
from rlx.config.compose import compose, to_object
from rlx.errors import ConfigError

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def family_for(option: str, config_json: dict, tmp_path):
    """The family of `model=<option>`, pointed at a directory holding `config_json`."""
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    rc = to_object(compose([f"model={option}", f"model.hf_checkpoint={tmp_path}"]))
    assert rc.model.tiny is False
    return build(rc.model)


def test_qwen3_30b_a3b_matches_its_config_json_and_size(tmp_path):
    family = family_for("qwen3_30b_a3b", QWEN3_30B_A3B, tmp_path)
    family.check_hf_config(tmp_path)
    assert abs(family.num_parameters() / 30.5e9 - 1) <= 0.01
    # What the family would write for this shape agrees with the released file.
    ours = family.hf_config().to_dict()
    assert ours["num_local_experts"] == QWEN3_30B_A3B["num_experts"]  # transformers 5's name for it
    for key in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "head_dim"):
        assert ours[key] == QWEN3_30B_A3B[key], key
    assert ours["rope_parameters"]["rope_theta"] == QWEN3_30B_A3B["rope_theta"]


def test_deepseek_v3_matches_its_config_json_and_size(tmp_path):
    family = family_for("deepseek_v3", DEEPSEEK_V3, tmp_path)
    # The released weights are fp8 with block scales: refused with the way out named.
    with pytest.raises(ConfigError, match="quantization_config.*dequantise the checkpoint to bf16"):
        family.check_hf_config(tmp_path)
    bf16 = {k: v for k, v in DEEPSEEK_V3.items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(bf16))
    family.check_hf_config(tmp_path)
    assert abs(family.num_parameters() / 671e9 - 1) <= 0.01
    assert abs(family.num_parameters(mtp_layers=1) / 685e9 - 1) <= 0.01
    ours = family.hf_config().to_dict()
    for key in ("n_routed_experts", "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace"):
        assert ours[key] == DEEPSEEK_V3[key], key
    for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert ours[key] == DEEPSEEK_V3[key], key
    rope = ours["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["mscale_all_dim"]) == ("yarn", 40.0, 1.0)


@pytest.mark.parametrize(
    ("option", "config_json", "change", "message"),
    [
        (
            "qwen3_30b_a3b",
            QWEN3_30B_A3B,
            {"num_experts": 64},
            "model.num_moe_experts=128 but config.json has 64",
        ),
        ("qwen3_30b_a3b", QWEN3_30B_A3B, {"norm_topk_prob": False}, "model.moe_router_norm_topk_prob=True"),
        ("deepseek_v3", DEEPSEEK_V3, {"n_shared_experts": 2}, "moe_shared_expert_intermediate_size=2048"),
        ("deepseek_v3", DEEPSEEK_V3, {"first_k_dense_replace": 1}, "model.moe_first_dense_layers=3"),
        ("deepseek_v3", DEEPSEEK_V3, {"scoring_func": "softmax"}, "scoring_func=softmax"),
    ],
)
def test_a_changed_config_json_is_refused_naming_the_field(option, config_json, change, message, tmp_path):
    released = {k: v for k, v in config_json.items() if k != "quantization_config"}
    family = family_for(option, released | change, tmp_path)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        family.check_hf_config(tmp_path)


@pytest.mark.parametrize("option", ["tiny_qwen3_moe", "tiny_deepseek_v3"])
def test_tiny_moe_models_reshape_from_the_command_line(option):
    base = to_object(compose([f"model={option}"])).model
    reshaped = to_object(
        compose(
            [
                f"model={option}",
                "model.num_moe_experts=32",
                "model.moe_router_topk=8",
                *(["model.moe_router_group_topk=4"] if option == "tiny_deepseek_v3" else []),
            ]
        )  # HF: topk = 2 × groups
    ).model
    assert (base.num_moe_experts, base.moe_router_topk) != (32, 8)
    assert (reshaped.num_moe_experts, reshaped.moe_router_topk) == (32, 8)
    with pytest.raises(ConfigError, match="model.num_moe_experts"):
        compose([f"model={option}", "model.num_moe_experts=many"])
