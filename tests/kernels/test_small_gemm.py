"""rlx.engine.triton_gemm: the layers' GEMMs of small weights at few rows, against F.linear in fp32
(bf16 on a GPU, fp32 in Triton's interpreter: conftest.py), gate_up's SwiGLU, o's and down's
split partials and the norm that sums them, the launch settings and when the engine takes it."""

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


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
def test_small_gemm_split_partials_sum_to_f_linear(bias, device, dtype):
    """Qwen3-0.6B's o at 40 rows, K in four runs of 512: four fp32 partials, each its run's
    product (the bias in the first alone; a tile of 64 rows, the rows past 40 of one part
    written into none of the next), whose sum is the product."""
    from rlx.engine.triton_gemm import small_gemm, small_split_settings

    rows, k, n = 40, 2048, 1024
    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(rows, k, device=device, generator=g).to(dtype)
    w = (torch.randn(n, k, device=device, generator=g) * 0.02).to(dtype)
    b = torch.randn(n, device=device, generator=g).to(dtype) if bias else None
    settings = small_split_settings(n, k)
    assert settings["split"] == 4
    parts = small_gemm(x, w, b, settings)
    assert parts.dtype == torch.float32 and parts.shape == (4, rows, n)
    for i, part in enumerate(parts):
        run = F.linear(x[:, i * 512 : (i + 1) * 512].float(), w[:, i * 512 : (i + 1) * 512].float())
        if i == 0 and b is not None:
            run += b.float()
        tolerance = 1e-3 * run.abs().max().item() if dtype == torch.bfloat16 else 1e-4
        assert (part - run).abs().max().item() < tolerance, i
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert (parts.sum(0) - ref).abs().max().item() < 4 * tolerance


@pytest.mark.parametrize("split", [1, 2], ids=["whole", "split"])
def test_small_gemm_tiles_rows_past_the_tile(split, device, dtype):
    """100 rows in two tiles of 64 (the second 36 rows: the rest read as zeros, their stores
    dropped), split or whole."""
    from rlx.engine.triton_gemm import small_gemm, small_gemm_settings

    rows, k, n = 100, 256, 512
    g = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(rows, k, device=device, generator=g).to(dtype)
    w = (torch.randn(n, k, device=device, generator=g) * 0.05).to(dtype)
    out = small_gemm(x, w, None, small_gemm_settings(n, k) | {"split": split})
    assert out.shape == ((rows, n) if split == 1 else (split, rows, n))
    ref = F.linear(x.float(), w.float())
    got = out.float() if split == 1 else out.sum(0)
    tolerance = 1e-2 * ref.abs().max().item() if dtype == torch.bfloat16 else 1e-4
    assert (got - ref).abs().max().item() < tolerance


@pytest.mark.parametrize("split", [2, 4])
def test_add_rms_norm_sums_partials_as_the_rounded_product(split, device, dtype):
    """`add_rms_norm` of S fp32 partials is `add_rms_norm` of their sum (in order) rounded to the
    activation dtype, bit for bit: the product a whole GEMM would have rounded."""
    from rlx.engine.triton_layers import add_rms_norm

    rows, n = 7, 1024
    g = torch.Generator(device=device).manual_seed(3)
    parts = torch.randn(split, rows, n, device=device, generator=g)
    residual = torch.randn(rows, n, device=device, generator=g).to(dtype)
    weight = torch.randn(n, device=device, generator=g).to(dtype)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    out, new_residual = add_rms_norm(parts, residual, weight, 1e-6)
    ref_out, ref_residual = add_rms_norm(total.to(dtype), residual, weight, 1e-6)
    assert out.dtype == new_residual.dtype == dtype
    assert torch.equal(new_residual, ref_residual) and torch.equal(out, ref_out)


