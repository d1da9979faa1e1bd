"""Where the engine's layers take the small GEMM (rlx.engine.models.layers): only inside
`small_gemms_in_graphs` (the decode graphs' warm-up and capture) and at most `small_rows` rows;
an eager step (a short prefill chunk) keeps F.linear, cuBLAS's on the GPU. On the CPU, without
Triton: a recorder stands in for rlx.engine.triton_gemm (the gate is checked, not the kernel:
tests/kernels checks that)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from rlx.engine.models.layers import GatedMLP, Linear, small_gemms_in_graphs


@pytest.fixture
def calls(monkeypatch) -> list[tuple[int, bool]]:
    """(rows, swiglu) of each small_gemm call; it returns what the torch path would."""
    made = []

    def small_gemm(x, weight, bias, settings, swiglu=False):
        made.append((x.shape[0], swiglu))
        out = F.linear(x, weight, bias)
        if swiglu:
            gate, up = out.chunk(2, -1)
            return F.silu(gate) * up
        return out

    monkeypatch.setitem(sys.modules, "rlx.engine.triton_gemm", types.SimpleNamespace(small_gemm=small_gemm))
    return made


def test_the_small_gemm_only_inside_the_graphs_context_and_up_to_its_rows(calls):
    torch.manual_seed(0)
    linear = Linear(8, 4)
    linear.small_settings, linear.small_rows = {"block_n": 32}, 4
    mlp = GatedMLP(8, 16)
    mlp.merge_projections()
    mlp.small_swiglu, mlp.small_rows = {"block_n": 32}, 4
    x = torch.randn(3, 8)
    eager = linear(x), mlp(x)
    assert calls == []  # an eager step: the torch path
    with small_gemms_in_graphs():
        graphed = linear(x), mlp(x)
        assert calls == [(3, False), (3, True)]
        linear(torch.randn(5, 8)), mlp(torch.randn(5, 8))  # past small_rows
        assert len(calls) == 2
        with small_gemms_in_graphs():  # nested (a capture inside a warm-up's scope): still inside
            linear(x)
        linear(x)
        assert len(calls) == 4
    for a, b in zip(eager, graphed, strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError), small_gemms_in_graphs():  # a capture that fails
        raise RuntimeError("capture failed")
    linear(x), mlp(x)
    assert len(calls) == 4  # eager again after either exit
