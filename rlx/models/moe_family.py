"""`MoEFamily`: the Megatron side shared by mixture-of-experts families (Qwen3-MoE, DeepSeek-V3).

What it adds to `ModelFamily`:

- TransformerConfig kwargs for dropless, deterministic routing (no capacity factor, no token
  dropping, no fused kernels), the expert-parallel size from megatron's parallel state, and
  sequence parallelism whenever TP > 1 (megatron's MoE layer refuses to train without it);
- an `MLATransformerConfig` when the model uses multi-latent attention;
- a per-layer spec list (dense MLP for the first `moe_first_dense_layers`, MoE after), each on
  megatron's local spec with the SDPA core attention, sliced to this pipeline stage;
- loading and exporting through `MoEWeightBridge`, which shards routed experts by EP rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlx.errors import ConfigError
from rlx.models.family import ModelFamily
from rlx.models.moe_bridge import MoEWeightBridge, ParallelGroups


class MoEFamily(ModelFamily):
    """Base of MoE families; subclasses give the HF side, the weight table and `mla_kwargs`."""

    # HF computes the router in fp32 (DeepSeek-V3) or in the model dtype (Qwen3-MoE).
    router_dtype: str | None = None

    def mla_kwargs(self) -> dict[str, Any]:
        """MLATransformerConfig fields; empty for standard attention."""
        return {}

    def moe_kwargs(self) -> dict[str, Any]:
        """TransformerConfig kwargs of the MoE layers (from `model.*`) and of the EP/SP layout."""
        cfg = self.cfg
        sizes = self.parallel_sizes()
        tp = sizes["tp"]
        grouped = (cfg.moe_router_num_groups or 1) > 1
        softmax = cfg.moe_router_score_function == "softmax"
        return dict(
            num_moe_experts=cfg.num_moe_experts,
            moe_router_topk=cfg.moe_router_topk,
            moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
            moe_router_score_function=cfg.moe_router_score_function,
            # Softmax over all experts then top-k keeps HF's weights; top-k then softmax over the
            # k is the same as HF's renormalised top-k (norm_topk_prob).
            moe_router_pre_softmax=softmax and not cfg.moe_router_norm_topk_prob,
            moe_router_topk_scaling_factor=cfg.moe_router_topk_scaling_factor,
            moe_router_num_groups=cfg.moe_router_num_groups if grouped else None,
            moe_router_group_topk=cfg.moe_router_group_topk if grouped else None,
            moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=cfg.moe_router_bias_update_rate,
            moe_router_dtype=self.router_dtype,
            moe_layer_freq=self.moe_layer_pattern(),
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
            moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
            # Dropless and unfused: every token reaches all of its top-k experts, as in HF.
            moe_expert_capacity_factor=None,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_fusion=False,
            expert_model_parallel_size=sizes["ep"],
            sequence_parallel=tp > 1,
        )

    def moe_layer_pattern(self) -> list[int]:
        """1 for an MoE layer, 0 for a dense one, per global layer."""
        first_dense = self.cfg.moe_first_dense_layers
        return [0 if i < first_dense else 1 for i in range(self.cfg.num_layers)]

    def check_routing(self) -> None:
        """Refuse routing settings where megatron's router cannot reproduce HF's."""
        cfg = self.cfg
        problems = []
        if not cfg.num_moe_experts:
            problems.append("model.num_moe_experts must be set for an MoE family")
        if (
            cfg.moe_router_score_function == "sigmoid"
            and cfg.moe_router_topk > 1
            and not cfg.moe_router_norm_topk_prob
        ):
            problems.append(
                "model.moe_router_norm_topk_prob=false: megatron always renormalises sigmoid top-k weights"
            )
        groups, group_topk = cfg.moe_router_num_groups or 1, cfg.moe_router_group_topk or 1
        if groups > 1 and cfg.moe_router_topk != 2 * group_topk:
            # HF scores a group by its top-2 experts, megatron by its top (topk / group_topk).
            problems.append(
                f"model.moe_router_topk={cfg.moe_router_topk} must be 2 * model.moe_router_group_topk="
                f"{group_topk} when model.moe_router_num_groups={groups} (HF ranks groups by their "
                "top-2 experts)"
            )
        if problems:
            raise ConfigError("unsupported MoE routing:\n  " + "\n  ".join(problems))

    # ---- Megatron side -------------------------------------------------------------------------

    def fusion_kwargs(self, params_dtype: torch.dtype, *, rotary_interleaved: bool) -> dict[str, Any]:
        """None: `model.kernels` covers the dense layer spec only; the MoE and MLA layers keep
        megatron's unfused ones (their parity is tested that way)."""
        return {}

    def transformer_config_inputs(self, *, params_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """The base config's kwargs and MLA's fields, after the routing checks."""
        self.check_routing()
        return super().transformer_config_inputs(params_dtype=params_dtype) | {
            "MLATransformerConfig": self.mla_kwargs()
        }

    def transformer_config(self, *, params_dtype: torch.dtype = torch.float32, **overrides):
        """The base TransformerConfig, as an `MLATransformerConfig` when the model uses MLA."""
        self.check_routing()
        config = super().transformer_config(params_dtype=params_dtype, **overrides)
        mla = self.mla_kwargs()
        if not mla:
            return config
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
        return MLATransformerConfig(**(fields | mla))

    def layer_spec(self, config, vp_stage: int | None = None):
        """This pipeline stage's (virtual chunk's) layer specs: dense MLP or MoE per layer, SDPA
        core attention."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.post_training.modelopt.layers import Linear
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from megatron.core.transformer.transformer_block import (
            TransformerBlockSubmodules,
            get_num_layers_to_build,
        )
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from rlx.models.attention import SDPAttention

        def spec(num_experts: int | None):
            layer = get_gpt_layer_local_spec(
                num_experts=num_experts,
                moe_grouped_gemm=False,
                qk_layernorm=config.qk_layernorm,
                multi_latent_attention=config.multi_latent_attention,
                normalization=config.normalization,
            )
            attention = layer.submodules.self_attention.submodules
            attention.core_attention = SDPAttention
            if config.multi_latent_attention:
                # The local spec makes the latent down-projections column-parallel and gathers
                # their outputs; the RoPE key part is then used by each rank's heads only and its
                # gradient is never summed over TP (wrong gradients for TP > 1). Megatron's TE spec
                # keeps them whole on every rank ("duplicated"), as this plain Linear does; its
                # weights are marked sequence-parallel, so their gradients are summed over TP.
                attention.linear_q_down_proj = Linear
                attention.linear_kv_down_proj = Linear
            return layer

        dense, moe = spec(None), spec(config.num_moe_experts)
        layers = [moe if is_moe else dense for is_moe in self.moe_layer_pattern()]
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        local = layers[offset : offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
        return TransformerBlockSubmodules(layer_specs=local, layer_norm=WrappedTorchNorm)

    def build_model(self, **kwargs):
        """`ModelFamily.build_model`, after checking the experts divide over expert-parallel ranks."""
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ep = ps.get_expert_model_parallel_world_size()
            if self.cfg.num_moe_experts and self.cfg.num_moe_experts % ep:
                raise ValueError(
                    f"model.num_moe_experts={self.cfg.num_moe_experts} is not divisible by "
                    f"expert parallel size {ep}"
                )
        # Like the torch norms, the router weight and MLA's whole-on-every-rank down-projections
        # are created on the CPU: the caller moves the model to its device (the trainer does).
        return super().build_model(**kwargs)

    def weight_bridge(self) -> MoEWeightBridge:
        return MoEWeightBridge(self.weight_mappings())

    def weight_mappings(self) -> dict:
        """Megatron parameter template -> HF tensors (subclasses)."""
        raise NotImplementedError

    def load_hf_weights(self, model: torch.nn.Module, hf_dir: str | Path) -> None:
        """Load this rank's TP shard and its EP share of the experts; checks config.json first."""
        self.check_hf_config(hf_dir)
        self.weight_bridge().load(model, hf_dir, ParallelGroups.from_megatron())

    def export_hf_weights(
        self, model: torch.nn.Module | list[torch.nn.Module]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, every expert included (a collective over TP, expert TP, EP and
        the pipeline stages; every rank gets every tensor); `model` as `ModelFamily`'s."""
        from rlx.models.stages import as_chunks, gather_stages

        bridge, groups = self.weight_bridge(), ParallelGroups.from_megatron()
        return gather_stages([bridge.export(chunk, groups) for chunk in as_chunks(model)])
