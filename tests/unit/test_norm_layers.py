"""The layers built around rlx's GPU norms, on CPU: the residual adds fused into the norms after
them (rlx.models.residual_norm) and the q norm reading the query heads where they lie
(rlx.models.self_attention).

The GPU's norm (rlx.models.triton_norm) needs triton; here torch norms with the same protocols
(`_norm`, `_add_norm`; `reads_grouped_rows`) stand in, so what is checked is the wiring: each add
handed to the norm that really follows it (the layer's pre-MLP norm, the next layer's input norm,
the block's final norm), that norm's output used only for that very sum, the q norm given megatron's
query view rather than its copy, and models built so giving megatron's own logits and gradients bit
for bit (the same arithmetic in a different place).
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
from helpers import megatron_world  # tests/ is on sys.path (conftest)

from rlx.config import build
from rlx.config.compose import compose
from rlx.models.family import ModelFamily
from rlx.models.kernels import KernelSet
from rlx.models.residual_norm import AddNormTransformerLayer, PendingAddNorm, link_residual_norms


class TorchAddRMSNorm(PendingAddNorm, torch.nn.RMSNorm):
    """torch's RMSNorm with the fused norm's protocol; counts its calls of each kind."""

    calls = {"norm": 0, "add_norm": 0}

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)

    def _norm(self, x):
        TorchAddRMSNorm.calls["norm"] += 1
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def _add_norm(self, x, residual):
        TorchAddRMSNorm.calls["add_norm"] += 1
        s = x + residual
        return s, torch.nn.functional.rms_norm(s, self.normalized_shape, self.weight, self.eps)


class TorchQKNorm(torch.nn.RMSNorm):
    """torch's RMSNorm (any leading shape) that takes the query heads as they lie; records the
    inputs it was given."""

    reads_grouped_rows = True
    inputs: list = []

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)

    def forward(self, x):
        TorchQKNorm.inputs.append((tuple(x.shape), x.is_contiguous()))
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight, self.eps)


@pytest.fixture
def family() -> ModelFamily:
    return build(compose(["model=tiny_qwen3"]).model)


def logits_and_grads(
    family: ModelFamily, fused: bool, ids_BL: torch.Tensor, qk: bool = False, **config
) -> tuple:
    """(logits, {name: grad}, adds linked) of the tiny Qwen3 with its checkpoint's weights, every
    norm's weight made distinct (so a norm used in another's place would show), with the fused
    norms (`fused`) or megatron's, and the q/k norms reading the query in place (`qk`)."""
    kernels = KernelSet(
        "torch",
        norm=(lambda: TorchAddRMSNorm) if fused else None,
        qk_norm=(lambda: TorchQKNorm) if qk else None,
    )
    family.kernels = lambda: kernels  # the spec's norms; no other fusion (the set's name is "torch")
    with megatron_world():
        gpt = family.build_model(**config)
        family.load_hf_weights(gpt, family.checkpoint_dir())
        with torch.no_grad():
            for i, (name, p) in enumerate(sorted(gpt.named_parameters())):
                if "layernorm" in name:
                    p.copy_(1 + 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
        linked = link_residual_norms(gpt)  # a second linking changes nothing (build_model's was first)
        positions = torch.arange(ids_BL.shape[1]).expand_as(ids_BL)
        logits = gpt(ids_BL, positions, attention_mask=None)
        logits.float().pow(2).mean().backward()
        return logits.detach(), {n: p.grad for n, p in gpt.named_parameters()}, linked


def test_a_model_with_its_adds_fused_gives_megatrons_logits_and_gradients(family):
    ids_BL = torch.randint(0, family.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    layers = family.cfg.num_layers
    ref_logits, ref_grads, ref_linked = logits_and_grads(family, False, ids_BL)
    TorchAddRMSNorm.calls.update(norm=0, add_norm=0)
    logits, grads, linked = logits_and_grads(family, True, ids_BL)
    assert ref_linked == 0
    assert linked == 2 * layers  # each layer's two adds: pre-MLP norm, the next input / final norm
    # every hidden-size norm but the first layer's input norm (after the embedding) took its add
    assert TorchAddRMSNorm.calls == {"norm": 1, "add_norm": 2 * layers}
    assert torch.equal(logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name


def test_a_dropped_model_is_freed_at_once(family):
    """No reference cycle through the layers (megatron's bias-dropout-adds kept as the instance's
    bound methods made one): a model dropped after a forward and backward is freed by reference
    counting, its weights and any norm's held result with it, without the cyclic GC."""
    ids_BL = torch.randint(0, family.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    kernels = KernelSet("torch", norm=lambda: TorchAddRMSNorm)
    family.kernels = lambda: kernels
    gc.disable()
    try:
        with megatron_world():
            gpt = family.build_model()
            assert link_residual_norms(gpt) == 2 * family.cfg.num_layers
            gpt(ids_BL, torch.arange(12).expand_as(ids_BL), attention_mask=None).sum().backward()
            layer, final_norm = weakref.ref(gpt.decoder.layers[0]), weakref.ref(gpt.decoder.final_layernorm)
            del gpt
            assert layer() is None and final_norm() is None
    finally:
        gc.enable()


def test_the_q_norm_reads_the_query_heads_where_they_lie(family):
    """The tiny Qwen3 has 2 query heads a KV group: megatron's reshape copies the query; with
    QKNormSelfAttention the q norm gets the [s, b, groups, heads a group, d] view of the fused
    projection instead, and the model's logits and gradients are megatron's bit for bit."""
    from rlx.models.self_attention import QKNormSelfAttention

    cfg = family.cfg
    assert cfg.num_attention_heads // cfg.num_query_groups == 2
    ids_BL = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_grads, _ = logits_and_grads(family, False, ids_BL)
    TorchQKNorm.inputs.clear()
    logits, grads, _ = logits_and_grads(family, True, ids_BL, qk=True)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(g, ref_grads[n]) for n, g in grads.items())
    # per layer: the query as the 5-d view (not contiguous), then the key [s, b, groups, d]
    query = ((12, 2, cfg.num_query_groups, 2, cfg.kv_channels), False)
    key = ((12, 2, cfg.num_query_groups, cfg.kv_channels), False)
    assert TorchQKNorm.inputs == [query, key] * cfg.num_layers
    with megatron_world():
        gpt = family.build_model()
        assert all(isinstance(layer.self_attention, QKNormSelfAttention) for layer in gpt.decoder.layers)


def test_full_recompute_keeps_megatrons_adds(family):
    """A checkpointed chunk's last add would hold its sum and norm (and the chunk's recomputed
    graph) past the backward: with full recompute nothing is linked, and the model still trains
    with the fused norms' class as plain norms."""
    ids_BL = torch.randint(0, family.cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    TorchAddRMSNorm.calls.update(norm=0, add_norm=0)
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    logits, grads, linked = logits_and_grads(family, True, ids_BL, **recompute)
    assert linked == 0 and TorchAddRMSNorm.calls["add_norm"] == 0
    ref_logits, ref_grads, _ = logits_and_grads(family, False, ids_BL, **recompute)
    assert torch.equal(logits, ref_logits)
    assert all(torch.equal(g, ref_grads[n]) for n, g in grads.items())


def test_a_norm_uses_its_pending_result_only_for_that_very_sum():
    config = type("C", (), {})()
    norm = TorchAddRMSNorm(config, 8)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x, r = torch.randn(3, 8), torch.randn(3, 8)
    s = norm.add_then_norm(x, r)
    assert torch.equal(s, x + r)
    same_values = s.clone()  # equal values, another tensor: computed afresh, the pair dropped
    TorchAddRMSNorm.calls.update(norm=0, add_norm=0)
    expected = torch.nn.functional.rms_norm(x + r, (8,), norm.weight, norm.eps)
    assert torch.equal(norm(same_values), expected) and TorchAddRMSNorm.calls["norm"] == 1
    assert norm._pending is None
    s = norm.add_then_norm(x, r)
    assert torch.equal(norm(s), expected) and TorchAddRMSNorm.calls["norm"] == 1  # the pending one
    assert norm._pending is None  # released once used


def test_the_fused_layer_is_built_only_where_the_norm_can_take_the_add():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rlx.models.layers import local_layer_spec

    config = TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=2, normalization="RMSNorm", qk_layernorm=True
    )
    fused = KernelSet("test", norm=lambda: TorchAddRMSNorm)
    assert local_layer_spec(config, kernels=fused).module is AddNormTransformerLayer
    assert local_layer_spec(config, kernels=KernelSet("torch")).module is not AddNormTransformerLayer
    # GLM-4's post-sublayer norms sit between the sublayer and its add: megatron's layer, theirs
    post = local_layer_spec(config, kernels=fused, post_sublayer_norms=True)
    assert not issubclass(post.module, AddNormTransformerLayer)
    assert dataclasses.is_dataclass(post.submodules)
