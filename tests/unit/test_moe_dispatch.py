"""The engine's static MoE expert paths on CPU (CI has no GPU): the token->expert dispatch by
hand, and the grouped and dense paths against a per-token reference and the host loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlx.engine.models.qwen3_moe import (
    EXPERT_PATHS,
    Qwen3MoeLM,
    dense_experts,
    grouped_experts,
    loop_experts,
    sort_by_expert,
)


def test_sort_by_expert_by_hand():
    # token 0 -> experts 2, 0; token 1 -> 0, 3; token 2 -> 2, 3; experts 1 and 4 get nothing
    index_TK = torch.tensor([[2, 0], [0, 3], [2, 3]])
    order_S, offsets_E = sort_by_expert(index_TK, num_experts=5)
    # flat pairs: 0:(t0,e2) 1:(t0,e0) 2:(t1,e0) 3:(t1,e3) 4:(t2,e2) 5:(t2,e3)
    assert order_S.tolist() == [1, 2, 0, 4, 3, 5]
    assert offsets_E.tolist() == [2, 2, 4, 6, 6]
    assert offsets_E.dtype == torch.int32
    assert (order_S // 2).tolist() == [0, 1, 0, 2, 1, 2]  # the token of each sorted row


def reference(x_TH, index_TK, weight_TK, gate_up, down):
    """Token by token, slot by slot: sum_k w_k * down_e(silu(gate_e x) * up_e x)."""
    inter = down.shape[2]
    out = torch.zeros_like(x_TH, dtype=torch.float64)
    for t in range(x_TH.shape[0]):
        x = x_TH[t].double()
        for e, w in zip(index_TK[t].tolist(), weight_TK[t].double().tolist(), strict=True):
            gate, up = gate_up[e, :inter].double() @ x, gate_up[e, inter:].double() @ x
            out[t] += w * (down[e].double() @ (F.silu(gate) * up))
    return out


def routed(num_tokens, num_experts, k, hidden=16, inter=8, seed=0, index_TK=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.3
    down = torch.randn(num_experts, hidden, inter, generator=g) * 0.3
    if index_TK is None:
        index_TK = torch.rand(num_tokens, num_experts, generator=g).topk(k, dim=-1).indices
    weight_TK = torch.rand(num_tokens, k, generator=g)
    return x, index_TK, weight_TK, gate_up, down


CASES = {
    "spread": dict(num_tokens=9, num_experts=6, k=2),
    "one token": dict(num_tokens=1, num_experts=6, k=3),
    "all on two experts": dict(num_tokens=7, num_experts=6, k=2, index_TK=torch.tensor([[4, 1]] * 7)),
    "k = E": dict(num_tokens=5, num_experts=3, k=3),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("path", sorted(EXPERT_PATHS))
def test_every_path_matches_the_per_token_sum(case, path):
    args = routed(**CASES[case])
    out = EXPERT_PATHS[path](*args)
    assert out.shape == args[0].shape and out.dtype == torch.float32
    assert (out.double() - reference(*args)).abs().max().item() < 1e-5


def test_static_paths_match_the_loop_in_bf16():
    x, index_TK, weight_TK, gate_up, down = routed(num_tokens=16, num_experts=8, k=2, hidden=32, inter=16)
    args = (x.bfloat16(), index_TK, weight_TK.bfloat16(), gate_up.bfloat16(), down.bfloat16())
    loop = loop_experts(*args).float()
    exact = reference(*args).float()
    for out in (grouped_experts(*args).float(), dense_experts(*args).float()):
        # each rounds at other points than the loop: bound by the loop's own bf16 error
        assert (out - exact).abs().max() <= 2 * (loop - exact).abs().max() + 1e-2


def test_decode_path_by_device_and_dtype():
    decode_path = Qwen3MoeLM.decode_path
    assert decode_path(None, torch.device("cpu"), torch.bfloat16) == "loop"
    # torch's grouped GEMM loops on the host for fp32 on CUDA: the dense path keeps decode static
    assert decode_path(None, torch.device("cuda"), torch.float32) == "dense"


def test_prefill_takes_the_grouped_gemm_where_decode_does_and_never_the_dense_path():
    step_path = Qwen3MoeLM.step_path
    assert [step_path("grouped", d) for d in (True, False)] == ["grouped", "grouped"]
    # fp32 or an older GPU: decode stays static in the dense path, prefill loops (dense is E/K the FLOPs)
    assert [step_path("dense", d) for d in (True, False)] == ["dense", "loop"]
    assert [step_path("loop", d) for d in (True, False)] == ["loop", "loop"]
