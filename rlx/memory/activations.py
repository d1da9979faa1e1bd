"""Activation memory of one transformer layer of rlx's trainer, per micro-batch, on one rank.

The method is Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022), section 4: count, tensor by tensor, what autograd keeps from a layer's forward pass for its
backward. Their total, 34·s·b·h + 5·a·s²·b bytes per layer (16-bit, GPT-3's layer: LayerNorm,
GeLU MLP of 4h, dropout), does not fit the layer rlx trains, which is megatron's local (no
Transformer Engine) spec with RMSNorm, a SwiGLU MLP, grouped-query attention, optional q/k norms,
no dropout, and torch SDPA for the core attention (`rlx.models.attention`). A fused SDPA kernel
(flash, cuDNN, memory-efficient) keeps q, k, v, its output and one fp32 log-sum-exp per head and
query, never the s x s scores, so the 5·a·s²·b term (softmax, its dropout mask) is gone; what
remains is recounted below for this layer. Bytes per token of a rank's micro-batch, `e` bytes per
activation (2 in bf16, 4 in fp32), `h_s` = h / TP with sequence parallelism (rlx turns it on for
MoE under TP), else h:

    attention   e·[2·h_s                  input norm's input, the QKV projection's input
                   + (a + 2g)·d / TP      QKV output (v is a view of it, kept by SDPA; so is q/k-norm's input,
                                          on GPUs: `rlx.models.self_attention`; megatron's own path, the
                                          CPU's, copies q for its norm where a group has several heads)
                   + (a + g)·d / TP       RoPE'd q and k, kept by SDPA (CP > 1: q, and the all-gathered
                                          k and v of the whole sequence, 2·g·d·CP)
                   + a·d / TP             SDPA's output, the output projection's input
                   + h_s]                 only with post-sublayer norms (GLM-4): that norm's input
                + 4·a / TP                SDPA's log-sum-exp (fp32)
    dense MLP   e·[2·h_s                  pre-MLP norm's input, fc1's input
                   + 2f / TP              fc1's output, kept by a fused SwiGLU (liger's, megatron's compiled)
                     (3f / TP unfused: the gate's SiLU output as well; MoE and MLA families, model.kernels=torch)
                   + f / TP               fc2's input
                   + h_s]                 only with post-sublayer norms
    MoE MLP     e·[2·h_s + E              pre-MLP norm's and router's input, the router's probabilities
                   + k·(h + 4·f_e / TP + h)  per routed copy: the expert's fc1 input, its SwiGLU (unfused)
                                          and fc2 input, its output kept for the weighted sum; routing
                                          balanced over the EP ranks (an unbalanced step holds more)
                   + 4·f_s / TP]          the shared expert's SwiGLU and fc2 input
    MLA         `mla_attention_bytes`: the latent projections' inputs and outputs, then as above.

With sequence packing (`train.max_tokens_per_micro_batch`), each micro-batch carries its L x L
boolean block-diagonal mask (L bytes a row), and SDPA, given a boolean mask, makes an additive
bias in the activation dtype that its memory-efficient kernel keeps for the backward: e·L bytes
per query token and layer (CP > 1: each rank's queries against all L keys). This is the term a
varlen kernel would remove; it is the least certain of the model, not yet measured on a GPU.

Activation recompute (`train.recompute`): `full` keeps each layer's input (e·h_s a token) and,
during the backward, one layer's activations at a time; `selective` recomputes the core
attention, which with a fused kernel drops only its log-sum-exp and a packed mask's bias.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlx.models.config import ModelConfig


@dataclass(frozen=True)
class Layout:
    """How a micro-batch and a layer are split on one trainer rank."""

    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False  # megatron's SP: the h-sized activations split over TP
    dtype_bytes: int = 2  # activations' bytes (bf16: 2, fp32: 4)
    fused_swiglu: bool = True  # a fused SwiGLU keeps fc1's output only (not its SiLU as well)


def hidden_share(m: ModelConfig, lay: Layout) -> float:
    return m.hidden_size / lay.tp if lay.sequence_parallel else m.hidden_size


def attention_bytes(m: ModelConfig, lay: Layout) -> float:
    """Bytes a token's attention keeps for the backward (standard attention; MLA below)."""
    if m.kv_lora_rank:
        return mla_attention_bytes(m, lay)
    a, g, d, tp, cp = m.num_attention_heads, m.num_query_groups, m.kv_channels, lay.tp, lay.cp
    rope_qk = (a + g) * d if cp == 1 else a * d + 2 * g * d * cp
    kept = 2 * hidden_share(m, lay) + ((a + 2 * g) * d + rope_qk + a * d) / tp
    kept += hidden_share(m, lay) if m.post_sublayer_norms else 0
    return lay.dtype_bytes * kept + 4 * a / tp


