"""The residual add fused into the RMSNorm that reads it next, in megatron's TransformerLayer.

A pre-norm layer adds each sublayer's output to the residual stream and normalises the sum at
once: `h = x + attention(..)`, then `pre_mlp_layernorm(h)`; the MLP's sum is the next layer's
input, normalised first by its `input_layernorm` (or by the block's final norm). Apart, the add
reads two tensors and writes one and the norm reads that one again; in the backward the residual
stream's gradient and the norm's input gradient meet in one more add. A norm with
`_add_norm(x, residual) -> (s, y)` does both in one kernel each way (`rlx.models.triton_norm`'s:
at the 1.7B shape the separate adds were 0.07 s of a 3.15 s training step on 1×H100).

Megatron's layer has no slot for it: its bias-dropout-add returns the sum, and the norm is called
on it next. So `AddNormTransformerLayer`'s bias-dropout-add calls the following norm's
`add_then_norm`, which computes both, keeps (s, y) and returns s; the norm's next forward returns
y when its input is that very tensor s, and computes as always otherwise (either way the pair is
dropped). `link_residual_norms` turns this on, telling each layer which norm follows its MLP: the
next layer's input norm, the block's final norm, none at a pipeline stage's end.

Left to megatron's own add: a bias or a training-time dropout on the sublayer's output, a layer
whose norms are recomputed or offloaded (megatron wraps the norm calls), full activation recompute
(a checkpointed chunk's last add would keep its pair, and with it the chunk's recomputed graph, past
the backward), and norms without `_add_norm`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer


class PendingAddNorm:
    """Mixin for a norm module with `_norm(x) -> y` and `_add_norm(x, residual) -> (x + residual,
    y of that sum)`: `add_then_norm` computes both and keeps them for `forward`."""

    _pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def add_then_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x + residual; its norm is held for this module's next call on exactly that sum."""
        s, y = self._add_norm(x, residual)
        self._pending = (s, y)
        return s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] is x:
            return pending[1]
        return self._norm(x)


class AddNormTransformerLayer(TransformerLayer):
    """megatron's TransformerLayer whose residual adds go into the norm that follows each of them
    (see the module's docstring), once `link_residual_norms` has linked it; megatron's forward is
    used unchanged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the norms after the attention's and the MLP's adds; tuples, so not registered as
        # submodules (each is already one, of this layer or of the next)
        self._attn_norm: tuple[torch.nn.Module | None] = (None,)
        self._mlp_norm: tuple[torch.nn.Module | None] = (None,)
        # megatron's bias-dropout-adds (functions) move aside so that `self_attn_bda` / `mlp_bda`
        # are this class's methods: kept as the instance's bound methods they would make the layer
        # a reference cycle, freed (with the model's weights) only when the cyclic GC next ran
        self._attn_add, self._mlp_add = self.__dict__.pop("self_attn_bda"), self.__dict__.pop("mlp_bda")

    def fusable(self) -> bool:
        """Whether megatron calls this layer's norms directly (no recompute or offload of them, no
        full activation recompute)."""
        return not (
            self.recompute_input_layernorm
            or self.recompute_pre_mlp_layernorm
            or self.offload_attn_norm
            or self.offload_mlp_norm
            or self.config.recompute_granularity == "full"
        )

    def self_attn_bda(self, training: bool, fused: bool) -> Callable:
        return _add_into(self._attn_norm[0], self._attn_add(training, fused), training)

    def mlp_bda(self, training: bool, fused: bool) -> Callable:
        return _add_into(self._mlp_norm[0], self._mlp_add(training, fused), training)


def _add_into(norm: PendingAddNorm | None, add: Callable, training: bool) -> Callable:
    """megatron's bias-dropout-add `add`, through `norm.add_then_norm` where nothing but the add is
    asked for."""
    if norm is None:
        return add

    def add_then_norm(output_and_bias, residual: torch.Tensor, dropout_prob: float) -> torch.Tensor:
        output, bias = output_and_bias
        if (
            bias is not None
            or (training and dropout_prob > 0)
            or output.shape != residual.shape
            or output.dtype != residual.dtype  # an fp32 residual stream: megatron's add promotes
        ):
            return add(output_and_bias, residual, dropout_prob)
        return norm.add_then_norm(output, residual)

    return add_then_norm


def link_residual_norms(model: torch.nn.Module) -> int:
    """Link each fusable `AddNormTransformerLayer` of `model`'s blocks to the norms after its adds
    (its pre-MLP norm; the next layer's input norm if that layer is fusable too, else the block's
    final norm for its last layer); the adds linked."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    def fusing(norm) -> PendingAddNorm | None:
        return norm if isinstance(norm, PendingAddNorm) else None

    linked = 0
    for block in (m for m in model.modules() if isinstance(m, TransformerBlock)):
        layers = list(block.layers)
        for i, layer in enumerate(layers):
            if not (isinstance(layer, AddNormTransformerLayer) and layer.fusable()):
                continue
            if i + 1 < len(layers):
                after = layers[i + 1]
                following = (
                    after.input_layernorm
                    if isinstance(after, AddNormTransformerLayer) and after.fusable()
                    else None
                )
            else:
                following = getattr(block, "final_layernorm", None)
            layer._attn_norm = (fusing(layer.pre_mlp_layernorm),)
            layer._mlp_norm = (fusing(following),)
            linked += sum(n is not None for n in (layer._attn_norm[0], layer._mlp_norm[0]))
    return linked