def test_gated_mlp_swiglu_and_split_down_give_the_norms_input(device, dtype):
    """A gated MLP whose gate_up takes its SwiGLU in the GEMM and whose down returns two partials
    (as `enable_small_gemms` sets it up): the norm after it gets what the plain MLP gives it."""
    from rlx.engine import triton_gemm as tg
    from rlx.engine.models.layers import GatedMLP, small_gemms_in_graphs
    from rlx.engine.triton_layers import add_rms_norm

    hidden, inter, rows = 64, 256, 12
    torch.manual_seed(4)
    mlp = GatedMLP(hidden, inter)
    mlp.merge_projections()
    mlp = mlp.to(device=device, dtype=dtype)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.1)
    x = torch.randn(rows, hidden, device=device).to(dtype)
    residual = torch.randn(rows, hidden, device=device).to(dtype)
    weight = torch.ones(hidden, device=device, dtype=dtype)
    with torch.no_grad():
        ref, ref_residual = add_rms_norm(mlp(x), residual, weight, 1e-6)
        mlp.small_swiglu, mlp.small_rows = tg.small_swiglu_settings(inter, hidden), tg.SMALL_ROWS
        mlp.down_proj.small_settings = tg.small_split_settings(hidden, inter)
        mlp.down_proj.small_rows = tg.SMALL_ROWS
        with small_gemms_in_graphs():  # where the engine takes them: its decode graphs
            parts = mlp(x)
        out, new_residual = add_rms_norm(parts, residual, weight, 1e-6)
    assert parts.shape == (2, rows, hidden)
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4
    assert (new_residual.float() - ref_residual.float()).abs().max().item() < tolerance * 4
    assert (out.float() - ref.float()).abs().max().item() < tolerance * ref.abs().max().item()


def test_small_gemm_settings_by_the_weights_shape(device):
    """About 96 column tiles or more, tiles of 32-128 outputs dividing N (16 where 32 does not);
    128-element K steps (64 beside 128-output tiles, or where 128 does not divide K); None where
    16 does not divide."""
    from rlx.engine.triton_gemm import small_gemm_settings

    def tiles(n: int, k: int):
        s = small_gemm_settings(n, k)
        return None if s is None else (s["block_n"], s["block_k"])

    # Qwen3-0.6B: qkv 4,096 x 1,024 (128 tiles of 32), o 1,024 x 2,048 (32 of 32: fewer than 96,
    # the smallest tile), gate_up 6,144 (96 of 64), down 1,024 x 3,072; 1.7B's gate_up 12,288 (96 of 128)
    assert [tiles(n, k) for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))] == [
        (32, 128), (32, 128), (64, 128), (32, 128)
    ]  # fmt: skip
    assert tiles(12288, 2048) == (128, 64)
    assert tiles(960, 576) == (32, 64)  # SmolLM2's qkv: 30 tiles; 576 = 4.5 x 128
    assert tiles(3072, 576) == (32, 64)  # SmolLM2's gate_up: 96 tiles of 32
    assert tiles(528, 1024) == (16, 128)  # 33 x 16: 32 does not divide it
    assert tiles(1000, 1024) is None  # 1,000 outputs: 16 does not divide them
    assert tiles(1024, 1000) is None


def test_split_and_swiglu_settings(device):
    """K split in halves while the programs stay at most 128 and each run is whole K steps;
    stages as many (at most 6) as the rows' tile of 64 and the weight tiles (two with SwiGLU)
    fit in 200 KB; the weight asked of the L2 where it is at most 16 MiB."""
    from rlx.engine.triton_gemm import small_gemm_settings, small_split_settings, small_swiglu_settings

    def split(n: int, k: int):
        return small_split_settings(n, k)["split"]

    # Qwen3-0.6B's o and down: 32 tiles of 32 -> 128 programs; SmolLM2's down: 18 tiles -> 72;
    # SmolLM2's o (576 x 576): 576 is 9 steps of 64, no halves; 1.7B's o: 64 tiles -> 128
    assert [split(1024, 2048), split(1024, 3072), split(576, 1536), split(576, 576)] == [4, 4, 4, 1]
    assert split(2048, 2048) == 2 and split(2048, 6144) == 2
    assert small_split_settings(1024, 2048, programs=256)["split"] == 8
    assert small_split_settings(1000, 2048) is None
    # 0.6B's gate_up halves (3,072 x 1,024): (64 + 2 x 32) x 128 x 2 B = 32 KB a stage -> 6;
    # 1.7B's (6,144 x 2,048): tiles of 64 x 128 -> 48 KB -> 4; 128-output tiles of 64 -> 40 KB -> 5
    assert small_swiglu_settings(3072, 1024)["num_stages"] == 6
    assert small_swiglu_settings(6144, 2048)["num_stages"] == 4
    assert small_gemm_settings(12288, 2048)["block_n"] == 128
    assert small_gemm_settings(12288, 2048)["num_stages"] == 6  # 24 KB a stage
    assert small_swiglu_settings(12288, 2048)["num_stages"] == 5
    # 1.7B: qkv 16 MiB asked of the L2, down 24 MiB and gate_up 48 MiB not (that lost: Decisions)
    assert small_gemm_settings(4096, 2048)["prefetch"]
    assert not small_split_settings(2048, 6144)["prefetch"]
    assert not small_swiglu_settings(6144, 2048)["prefetch"] and small_swiglu_settings(3072, 1024)["prefetch"]


