"""Qwen3's HF side: its transformers config, where our keys live in config.json, its weight table."""

from __future__ import annotations

from rlx.data.toy import EOS, PAD, VOCAB
from rlx.models.bridge import Replicated, TensorMapping, llama_style_mappings
from rlx.models.config import ModelConfig
from rlx.models.family import HFField

# config.json keys per ModelConfig key; defaults are Qwen3Config's when a key is absent.
HF_FIELDS: dict[str, HFField] = {
    "num_layers": HFField(("num_hidden_layers",)),
    "hidden_size": HFField(("hidden_size",)),
    "ffn_hidden_size": HFField(("intermediate_size",)),
    "num_attention_heads": HFField(("num_attention_heads",)),
    "num_query_groups": HFField(("num_key_value_heads",)),
    "kv_channels": HFField(("head_dim",), default=128),
    "vocab_size": HFField(("vocab_size",)),
    "max_position_embeddings": HFField(("max_position_embeddings",)),
    # transformers 5 writes rope_parameters; older checkpoints have a top-level rope_theta.
    "rotary_base": HFField(("rope_parameters.rope_theta", "rope_theta"), default=10000.0),
    "norm_epsilon": HFField(("rms_norm_eps",), default=1e-6),
    "tie_word_embeddings": HFField(("tie_word_embeddings",), default=False),
}


def hf_config(cfg: ModelConfig):
    """`transformers.Qwen3Config` for `cfg`'s shape; tiny models get the toy vocab's pad/eos ids."""
    from transformers import Qwen3Config

    tokens = dict(pad_token_id=VOCAB.index(PAD), eos_token_id=VOCAB.index(EOS)) if cfg.tiny else {}
    return Qwen3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups,
        head_dim=cfg.kv_channels,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rotary_base},
        rms_norm_eps=cfg.norm_epsilon,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_bias=False,
        **tokens,
    )


def weight_mappings(cfg: ModelConfig) -> dict[str, TensorMapping]:
    """Megatron parameter template -> HF tensors for Qwen3: Llama's table plus the qk-norms."""
    mappings = llama_style_mappings(
        num_heads=cfg.num_attention_heads,
        num_groups=cfg.num_query_groups,
        head_dim=cfg.kv_channels,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    if cfg.qk_layernorm:
        attn = "model.layers.{i}.self_attn"
        mappings["decoder.layers.{i}.self_attention.q_layernorm.weight"] = Replicated(
            (f"{attn}.q_norm.weight",)
        )
        mappings["decoder.layers.{i}.self_attention.k_layernorm.weight"] = Replicated(
            (f"{attn}.k_norm.weight",)
        )
    return mappings
