"""rlx.engine.triton_gemm: the layers' GEMMs of a small model at few rows, against F.linear in fp32
(bf16 on a GPU, fp32 in Triton's interpreter: conftest.py), its launch settings and when the
engine takes it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.mark.parametrize(
    "rows,k,n,bias",
    [(5, 576, 960, False), (64, 1024, 4096, False), (33, 3072, 1024, True), (1, 2048, 12288, False)],
    ids=[
        "SmolLM2's qkv, 5 rows",
        "Qwen3-0.6B's qkv, 64 rows",
        "a down_proj with bias, 33 rows",
        "1.7B gate_up, 1 row",
    ],
)
def test_small_gemm_matches_f_linear(rows, k, n, bias, device, dtype):
    """Every row of a tile whose rows are partly masked (5 of 16, 33 of 64, 1 of 16), K in
    64-element steps (576) and 128 (the others), 128-output tiles (12,288), a bias added before
    the rounding, as F.linear's epilogue adds it."""
    from rlx.engine.triton_gemm import small_gemm, small_gemm_settings

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, k, device=device, generator=g).to(dtype)
    w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype)
    b = torch.randn(n, device=device, generator=g).to(dtype) if bias else None
    out = small_gemm(x, w, b, small_gemm_settings(n, k))
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == dtype and out.shape == (rows, n)
    # bf16: the output's rounding (2^-8 of its magnitude) and the fp32 sums' order
    tolerance = 1e-2 * ref.abs().max().item() if dtype == torch.bfloat16 else 1e-4
    assert (out.float() - ref).abs().max().item() < tolerance


@pytest.mark.parametrize(
    "rows,k,n,bias", [(5, 576, 1536, False), (64, 1024, 3072, True)], ids=["SmolLM2", "0.6B, bias"]
)
def test_small_gemm_swiglu_matches_the_gemm_then_silu_mul(rows, k, n, bias, device, dtype):
    """gate_up's GEMM, silu and the product in one kernel (bench/decode_gemm_fused.py times it):
    silu(gate) * up rounded where the GEMM's output and `silu_mul` round (gate and up, then
    silu, then the product)."""
    from rlx.engine.triton_gemm import small_gemm, small_gemm_settings

    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(rows, k, device=device, generator=g).to(dtype)
    w = (torch.randn(2 * n, k, device=device, generator=g) * 0.05).to(dtype)
    b = torch.randn(2 * n, device=device, generator=g).to(dtype) if bias else None
    out = small_gemm(x, w, b, small_gemm_settings(n, k), swiglu=True)
    gate_up = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype).float()
    gate, up = gate_up[:, :n], gate_up[:, n:]
    ref = F.silu(gate).to(dtype).float() * up
    assert out.shape == (rows, n)
    tolerance = 2e-2 * ref.abs().max().item() if dtype == torch.bfloat16 else 1e-4
    assert (out.float() - ref).abs().max().item() < tolerance


def test_small_gemm_settings_by_the_weights_shape(device):
    """About 96 column tiles or more, tiles of 16-128 outputs dividing N; 128-element K steps (64
    beside 128-output tiles, or where 128 does not divide K); None where 16 does not divide."""
    from rlx.engine.triton_gemm import small_gemm_settings

    def tiles(n: int, k: int):
        s = small_gemm_settings(n, k)
        return None if s is None else (s["block_n"], s["block_k"])

    # Qwen3-0.6B: qkv 4,096 x 1,024 (128 tiles of 32), o 1,024 x 2,048 (64 of 16: fewer than 96,
    # the smallest tile), gate_up 6,144 (96 of 64), down 1,024 x 3,072; 1.7B's gate_up 12,288 (96 of 128)
    assert [tiles(n, k) for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))] == [
        (32, 128), (16, 128), (64, 128), (16, 128)
    ]  # fmt: skip
    assert tiles(12288, 2048) == (128, 64)
    assert tiles(960, 576) == (16, 64)  # SmolLM2's qkv: 60 tiles; 576 = 4.5 x 128
    assert tiles(3072, 576) == (32, 64)  # SmolLM2's gate_up: 96 tiles of 32
    assert tiles(1000, 1024) is None  # 1,000 outputs: 16 does not divide them
    assert tiles(1024, 1000) is None


