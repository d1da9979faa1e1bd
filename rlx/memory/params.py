"""How many of the model's parameters one GPU holds, from the model family's own count.

`ModelFamily.num_parameters()` (the dense formula, or a family's own for MoE and MLA) counts the
whole model. This module only splits that count the way megatron places it, so no second formula
of a family's layers exists here:

- the input embedding (vocab x hidden) on the first pipeline stage, split over TP;
- the output layer (vocab x hidden) on the last stage, split over TP; a tied one is the
  embedding itself with PP = 1, and a copy of it on the last stage with PP > 1 (megatron's
  shared embedding);
- the routed experts of the MoE layers (experts x 3 x hidden x expert FFN, SwiGLU), split over EP
  and, inside an expert, over the expert tensor-parallel size (megatron's default: TP);
- the rest (attention, dense MLPs, shared experts, routers, norms, the final norm) in equal shares
  per layer, split over TP. Approximate: norms, routers and MLA's down-projections are in fact
  replicated on every TP rank (a few hidden-sized vectors per layer), and with dense leading layers
  (DeepSeek-V3's first three) a stage holding them holds more than the average layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlx.config.build import build
from rlx.models.config import ModelConfig


@dataclass(frozen=True)
class ModelParams:
    """The family's parameter count of a model, split by where megatron places each part."""

    total: int  # ModelFamily.num_parameters()
    embedding: int  # vocab x hidden
    output: int  # an untied output layer's vocab x hidden; 0 when tied
    experts: int  # the routed experts of every MoE layer
    hidden_size: int
    moe_layers: tuple[bool, ...]  # per layer: MoE (True) or dense

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def per_layer(self) -> float:
        """The parameters of an average layer outside its routed experts (the final norm included)."""
        return (self.total - self.embedding - self.output - self.experts) / self.num_layers

    @property
    def per_moe_layer_experts(self) -> float:
        return self.experts / max(sum(self.moe_layers), 1)


def model_params(model: ModelConfig) -> ModelParams:
    """The count of `model`'s family (`model._target_`), split."""
    family = build(model)
    h = model.hidden_size
    moe = tuple(
        bool(model.num_moe_experts) and i >= model.moe_first_dense_layers for i in range(model.num_layers)
    )
    per_layer_experts = (model.num_moe_experts or 0) * 3 * h * (model.moe_ffn_hidden_size or 0)
    return ModelParams(
        total=family.num_parameters(),
        embedding=model.vocab_size * h,
        output=0 if model.tie_word_embeddings else model.vocab_size * h,
        experts=sum(moe) * per_layer_experts,
        hidden_size=h,
        moe_layers=moe,
    )


@dataclass(frozen=True)
class RankParams:
    """One trainer rank's parameters: `dense` (sharded by the distributed optimizer over the
    data- and context-parallel ranks) and `expert` (over the expert-data-parallel ranks)."""

    dense: int
    expert: int

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The layers pipeline stage `stage` of `pp` holds (megatron's even split; checked at compose)."""
    per_stage = num_layers // pp
    return range(stage * per_stage, (stage + 1) * per_stage)


def rank_params(
    p: ModelParams, *, tp: int, pp: int, ep: int, stage: int, value_head: bool = False
) -> RankParams:
    """The parameters a trainer rank of pipeline stage `stage` holds. `value_head`: PPO's critic,
    whose output layer is a hidden -> 1 head (replicated) instead of the vocabulary."""
    layers = stage_layers(p.num_layers, pp, stage)
    dense = len(layers) * p.per_layer / tp
    if stage == 0:
        dense += p.embedding / tp
    if stage == pp - 1:
        if value_head:
            dense += p.hidden_size + 1
        elif p.output:
            dense += p.output / tp
        elif pp > 1:  # tied: the last stage keeps its own copy of the embedding for the output layer
            dense += p.embedding / tp
    expert = sum(p.moe_layers[i] for i in layers) * p.per_moe_layer_experts / (ep * tp)
    return RankParams(round(dense), round(expert))


def lora_params(model: ModelConfig, lora, *, tp: int, pp: int, ep: int, stage: int) -> RankParams:
    """The LoRA adapters (`train.lora`, rlx.lora) a trainer rank of pipeline stage `stage` holds: per
    adapted layer A [rank, in] and B [out, rank], the factor on the layer's split dimension split
    over TP like the layer (column-parallel: B; row-parallel: A). The layers: attention's projections
    (fused q/k/v and output; MLA's q (or q up-) and kv up-projections), the dense MLP's or the shared
    experts' fc1 (gate and up) and fc2, each routed expert's with `lora.experts` (over EP)."""
    from rlx.lora.config import ALL_LINEAR

    r, h, every = lora.rank, model.hidden_size, ALL_LINEAR in lora.target_modules

    def column(name: str, inputs: int, outputs: int) -> float:
        return r * (inputs + outputs / tp) if every or name in lora.target_modules else 0

    def row(name: str, inputs: int, outputs: int) -> float:
        return r * (inputs / tp + outputs) if every or name in lora.target_modules else 0

    def mlp(ffn: int) -> float:
        return column("linear_fc1", h, 2 * ffn) + row("linear_fc2", ffn, h) if ffn else 0

    heads = model.num_attention_heads
    if model.kv_lora_rank:  # multi-latent attention
        q_out = heads * (model.qk_head_dim + model.qk_pos_emb_head_dim)
        attention = (
            (column("linear_q_up_proj", model.q_lora_rank, q_out) if model.q_lora_rank
             else column("linear_q_proj", h, q_out))
            + column("linear_kv_up_proj", model.kv_lora_rank, heads * (model.qk_head_dim + model.v_head_dim))
            + row("linear_proj", heads * model.v_head_dim, h)
        )  # fmt: skip
    else:
        q, kv = heads * model.kv_channels, model.num_query_groups * model.kv_channels
        attention = column("linear_qkv", h, q + 2 * kv) + row("linear_proj", q, h)
    dense = expert = 0.0
    for i in stage_layers(model.num_layers, pp, stage):
        dense += attention
        if not model.num_moe_experts or i < model.moe_first_dense_layers:
            dense += mlp(model.ffn_hidden_size)
            continue
        dense += mlp(model.moe_shared_expert_intermediate_size or 0)
        if lora.experts:  # (rlx.lora.rules: adapted experts run under TP 1)
            expert += model.num_moe_experts / ep * mlp(model.moe_ffn_hidden_size)
    return RankParams(round(dense), round(expert))


def engine_params(p: ModelParams, gpus_per_engine: int) -> int:
    """The parameters one GPU of an engine holds: the whole model over the engine's tensor-parallel
    GPUs (rlx's own engine takes one; SGLang's replicates norms, counted as split here)."""
    return -(-p.total // gpus_per_engine)
