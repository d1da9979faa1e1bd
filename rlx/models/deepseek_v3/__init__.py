"""The DeepSeek-V3 family: multi-latent attention, dense first layers, then sigmoid-routed MoE
with shared experts, a per-expert selection bias and group-limited top-k."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn.functional as F

from rlx.errors import ConfigError
from rlx.models.deepseek_v3 import bridge
from rlx.models.hf_config import read_config
from rlx.models.moe_family import MoEFamily


class DeepseekV3(MoEFamily):
    """DeepSeek-V3 / V3.1 / R1 (671B) and the tiny test shape, without the multi-token-prediction layer."""

    hf_model_type = "deepseek_v3"
    hf_architecture = "DeepseekV3ForCausalLM"
    rope_types = ("default", "yarn")  # YaRN: model.yarn_*
    router_dtype = "fp32"  # HF's DeepseekV3TopkRouter computes its logits in fp32
    pinned = {
        "qk_layernorm": True,  # q_a_layernorm / kv_a_layernorm on the compressed latents
        "add_qkv_bias": False,
        "post_sublayer_norms": False,
        "rotary_percent": 1.0,
        "rope_scaling_factor": None,  # DeepSeek's RoPE scaling is YaRN: model.yarn_*
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
    }
    # Megatron's MLA always de-interleaves the rotary dims, which is HF's rope_interleave=true;
    # the released config.json also names the router (sigmoid scores, bias-corrected top-k).
    hf_constants = {
        "hidden_act": "silu",
        "rope_interleave": True,
        "attention_bias": False,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
    }

    def check_hf_config(self, hf_dir: str | Path) -> None:
        """The shape keys, after refusing fp8 weights (the released checkpoints' format)."""
        hf = read_config(Path(hf_dir))
        quantization = hf.get("quantization_config")
        if quantization:
            raise ConfigError(
                f"{Path(hf_dir) / 'config.json'} has quantization_config={quantization}: rlx loads "
                "bf16/fp32 weights only; dequantise the checkpoint to bf16 first"
            )
        super().check_hf_config(hf_dir)

    bridge_module = bridge

    def hf_config_args(self) -> tuple[str, dict[str, Any]]:
        self.check_routing()
        return super().hf_config_args()

    def transformer_kwargs(self) -> dict[str, Any]:
        cfg = self.cfg
        return (
            dict(
                normalization="RMSNorm",
                gated_linear_unit=True,
                activation_func=F.silu,
                add_bias_linear=False,
                qk_layernorm=True,
                # Megatron's bookkeeping head size; MLA uses qk_head_dim / qk_pos_emb_head_dim / v_head_dim.
                kv_channels=cfg.qk_head_dim + cfg.qk_pos_emb_head_dim,
            )
            | self.moe_kwargs()
        )

    def mla_kwargs(self) -> dict[str, Any]:
        cfg = self.cfg
        yarn = cfg.yarn_rotary_scaling_factor is not None
        if yarn and not (cfg.yarn_mscale and cfg.yarn_mscale_all_dim) and cfg.yarn_mscale != 1.0:
            # HF then ignores mscale (attention factor from the factor alone); megatron does not.
            raise ConfigError("model.yarn_mscale must be 1.0 when model.yarn_mscale_all_dim is 0")
        return dict(
            multi_latent_attention=True,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.qk_head_dim,
            qk_pos_emb_head_dim=cfg.qk_pos_emb_head_dim,
            v_head_dim=cfg.v_head_dim,
            rope_type="yarn" if yarn else "rope",
            rotary_base=cfg.rotary_base,
            # 1.0 leaves plain RoPE's softmax scale at 1/sqrt(head dim) (megatron applies YaRN's
            # mscale_all_dim correction from this factor whatever the RoPE type).
            rotary_scaling_factor=cfg.yarn_rotary_scaling_factor if yarn else 1.0,
            original_max_position_embeddings=cfg.yarn_original_max_position_embeddings
            or cfg.max_position_embeddings,
            beta_fast=cfg.yarn_beta_fast,
            beta_slow=cfg.yarn_beta_slow,
            mscale=cfg.yarn_mscale,
            mscale_all_dim=cfg.yarn_mscale_all_dim if yarn else 0.0,
        )

    def weight_mappings(self):
        return bridge.weight_mappings(self.cfg)

    def lora_modules(self) -> tuple[str, ...]:
        """Multi-latent attention's tensor-parallel projections (q, or q's up-projection under
        q_lora_rank; kv's up-projection; the output), then the MLP's. The latent down-projections
        are whole on every rank (plain linears), not adapted."""
        q = "linear_q_up_proj" if self.cfg.q_lora_rank else "linear_q_proj"
        return (q, "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2")

    def num_parameters(self, mtp_layers: int = 0) -> int:
        """Parameters of the HF model, from the shape alone; `mtp_layers` adds DeepSeek-V3's
        multi-token-prediction modules as its checkpoint stores them.

        MLA per layer: q_a (h x q_lora) + its norm + q_b (q_lora x heads x (nope + rope)), or q
        (h x heads x (nope + rope)) without q_lora; kv_a (h x (kv_lora + rope)) + its norm;
        kv_b (kv_lora x heads x (nope + v)); o (heads x v x h). MLP: 3 x h x ffn (dense layers)
        or router (experts x h) + bias (experts) + experts x 3 x h x moe_ffn + shared 3 x h x
        shared_ffn. Two RMSNorms per layer. Plus embedding, lm_head (untied) and final norm.
        An MTP module is one MoE layer plus two norms (enorm, hnorm), eh_proj (2h x h), its own
        final norm, and its own copies of the embedding and the output head.
        """
        c = self.cfg
        h, heads, rope = c.hidden_size, c.num_attention_heads, c.qk_pos_emb_head_dim
        q_out = heads * (c.qk_head_dim + rope)
        q = h * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * q_out if c.q_lora_rank else h * q_out
        kv = (
            h * (c.kv_lora_rank + rope)
            + c.kv_lora_rank
            + c.kv_lora_rank * heads * (c.qk_head_dim + c.v_head_dim)
        )
        attention = q + kv + heads * c.v_head_dim * h + 2 * h
        dense = attention + 3 * h * c.ffn_hidden_size
        experts = c.num_moe_experts * (h + 1 + 3 * h * c.moe_ffn_hidden_size)
        moe = attention + experts + 3 * h * (c.moe_shared_expert_intermediate_size or 0)
        num_dense = c.moe_first_dense_layers
        embedding = c.vocab_size * h
        total = (
            num_dense * dense
            + (c.num_layers - num_dense) * moe
            + embedding * (1 if c.tie_word_embeddings else 2)
            + h
        )
        mtp = moe + 2 * h + 2 * h * h + h + 2 * embedding
        return total + mtp_layers * mtp


__all__ = ["DeepseekV3"]
