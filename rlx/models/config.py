"""The `model` config group's schema: architecture in Megatron's names, plus where weights live."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    qk_layernorm: bool = True
    init_seed: int = 0  # seed of a tiny model's random weights
    megatron_overrides: dict[str, Any] = field(default_factory=dict)  # extra TransformerConfig kwargs

    # ---- Mixture of experts and multi-latent attention (Qwen3-MoE, DeepSeek-V3) ----------------
    # Megatron's names; the defaults (None / 0 / off) leave a dense model unchanged.
    num_moe_experts: int | None = None  # routed experts per MoE layer (HF num_experts / n_routed_experts); None: dense
    moe_router_topk: int = 2  # experts each token is routed to (HF num_experts_per_tok)
    moe_ffn_hidden_size: int | None = None  # FFN width of one routed expert (HF moe_intermediate_size)
    moe_shared_expert_intermediate_size: int | None = None  # width of all shared experts together; None: no shared expert
    moe_router_score_function: str = "softmax"  # softmax (Qwen3-MoE) | sigmoid (DeepSeek-V3)
    moe_router_norm_topk_prob: bool = True  # renormalise the top-k weights to sum to 1 (HF norm_topk_prob)
    moe_router_topk_scaling_factor: float | None = None  # multiplies the top-k weights (HF routed_scaling_factor)
    moe_router_num_groups: int | None = None  # expert groups for group-limited routing (HF n_group); None: off
    moe_router_group_topk: int | None = None  # groups a token's experts may come from (HF topk_group)
    moe_router_enable_expert_bias: bool = False  # per-expert selection bias (HF e_score_correction_bias)
    moe_router_bias_update_rate: float = 0.0  # aux-loss-free balancing step; 0 keeps the bias fixed, as HF does
    moe_first_dense_layers: int = 0  # leading layers with a dense MLP of ffn_hidden_size (HF first_k_dense_replace)
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss weight; 0 keeps training logits == HF logits
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather: how tokens reach expert-parallel ranks
    q_lora_rank: int | None = None  # MLA query compression rank; None: queries projected directly
    kv_lora_rank: int | None = None  # MLA key/value compression rank; None: not MLA
    qk_head_dim: int | None = None  # MLA per-head query/key size without RoPE (HF qk_nope_head_dim)
    qk_pos_emb_head_dim: int | None = None  # MLA per-head query/key size with RoPE (HF qk_rope_head_dim)
    v_head_dim: int | None = None  # MLA per-head value size (HF v_head_dim)
    yarn_rotary_scaling_factor: float | None = None  # YaRN RoPE context factor (HF rope factor); None: plain RoPE
    yarn_original_max_position_embeddings: int | None = None  # YaRN: pre-training context length
    yarn_beta_fast: float = 32.0  # YaRN: high-frequency ramp boundary (rotations)
    yarn_beta_slow: float = 1.0  # YaRN: low-frequency ramp boundary (rotations)
    yarn_mscale: float = 1.0  # YaRN: attention-temperature coefficient of the cos/sin
    yarn_mscale_all_dim: float = 0.0  # YaRN: attention-temperature coefficient of the softmax scale