def mla_attention_bytes(m: ModelConfig, lay: Layout) -> float:
    """Multi-latent attention (DeepSeek-V3), counted the same way: the input norm's and the
    down-projections' input (2·h_s), q's latent and its norm's output (2·q_lora, when q has one),
    the key/value latent with the RoPE key part and its norm's output (2·kv_lora + rope), q's and
    the key/value up-projections' outputs (a·(qk + rope) + a·(qk + v), TP-split), the RoPE'd q and
    k kept by SDPA (2·a·(qk + rope)), its output (a·v); CP > 1 adds the all-gathered k and v of
    the rest of the sequence. Approximate: the down-projections are replicated over TP."""
    a, tp, cp = m.num_attention_heads, lay.tp, lay.cp
    qk, rope, v = m.qk_head_dim or 0, m.qk_pos_emb_head_dim or 0, m.v_head_dim or 0
    latent = 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + rope
    heads = a * (qk + rope) + a * (qk + v) + 2 * a * (qk + rope) + a * v
    heads += (cp - 1) * a * (qk + rope + v)
    return lay.dtype_bytes * (2 * hidden_share(m, lay) + latent + heads / tp) + 4 * a / tp


def mlp_bytes(m: ModelConfig, lay: Layout, moe: bool) -> float:
    """Bytes a token's MLP (dense, or routed experts + shared expert) keeps for the backward."""
    h_s, tp, e = hidden_share(m, lay), lay.tp, lay.dtype_bytes
    if not moe:
        f = m.ffn_hidden_size
        kept = 2 * h_s + (2 * f if lay.fused_swiglu else 3 * f) / tp + f / tp
        kept += h_s if m.post_sublayer_norms else 0
        return e * kept
    f_e, f_s = m.moe_ffn_hidden_size or 0, m.moe_shared_expert_intermediate_size or 0
    routed = m.moe_router_topk * (2 * m.hidden_size + 4 * f_e / tp)
    return e * (2 * h_s + (m.num_moe_experts or 0) + routed + 4 * f_s / tp)


def packed_mask_bytes(seq_len: int, lay: Layout) -> float:
    """A packed micro-batch's per-layer mask bias kept by SDPA, per query token: e·L (module docstring)."""
    return lay.dtype_bytes * seq_len


@dataclass(frozen=True)
class MicroBatch:
    """One trainer micro-batch: `rows` sequences of `seq_len` tokens (padded), or one packed row."""

    rows: int
    seq_len: int
    packed: bool = False

    def local_tokens(self, cp: int) -> int:
        """The tokens a rank's layers see (its CP share of every row)."""
        return self.rows * self.seq_len // cp


def layer_bytes(m: ModelConfig, lay: Layout, mb: MicroBatch, *, moe: bool, recompute: str = "none") -> int:
    """Bytes one layer keeps for the backward for micro-batch `mb`, under `recompute`'s policy
    (`full`: the layer's input only; the one layer rebuilt during the backward is `layer_bytes`
    with recompute none, counted once by the caller)."""
    tokens = mb.local_tokens(lay.cp)
    if recompute == "full":
        return round(tokens * lay.dtype_bytes * hidden_share(m, lay))
    per_token = attention_bytes(m, lay) + mlp_bytes(m, lay, moe)
    if recompute == "selective":  # the core attention is rebuilt: its log-sum-exp is not kept
        per_token -= 4 * m.num_attention_heads / lay.tp
    elif mb.packed:
        per_token += packed_mask_bytes(mb.seq_len, lay)
    return round(tokens * per_token)


def mask_bytes(mb: MicroBatch, cp: int) -> int:
    """A packed micro-batch's boolean attention mask (this rank's query rows x every key), alive
    from its forward to its backward; 0 unpacked (causal masks are the kernel's own)."""
    return mb.seq_len // cp * mb.seq_len if mb.packed else 0


def logits_bytes(m: ModelConfig, mb: MicroBatch, *, tp: int, cp: int, dtype_bytes: int) -> int:
    """The output layer's logits (this rank's vocabulary shard, every position of its tokens) in the
    activation dtype, which rlx's log-prob function keeps for its backward (it never copies them to
    fp32: `rlx.trainer.logprobs`)."""
    return mb.local_tokens(cp) * (m.vocab_size // tp) * dtype_bytes
