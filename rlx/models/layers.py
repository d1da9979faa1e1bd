"""Megatron layer pieces shared by the dense families, beyond what megatron-core's local spec offers.

- `local_layer_spec`: megatron's local (no Transformer Engine) GPT layer spec with the core
  attention on torch SDPA, fused GPU kernels where a `rlx.models.kernels.KernelSet` brings them
  (with `rlx.models.residual_norm`'s layer where its norms take the residual adds in, and
  `rlx.models.self_attention`'s where its q norm reads the query heads in place),
  and `PostNormTransformerLayer` where the architecture asks for it; `block_spec` adds the
  decoder's final norm.
- `PostNormTransformerLayer`: a TransformerLayer that also normalises the attention output and the
  MLP output before each residual add (GLM-4's `post_self_attn_layernorm` / `post_mlp_layernorm`).
  megatron-core 0.16 has no option for these norms.
- `apply_llama3_rope_scaling`: Llama 3.1's "llama3" RoPE frequency scaling with all of its
  parameters (megatron's GPTModel forwards only the factor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from rlx.models.attention import SDPAttention
from rlx.models.bridge import unwrap
from rlx.models.config import ModelConfig
from rlx.models.kernels import KernelSet
from rlx.models.residual_norm import AddNormTransformerLayer, PendingAddNorm
from rlx.models.self_attention import QKNormSelfAttention


def local_layer_spec(
    config: TransformerConfig, *, post_sublayer_norms: bool = False, kernels: KernelSet | None = None
) -> ModuleSpec:
    """The decoder layer spec: megatron's local spec, SDPA core attention, `kernels`' norm and
    SwiGLU modules (where set), optional post-norms."""
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if kernels is not None:
        _use_kernels(spec, config, kernels)
    if not post_sublayer_norms:
        if isinstance(spec.submodules.pre_mlp_layernorm, type) and issubclass(
            spec.submodules.pre_mlp_layernorm, PendingAddNorm
        ):
            spec.module = AddNormTransformerLayer  # the residual adds into the norms after them
        return spec
    base = spec.submodules
    norm = base.pre_mlp_layernorm  # the same norm class (RMSNorm here) as the layer's other norms
    return ModuleSpec(
        module=PostNormTransformerLayer,
        submodules=PostNormLayerSubmodules(
            **{f.name: getattr(base, f.name) for f in fields(base)},
            post_self_attn_layernorm=norm,
            post_mlp_layernorm=norm,
        ),
    )


def _use_kernels(spec: ModuleSpec, config: TransformerConfig, kernels: KernelSet) -> None:
    """Put `kernels`' RMSNorms in the norm slots of `spec` (hidden-size and q/k norms apart) and its
    SwiGLU in the MLP's activation slot (read by megatron's MLP only under `use_te_activation_func`,
    see rlx.models.kernels)."""
    layer = spec.submodules
    if config.normalization == "RMSNorm":
        if kernels.norm is not None:
            layer.input_layernorm = layer.pre_mlp_layernorm = kernels.norm()
        if kernels.qk_norm is not None and config.qk_layernorm:
            attention = layer.self_attention.submodules
            attention.q_layernorm = attention.k_layernorm = kernels.qk_norm()
            if getattr(attention.q_layernorm, "reads_grouped_rows", False):
                layer.self_attention.module = QKNormSelfAttention  # q normalised where it lies
    if kernels.swiglu is not None and config.use_te_activation_func:
        layer.mlp.submodules.activation_func = kernels.swiglu()


def block_spec(
    config: TransformerConfig,
    layer_spec: ModuleSpec,
    kernels: KernelSet | None = None,
    vp_stage: int | None = None,
):
    """`layer_spec` for this pipeline stage's layers (of its virtual chunk `vp_stage`), as a
    block whose final norm is `kernels`' RMSNorm; just `layer_spec` (megatron adds its own final
    norm) when there is none."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if kernels is None or kernels.norm is None or config.normalization != "RMSNorm":
        return layer_spec
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=kernels.norm(),
    )


@dataclass
class PostNormLayerSubmodules(TransformerLayerSubmodules):
    """TransformerLayerSubmodules plus the norms on the attention and MLP outputs."""

    post_self_attn_layernorm: ModuleSpec | type = IdentityOp
    post_mlp_layernorm: ModuleSpec | type = IdentityOp


class PostNormTransformerLayer(TransformerLayer):
    """megatron's TransformerLayer with a norm on each sublayer's output before its residual add:

        h = x + post_self_attn_layernorm(attention(input_layernorm(x)))
        y = h + post_mlp_layernorm(mlp(pre_mlp_layernorm(h)))

    megatron calls `self_attn_bda(training, fused)(output_and_bias, residual, dropout)` exactly
    where a sublayer's output meets the residual, so the norms go inside those two calls; the rest
    of megatron's forward (recompute, offloading, inference paths) is used unchanged.
    """

    def __init__(self, config: TransformerConfig, submodules: PostNormLayerSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.post_self_attn_layernorm = build_module(
            submodules.post_self_attn_layernorm,
            config=config,
            hidden_size=config.hidden_size,
            eps=config.layernorm_epsilon,
        )
        self.post_mlp_layernorm = build_module(
            submodules.post_mlp_layernorm,
            config=config,
            hidden_size=config.hidden_size,
            eps=config.layernorm_epsilon,
        )
        # Plain callables (partials), not modules: the norms must be registered once, under the
        # names above, or state dicts and checkpoints would hold them twice.
        self.self_attn_bda = partial(_norm_before_add, self.post_self_attn_layernorm, self.self_attn_bda)
        self.mlp_bda = partial(_norm_before_add, self.post_mlp_layernorm, self.mlp_bda)


def _norm_before_add(norm: torch.nn.Module, bda: Callable, training: bool, fused: bool) -> Callable:
    """`bda(training, fused)` with `norm` applied to the sublayer output (bias included) first."""
    add = bda(training, fused)

    def norm_then_add(output_and_bias, residual, dropout_prob):
        output, bias = output_and_bias
        if bias is not None:
            output = output + bias
        return add((norm(output), None), residual, dropout_prob)

    return norm_then_add


def apply_llama3_rope_scaling(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """Rescale `model`'s RoPE inverse frequencies as Llama 3.1's "llama3" rope_type does.

    GPTModel(rope_scaling=True) passes only the factor on; the low/high frequency factors and the
    original context stay at megatron's built-in 1, 4 and 8192. So the model is built unscaled
    and its frequencies are rescaled here with megatron's own formula and all four of `cfg`'s
    values (the same arithmetic as transformers' `_compute_llama3_parameters`). Must run before
    the first forward: megatron caches the rotary table per sequence length.
    """
    rotary = unwrap(model).rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq,
        factor=cfg.rope_scaling_factor,
        low_freq_factor=cfg.rope_scaling_low_freq_factor,
        high_freq_factor=cfg.rope_scaling_high_freq_factor,
        original_max_position_embeddings=cfg.rope_scaling_original_max_position_embeddings,
    )
