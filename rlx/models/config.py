"""The `model` config group's schema: architecture in Megatron's names, plus where weights live."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlx.config.rules import AT_LEAST_1, Rule, one_of

# `model.kernels` choices: the kernel sets of rlx.models.kernels (which imports torch; this
# schema module must not) plus "auto".
KERNEL_CHOICES = ("auto", "liger", "compile", "torch")


@dataclass
class ModelConfig:
    """One model: the family that builds it, its shape, and its HF checkpoint directory.

    Shape keys use Megatron's names. For a real checkpoint they must agree with its
    config.json (checked before any model is built); for a tiny model they are what is written.
    """

    _target_: str = "rlx.models.qwen3.Qwen3"  # the model family class (spec + bridge + HF config)
    name: str = "tiny_qwen3"  # used for the tiny-model cache directory and in logs
    hf_checkpoint: str | None = None  # HF directory; None = the tiny model cached on first use
    tiny: bool = True  # write a random checkpoint for this shape on first use
    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int = 2  # key/value heads (GQA)
    kv_channels: int = 16  # head dim
    vocab_size: int = 16
    max_position_embeddings: int = 64
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-6
    tie_word_embeddings: bool = True
    qk_layernorm: bool = True  # RMSNorm on each head's queries and keys (Qwen3)
    # ---- dense-architecture options (Llama 3, GLM-4); each family pins the ones its HF class fixes
    add_qkv_bias: bool = False  # biases on the query/key/value projections only (GLM-4's attention_bias)
    post_sublayer_norms: bool = False  # RMSNorm on the attention and on the MLP output before each
    #   residual add (GLM-4's post_self_attn_layernorm / post_mlp_layernorm)
    rotary_percent: float = 1.0  # share of each head RoPE rotates (HF partial_rotary_factor; GLM-4: 0.5)
    rope_scaling_factor: float | None = None  # Llama 3.1 "llama3" RoPE scaling: context extension factor
    #   (8.0 for Llama 3.1); null = plain RoPE. The three keys below only apply when it is set.
    rope_scaling_low_freq_factor: float = 1.0  # llama3: wavelengths > original / this: divided by factor
    rope_scaling_high_freq_factor: float = 4.0  # llama3: wavelengths < original / this: kept; between: mixed
    rope_scaling_original_max_position_embeddings: int = 8192  # llama3: pre-training context ("original")
    init_seed: int = 0  # seed of a tiny model's random weights
    kernels: str = "auto"  # fused GPU kernels for the dense layers (rlx.models.kernels), used only when
    #   CUDA is available (the CPU always builds megatron's torch layers): liger (liger-kernel's
    #   SwiGLU and cross entropy, torch's RMSNorm; the `gpu` extra) | compile (torch.compile'd norms,
    #   megatron's fused SwiGLU and cross entropy) | auto (liger if installed, else compile) | torch
    #   (megatron's unfused layers). Any but torch also compiles RoPE and accumulates weight
    #   gradients in fp32 inside their GEMMs (bf16 training).
    megatron_overrides: dict[str, Any] = field(default_factory=dict)  # extra TransformerConfig kwargs

    # ---- Mixture of experts and multi-latent attention (Qwen3-MoE, DeepSeek-V3) ----------------
    # Megatron's names; the defaults (None / 0 / off) leave a dense model unchanged.
    num_moe_experts: int | None = None  # routed experts per MoE layer (HF num_experts); None: dense
    moe_router_topk: int = 2  # experts each token is routed to (HF num_experts_per_tok)
    moe_ffn_hidden_size: int | None = None  # FFN width of one routed expert (HF moe_intermediate_size)
    moe_shared_expert_intermediate_size: int | None = None  # all shared experts' width; None: none
    moe_router_score_function: str = "softmax"  # softmax (Qwen3-MoE) | sigmoid (DeepSeek-V3)
    moe_router_norm_topk_prob: bool = True  # renormalise the top-k weights to 1 (HF norm_topk_prob)
    moe_router_topk_scaling_factor: float | None = None  # scales the top-k weights (HF routed_scaling_factor)
    moe_router_num_groups: int | None = None  # expert groups of group-limited routing (HF n_group)
    moe_router_group_topk: int | None = None  # groups a token's experts may come from (HF topk_group)
    moe_router_enable_expert_bias: bool = False  # per-expert selection bias (HF e_score_correction_bias)
    moe_router_bias_update_rate: float = 0.0  # aux-loss-free balancing step; 0: bias fixed, as in HF
    moe_first_dense_layers: int = 0  # leading layers with a dense MLP (HF first_k_dense_replace)
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss weight; 0 keeps training logits == HF's
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather: how tokens reach EP ranks
    q_lora_rank: int | None = None  # MLA query latent rank; None: queries projected directly
    kv_lora_rank: int | None = None  # MLA key/value latent rank; None: not MLA
    qk_head_dim: int | None = None  # MLA query/key head size without RoPE (HF qk_nope_head_dim)
    qk_pos_emb_head_dim: int | None = None  # MLA query/key head size with RoPE (HF qk_rope_head_dim)
    v_head_dim: int | None = None  # MLA value head size (HF v_head_dim)
    yarn_rotary_scaling_factor: float | None = None  # YaRN RoPE factor (HF rope factor); None: plain
    yarn_original_max_position_embeddings: int | None = None  # YaRN: the pre-training context
    yarn_beta_fast: float = 32.0  # YaRN: high-frequency ramp boundary (rotations)
    yarn_beta_slow: float = 1.0  # YaRN: low-frequency ramp boundary (rotations)
    yarn_mscale: float = 1.0  # YaRN: attention-temperature coefficient of the cos/sin
    yarn_mscale_all_dim: float = 0.0  # YaRN: attention-temperature coefficient of the softmax scale

    RULES: ClassVar[dict[str, Rule]] = {
        **{
            key: AT_LEAST_1
            for key in (
                "num_layers",
                "hidden_size",
                "num_attention_heads",
                "vocab_size",
                "max_position_embeddings",
            )
        },
        "kernels": one_of(KERNEL_CHOICES),
    }


def shape_errors(m: ModelConfig) -> list[str]:
    """Rules between the model's own shape keys that Megatron's TransformerConfig does not check
    and its layers would break on only in the first forward pass (a traceback from a trainer rank)."""
    errors = []
    heads, groups = m.num_attention_heads, m.num_query_groups
    if groups is not None and groups >= 1 and heads >= 1 and heads % groups:
        errors.append(
            f"model.num_attention_heads={heads} is not a multiple of model.num_query_groups={groups} (each "
            "key/value group serves as many query heads); set model.num_query_groups to a divisor of "
            f"{heads} (1 = multi-query, {heads} = one group per head)"
        )
    mla = bool(m.kv_lora_rank)
    rotary = (m.qk_pos_emb_head_dim or 0) if mla else round((m.kv_channels or 0) * m.rotary_percent)
    if rotary % 2:
        what, change = (
            ("model.qk_pos_emb_head_dim", "model.qk_pos_emb_head_dim")
            if mla
            else ("model.kv_channels × model.rotary_percent", "model.kv_channels or model.rotary_percent")
        )
        errors.append(
            f"{what} = {rotary} rotary dimensions: RoPE rotates pairs, so it must be even; change {change}"
        )
    if m.num_moe_experts and m.moe_router_topk > m.num_moe_experts:
        errors.append(
            f"model.moe_router_topk={m.moe_router_topk} is more than model.num_moe_experts="
            f"{m.num_moe_experts}: a token cannot go to more experts than there are; set "
            f"model.moe_router_topk <= {m.num_moe_experts}"
        )
    if m.num_moe_experts and m.moe_first_dense_layers >= m.num_layers:
        errors.append(
            f"model.moe_first_dense_layers={m.moe_first_dense_layers} leaves no MoE layer of "
            f"model.num_layers={m.num_layers}; set it below {m.num_layers}, or model.num_moe_experts=null "
            "for a dense model"
        )
    return errors