def test_small_gemms_on_hopper_under_pdl_for_small_weights(device, monkeypatch):
    """The engine takes the kernel on an sm90+ GPU under PDL, with a Triton that has TMA
    descriptors, unless RLX_ENGINE_SMALL_GEMM=0 (a setting other than 0 or 1 is refused by its
    text); a weight takes it where it is 2-byte and at most 64 MiB (Qwen3-0.6B's four: 4-13 MB;
    1.7B's four: 8-50 MB; not Qwen3-4B's gate_up, 100 MB)."""
    import rlx.engine.triton_gemm as tg

    pdl = 2
    monkeypatch.setattr(tg, "pdl_mode", lambda device: pdl)
    monkeypatch.delenv("RLX_ENGINE_SMALL_GEMM", raising=False)
    gpu = torch.device("cuda", 0)
    assert tg.small_gemms_on(gpu) and not tg.small_gemms_on(torch.device("cpu"))
    monkeypatch.setenv("RLX_ENGINE_SMALL_GEMM", "0")
    assert not tg.small_gemms_on(gpu)
    monkeypatch.setenv("RLX_ENGINE_SMALL_GEMM", "on")
    with pytest.raises(ValueError, match=r"RLX_ENGINE_SMALL_GEMM='on': use 1 \(on, where it pays\) or 0"):
        tg.small_gemms_on(gpu)
    monkeypatch.setenv("RLX_ENGINE_SMALL_GEMM", "1")
    assert tg.small_gemms_on(gpu)
    pdl = 0  # before sm90, or PDL turned off
    assert not tg.small_gemms_on(gpu)
    pdl = 2
    monkeypatch.setattr(tg, "TensorDescriptor", None)  # a Triton without TMA descriptors
    assert not tg.small_gemms_on(gpu)

    def takes(*shape, dtype=torch.bfloat16):
        return tg.small_gemm_takes(torch.empty(shape, dtype=dtype, device="meta"))

    assert all(takes(*shape) for shape in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)))
    assert takes(4096, 2048) and takes(12288, 2048)  # 1.7B's qkv and gate_up
    assert takes(16384, 2048)  # 64 MiB exactly
    assert not takes(19456, 2560) and not takes(16384, 2064)  # 4B's gate_up; a shape it takes, 64.5 MiB
    assert not takes(1024, 1024, dtype=torch.float32) and not takes(1000, 1024)
    assert not tg.small_gemm_takes(torch.empty(2048, 1024, dtype=torch.bfloat16, device="meta").t())