def test_small_gemms_pay_only_on_hopper_under_pdl_for_small_weights(device, monkeypatch):
    """On an sm90+ GPU under PDL, every weight 2-byte and at most 16 MiB (Qwen3-0.6B's four: 4-13
    MB), unless RLX_ENGINE_SMALL_GEMM=0; not with one weight past it (1.7B's gate_up, 50 MB), in
    fp32, off CUDA or without PDL; a setting other than 0 or 1 is refused by its text."""
    import rlx.engine.triton_gemm as tg

    pdl = 2
    monkeypatch.setattr(tg, "pdl_mode", lambda device: pdl)
    monkeypatch.delenv("RLX_ENGINE_SMALL_GEMM", raising=False)
    gpu = torch.device("cuda", 0)

    def weights(*shapes, dtype=torch.bfloat16):
        return [torch.empty(shape, dtype=dtype, device="meta") for shape in shapes]

    small = weights((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))
    assert tg.small_gemms_pay(small, gpu)
    assert not tg.small_gemms_pay(small + weights((12288, 2048)), gpu)
    assert tg.small_gemms_pay(weights((4096, 2048)), gpu)  # 16 MiB exactly
    assert not tg.small_gemms_pay(weights((4096, 2064)), gpu)  # a shape it takes, 16.9 MB
    assert not tg.small_gemms_pay(weights((1024, 1024), dtype=torch.float32), gpu)
    assert not tg.small_gemms_pay(small, torch.device("cpu"))
    assert not tg.small_gemms_pay([], gpu)
    monkeypatch.setenv("RLX_ENGINE_SMALL_GEMM", "0")
    assert not tg.small_gemms_pay(small, gpu)
    monkeypatch.setenv("RLX_ENGINE_SMALL_GEMM", "on")
    with pytest.raises(ValueError, match=r"RLX_ENGINE_SMALL_GEMM='on': use 1 \(on, where it pays\) or 0"):
        tg.small_gemms_pay(small, gpu)
    monkeypatch.setenv("RLX_ENGINE_SMALL_GEMM", "1")
    pdl = 0  # before sm90, or PDL turned off
    assert not tg.small_gemms_pay(small, gpu)


def test_the_models_layer_gemms_take_it_at_few_rows_where_it_pays(device, dtype, monkeypatch):
    """`CausalLM.enable_small_gemms` gives every layer GEMM (merged qkv and gate_up, o, down) its
    settings where `small_gemms_pay` says so, never the LM head; a layer GEMM then runs
    `small_gemm` up to 64 rows and F.linear past them, the same product either way."""
    from helpers import tiny_qwen3_config  # tests/ is on sys.path (conftest)

    import rlx.engine.models.layers as layers
    import rlx.engine.triton_gemm as tg
    from rlx.engine.models.dense import CausalLM

    with torch.device("meta"):
        model = CausalLM(tiny_qwen3_config(), 64)
        model.merge_projections()
    monkeypatch.setattr(tg, "small_gemms_pay", lambda weights, device: False)
    assert not model.enable_small_gemms()
    assert all(m.small_settings is None for m in model.modules() if isinstance(m, layers.Linear))
    monkeypatch.setattr(tg, "small_gemms_pay", lambda weights, device: True)
    assert model.enable_small_gemms()
    chosen = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if getattr(m, "small_settings", None)}
    assert chosen == {"qkv_proj", "o_proj", "gate_up", "down_proj"}
    assert not hasattr(model.lm_head, "small_settings")  # a plain nn.Linear: cuBLAS at any rows

    linear = layers.Linear(64, 32, bias=False, device=device, dtype=dtype)
    linear.small_settings, linear.small_rows = tg.small_gemm_settings(32, 64), 64
    calls = []
    real = tg.small_gemm
    monkeypatch.setattr(tg, "small_gemm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.no_grad():
        for rows in (3, 64, 65):
            x = torch.randn(rows, 64, device=device).to(dtype)
            ref = F.linear(x.float(), linear.weight.float())
            tolerance = 1e-2 * ref.abs().max().item() if dtype == torch.bfloat16 else 1e-4
            assert (linear(x).float() - ref).abs().max().item() < tolerance
    assert calls == [3, 64]