def test_the_models_layer_gemms_take_it_at_few_rows_where_it_pays(device, dtype, monkeypatch):
    """`CausalLM.enable_small_gemms` gives each layer GEMM (merged qkv and gate_up, o, down) its
    settings where the engine takes the kernel and the weight is small enough, never the LM head;
    o and down (summed by the next add_rms_norm) with a split, not where a layer's post-norms
    (GLM-4) add their outputs itself; gate_up's MLP its SwiGLU (gate_up none of its own, which
    nothing would read), gate_up its own where the SwiGLU has none. A layer GEMM then runs
    `small_gemm` up to 64 rows and F.linear past them, the same product either way."""
    from helpers import tiny_qwen3_config  # tests/ is on sys.path (conftest)

    import rlx.engine.models.layers as layers
    import rlx.engine.triton_gemm as tg
    from rlx.engine.models.dense import CausalLM

    def tiny(post_norms: bool = False) -> CausalLM:
        with torch.device("meta"):
            model = CausalLM(tiny_qwen3_config(), 64)
            model.merge_projections()  # as the engine builds it: merged, then in the serving dtype
            model = model.to(torch.bfloat16)
        for layer in model.model.layers:
            layer.post_norms = post_norms
        return model

    def chosen(model) -> set[str]:
        return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if getattr(m, "small_settings", None)}

    model = tiny()
    monkeypatch.setattr(tg, "small_gemms_on", lambda device: False)
    assert not model.enable_small_gemms() and not chosen(model)
    monkeypatch.setattr(tg, "small_gemms_on", lambda device: True)
    assert model.enable_small_gemms()
    # gate_up through its MLP's SwiGLU, not on its own
    assert chosen(model) == {"qkv_proj", "o_proj", "down_proj"}
    assert not hasattr(model.lm_head, "small_settings")  # a plain nn.Linear: cuBLAS at any rows
    for layer in model.model.layers:
        o, down = layer.self_attn.o_proj, layer.mlp.down_proj
        assert "split" in o.small_settings and "split" in down.small_settings
        assert "split" not in layer.self_attn.qkv_proj.small_settings
        assert layer.mlp.small_swiglu == tg.small_swiglu_settings(128, 64) and layer.mlp.small_rows == 64
        assert layer.mlp.gate_up.small_settings is None
    model = tiny(post_norms=True)
    assert model.enable_small_gemms()
    assert not any(
        "split" in (m.small_settings or {}) for m in model.modules() if isinstance(m, layers.Linear)
    )
    # weights of the tiny layer: qkv 128 x 64 and down 64 x 128 (16 KB), o 8 KB, gate_up 32 KB
    monkeypatch.setattr(tg, "MAX_WEIGHT_BYTES", 16 << 10)
    model = tiny()
    assert model.enable_small_gemms() and chosen(model) == {"qkv_proj", "o_proj", "down_proj"}
    assert all(layer.mlp.small_swiglu is None for layer in model.model.layers)
    # a SwiGLU the kernel does not take (no settings, as for 2 x 1,000 outputs): gate_up on its own
    monkeypatch.setattr(tg, "MAX_WEIGHT_BYTES", 64 << 20)
    monkeypatch.setattr(tg, "small_swiglu_settings", lambda n, k: None)
    model = tiny()
    assert model.enable_small_gemms() and "gate_up" in chosen(model)
    assert all(layer.mlp.small_swiglu is None for layer in model.model.layers)
    monkeypatch.setattr(tg, "MAX_WEIGHT_BYTES", 4 << 10)
    model = tiny()
    assert not model.enable_small_gemms() and not chosen(model)

    linear = layers.Linear(64, 32, bias=False, device=device, dtype=dtype)
    linear.small_settings, linear.small_rows = tg.small_gemm_settings(32, 64), 64
    calls = []
    real = tg.small_gemm
    monkeypatch.setattr(tg, "small_gemm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    with torch.no_grad(), layers.small_gemms_in_graphs():  # where the engine takes it: its decode graphs
        for rows in (3, 64, 65):
            x = torch.randn(rows, 64, device=device).to(dtype)
            ref = F.linear(x.float(), linear.weight.float())
            tolerance = 1e-2 * ref.abs().max().item() if dtype == torch.bfloat16 else 1e-4
            assert (linear(x).float() - ref).abs().max().item() < tolerance
    assert calls == [3, 64]
    with torch.no_grad():  # an eager step: cuBLAS
        linear(torch.randn(3, 64, device=device).to(dtype))
    assert calls == [3, 64]
