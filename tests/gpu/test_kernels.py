"""Fused kernels (rlx.models.kernels) against megatron's unfused layers, in bf16, on a GPU.

Skipped without a GPU. Run on the GPU machine:
    source .whl/install.sh && python3 -m pytest tests/gpu/test_kernels.py -q -s

bf16 results of two implementations cannot agree bit for bit, so each fused piece is measured,
with the unfused one, against an fp32 computation from the same bf16 inputs and weights, and
must be no less accurate: its max and mean error at most `RATIO` times the unfused error (plus
`FLOOR`, for outputs the unfused path gets exactly right). This holds for the forward output and
every gradient. `-s` prints the figures. Whole models: a 4-layer Qwen3 (hidden 1024) with each
kernel set against `model.kernels=torch`, same HF weights, per-token losses and gradients.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from helpers import megatron_world  # tests/ is on sys.path (conftest)

from rlx.config import build
from rlx.config.compose import compose
from rlx.models.kernels import KERNEL_SETS, compiled_rope
from rlx.models.precision import half_precision

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HAVE_LIGER = importlib.util.find_spec("liger_kernel") is not None
FUSED_SETS = [
    pytest.param("liger", marks=pytest.mark.skipif(not HAVE_LIGER, reason="no liger-kernel")),
    "compile",
]
RATIO = 1.5  # fused error / unfused error against fp32, max and mean
FLOOR = 1e-5  # slack, relative to max |fp32|, for outputs the unfused path computes in fp32 exactly


def errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max, mean) |got - ref|, in fp64."""
    d = (got.double() - ref.double()).abs()
    return d.max().item(), d.mean().item()


def assert_no_less_accurate(name: str, fused, unfused, ref, ratio: float = RATIO) -> None:
    """Each tensor of `fused` is at least about as close to `ref` (fp32) as `unfused` is."""
    for i, (f, u, r) in enumerate(zip(fused, unfused, ref, strict=True)):
        fe, ue = errors(f, r), errors(u, r)
        floor = FLOOR * r.abs().max().item()
        print(
            f"\n{name}[{i}] |fused-fp32| {fe[0]:.2e}/{fe[1]:.2e}  |unfused-fp32| {ue[0]:.2e}/{ue[1]:.2e}",
            end="",
        )
        assert fe[0] <= ratio * ue[0] + floor, (name, i, fe, ue)
        assert fe[1] <= ratio * ue[1] + floor, (name, i, fe, ue)


def run(fn, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> list[torch.Tensor]:
    """[output, grad of each input] of `fn(*inputs)` backpropagating `grad_out`."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return [out.detach(), *(x.grad for x in leaves)]


@pytest.fixture(scope="module")
def device():
    torch.backends.cuda.matmul.allow_tf32 = False
    with megatron_world():
        yield torch.device("cuda", torch.cuda.current_device())


class _Config:
    """The TransformerConfig fields the norm modules read."""

    normalization = "RMSNorm"
    sequence_parallel = False
    layernorm_zero_centered_gamma = False


@pytest.mark.parametrize("kernels", [k for k in KERNEL_SETS if KERNEL_SETS[k].norm is not None])
@pytest.mark.parametrize("width", [2048, 128])  # a hidden state; one q/k head (qk-norm)
def test_rms_norm(device, kernels, width):
    torch.manual_seed(0)
    x = torch.randn(1024, 4, width, device=device, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(width, device=device)).to(torch.bfloat16)
    dy = torch.randn_like(x)
    norm = KERNEL_SETS[kernels].norm()(_Config(), width, eps=1e-6).to(device, torch.bfloat16)
    unfused_norm = torch.nn.RMSNorm(width, eps=1e-6).to(device, torch.bfloat16)
    reference_norm = torch.nn.RMSNorm(width, eps=1e-6).to(device)

    def with_weight(module):
        return lambda x, w: torch.func.functional_call(module, {"weight": w}, (x,))

    fused = run(with_weight(norm), [x, w], dy)
    unfused = run(with_weight(unfused_norm), [x, w], dy)
    ref = run(with_weight(reference_norm), [x.float(), w.float()], dy.float())
    assert_no_less_accurate(f"rms_norm[{kernels},{width}]", fused, unfused, ref)


@pytest.mark.skipif(not importlib.util.find_spec("triton"), reason="no triton")
@pytest.mark.parametrize(
    ("shape", "take"),
    [
        ((8192, 2, 8, 3 * 128), lambda t: t[..., :128]),  # evenly spaced rows, read where they lie
        # the query heads of a KV group, [s, b, groups, 2, d]: evenly spaced groups, read where they lie
        ((4096, 2, 4, 4 * 128), lambda t: t[..., : 2 * 128].view(4096, 2, 4, 2, 128)),
        ((4096, 2, 4, 3 * 128), lambda t: t.transpose(0, 1)[:, :, :3, :128]),  # neither: copied
        ((2, 3, 2048), lambda t: t),  # fewer rows than a program's block
    ],
)
def test_triton_rms_norm_rows_in_place_and_many_per_program(device, shape, take):
    """rlx.models.triton_norm on q/k-like views of a fused projection (131,072 rows of 128: each
    backward program then walks many blocks of rows, summing the weight's gradient) and on a tiny
    input, against torch's norm and fp32 as above."""
    from rlx.models.triton_norm import TritonRMSNorm

    torch.manual_seed(0)
    x = take(torch.randn(shape, device=device, dtype=torch.bfloat16))
    width = x.shape[-1]
    w = (1 + 0.1 * torch.randn(width, device=device)).to(torch.bfloat16)
    dy = torch.randn(x.shape, device=device, dtype=torch.bfloat16)
    modules = [TritonRMSNorm(_Config(), width, eps=1e-6).to(device, torch.bfloat16),
               torch.nn.RMSNorm(width, eps=1e-6).to(device, torch.bfloat16),
               torch.nn.RMSNorm(width, eps=1e-6).to(device)]  # fmt: skip

    def call(module, x):
        return lambda w: torch.func.functional_call(module, {"weight": w}, (x,))

    # x itself (a view) goes into the fused norm: the gradient is checked through w and the output
    fused, unfused = (run(call(m, x), [w], dy) for m in modules[:2])
    ref = run(call(modules[2], x.float()), [w.float()], dy.float())
    assert_no_less_accurate(f"triton_rms_norm{tuple(x.shape)}", fused, unfused, ref)
    leaf = x.detach().clone().requires_grad_()  # and the input's gradient, from a contiguous copy
    out = modules[0](leaf)
    out.backward(dy)
    ref_leaf = x.detach().float().requires_grad_()
    modules[2](ref_leaf).backward(dy.float())
    unfused_leaf = x.detach().clone().requires_grad_()
    modules[1](unfused_leaf).backward(dy)
    assert_no_less_accurate("triton_rms_norm dx", [leaf.grad], [unfused_leaf.grad], [ref_leaf.grad])


@pytest.mark.parametrize("shape", [(2048, 2, 2048), (5, 3, 96)])  # a hidden state; a tiny one
def test_triton_add_rms_norm(device, shape):
    """rlx.models.triton_norm's residual add fused into the norm: the sum and the norm of it, and
    the gradients of both inputs and the weight when both outputs are used (the residual stream
    and the sublayer after the norm), against a separate bf16 add and torch's norm, and fp32."""
    from rlx.models.triton_norm import add_rms_norm

    torch.manual_seed(0)
    width = shape[-1]
    x, r = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(width, device=device)).to(torch.bfloat16)
    ds, dy = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(2))

    def both(add_norm, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (x, r, w)]
        s, y = add_norm(*leaves)
        torch.autograd.backward([s, y], [ds.to(dtype), dy.to(dtype)])
        return [s.detach(), y.detach(), *(t.grad for t in leaves)]

    def unfused(x, r, w):
        s = x + r
        return s, F.rms_norm(s, (width,), w, 1e-6)

    fused = both(lambda x, r, w: add_rms_norm(x, r, w, 1e-6), torch.bfloat16)
    assert_no_less_accurate(
        f"add_rms_norm{shape}", fused, both(unfused, torch.bfloat16), both(unfused, torch.float32)
    )
    assert torch.equal(fused[2], fused[3])  # both inputs of the add get the same gradient


def swiglu_reference(y: torch.Tensor) -> torch.Tensor:
    """The unfused SwiGLU both fused versions are held to: silu(gate) * up over fc1's [gate | up]."""
    gate, up = torch.chunk(y, 2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.skipif(not HAVE_LIGER, reason="no liger-kernel")
def test_swiglu(device):
    torch.manual_seed(0)
    y = torch.randn(1024, 4, 2 * 3072, device=device, dtype=torch.bfloat16)
    dc = torch.randn(1024, 4, 3072, device=device, dtype=torch.bfloat16)

    fused = run(KERNEL_SETS["liger"].swiglu()(), [y], dc)
    assert_no_less_accurate(
        "swiglu[liger]", fused, run(swiglu_reference, [y], dc), run(swiglu_reference, [y.float()], dc.float())
    )


def test_megatron_swiglu_fusion(device):
    """megatron's own fused SwiGLU (`bias_activation_fusion`, on with the fused sets)."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    torch.manual_seed(0)
    y = torch.randn(1024, 4, 2 * 3072, device=device, dtype=torch.bfloat16)
    dc = torch.randn(1024, 4, 3072, device=device, dtype=torch.bfloat16)

    fused = run(lambda y: bias_swiglu_impl(y, None), [y], dc)
    assert_no_less_accurate(
        "swiglu[megatron]",
        fused,
        run(swiglu_reference, [y], dc),
        run(swiglu_reference, [y.float()], dc.float()),
    )


def rope_angles(s: int, rot_dim: int, device) -> torch.Tensor:
    """megatron's [s, 1, 1, rot_dim] fp32 RoPE angles (non-interleaved halves), base 1e6."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, rot_dim, 2, device=device).float() / rot_dim))
    angles = torch.outer(torch.arange(s, device=device).float(), inv_freq)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def qkv_key(s: int, b: int, device) -> torch.Tensor:
    """The key heads [s, b, 8, 128] of a fused QKV projection's output [s, b, 8 groups, (2 + 2) x
    128] (megatron's layout): a strided view, as megatron hands RoPE the keys of a model without
    q/k norms (its queries it has copied by then: their reshape cannot be a view)."""
    qkv = torch.randn(s, b, 8, 4 * 128, device=device, dtype=torch.bfloat16)
    key = qkv[..., 2 * 128 : 3 * 128]
    assert key._base is qkv and not key.is_contiguous()
    return key


@pytest.mark.parametrize(
    "rope,rot_dim,interleaved,strided",
    [
        ("compiled", 128, False, False),
        ("compiled", 64, False, False),  # GLM-4's half
        ("compiled", 64, True, False),
        ("triton", 128, False, False),
        ("triton", 64, False, False),  # the unrotated half copied
        ("triton", 128, False, True),  # the keys of the fused QKV projection, read in place
        ("triton", 64, True, False),  # interleaved: handed to the compiled RoPE
    ],
)
def test_rope(device, rope, rot_dim, interleaved, strided):
    """The fused RoPEs (the compile set's and the liger set's) against megatron's unfused one."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from rlx.models.kernels import triton_rope

    torch.manual_seed(0)
    s, b, h, d = 1024, 4, 16, 128
    t = qkv_key(s, b, device) if strided else torch.randn(s, b, h, d, device=device, dtype=torch.bfloat16)
    freqs = rope_angles(s, rot_dim, device)
    dt = torch.randn(t.shape, device=device, dtype=torch.bfloat16)
    fused_rope = compiled_rope if rope == "compiled" else triton_rope

    def unfused(t):
        return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)

    # t itself (a view, when strided) goes into the fused RoPE
    out = fused_rope(t.requires_grad_(), freqs, interleaved=interleaved)
    out.backward(dt)
    fused = [out.detach(), t.grad]
    ref = run(unfused, [t.detach().float()], dt.float())
    name = f"rope[{rope},{rot_dim},{interleaved},{strided}]"
    assert_no_less_accurate(name, fused, run(unfused, [t.detach()], dt), ref)
    assert out.is_contiguous() and t.grad.shape == t.shape


@pytest.mark.parametrize("kernels", [pytest.param("liger", marks=FUSED_SETS[0].marks), "compile"])
def test_cross_entropy(device, kernels):
    """The fused cross entropy over bf16 logits (`cross_entropy_loss_fusion`, on for bf16):
    liger's in the liger set, megatron's native one otherwise."""
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    make = KERNEL_SETS[kernels].cross_entropy
    fused_ce = (
        make() if make else lambda x, target, group: fused_vocab_parallel_cross_entropy(x, target, group)
    )

    torch.manual_seed(0)
    logits = (2 * torch.randn(512, 4, 32768, device=device)).to(torch.bfloat16)
    target = torch.randint(0, 32768, (512, 4), device=device)
    dl = torch.rand(512, 4, device=device)
    group = parallel_state.get_tensor_model_parallel_group()
    fused = run(lambda x: fused_ce(x.clone(), target, group), [logits], dl)  # liger's writes into x
    unfused = run(lambda x: vocab_parallel_cross_entropy(x, target), [logits], dl)
    ref = run(lambda x: vocab_parallel_cross_entropy(x, target), [logits.float()], dl)
    assert_no_less_accurate(f"cross_entropy[{kernels}]", fused, unfused, ref)


# ---- whole models ------------------------------------------------------------------------------

SHAPE = [
    "model=tiny_qwen3",
    "model.name=qwen3_kernels",
    "model.num_layers=4",
    "model.hidden_size=1024",
    "model.ffn_hidden_size=3072",
    "model.num_attention_heads=8",
    "model.num_query_groups=4",
    "model.kernels=torch",
    "model.kv_channels=128",
    "model.vocab_size=8192",
    "model.max_position_embeddings=1024",
    "model.rotary_base=1000000.0",
]
MODEL_RATIO = 1.25  # fused model's error / unfused model's error against fp32: losses and gradients


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLX_CACHE", str(tmp_path_factory.mktemp("rlx_cache")))
        return build(compose(SHAPE).model).checkpoint_dir()


def losses_and_grads(kernels: str, hf_dir, dtype: torch.dtype, ids_BL: torch.Tensor):
    """Per-token losses [b, s-1] and {name: fp32 gradient} of `model.kernels=kernels` in `dtype`."""
    family = build(compose([*SHAPE, f"model.kernels={kernels}"]).model)
    gpt = family.build_model(params_dtype=dtype).to(ids_BL.device)
    family.load_hf_weights(gpt, hf_dir)
    model = half_precision(gpt)
    loss_BL = model(input_ids=ids_BL[:, :-1], position_ids=None, attention_mask=None, labels=ids_BL[:, 1:])
    loss_BL.mean().backward()
    grads = {name: p.grad.float() for name, p in gpt.named_parameters()}
    return loss_BL.detach().float(), grads


@pytest.mark.parametrize("kernels", FUSED_SETS)
def test_model_losses_and_gradients(device, hf_dir, kernels):
    ids_BL = torch.randint(0, 8192, (4, 513), generator=torch.Generator().manual_seed(0)).to(device)
    ref_loss, ref_grads = losses_and_grads("torch", hf_dir, torch.float32, ids_BL)
    loss16, grads16 = losses_and_grads("torch", hf_dir, torch.bfloat16, ids_BL)
    fused_loss, fused_grads = losses_and_grads(kernels, hf_dir, torch.bfloat16, ids_BL)
    assert fused_grads.keys() == ref_grads.keys()  # same parameters, same names

    fe, ue = errors(fused_loss, ref_loss), errors(loss16, ref_loss)
    print(
        f"\n[{kernels}] per-token loss |fused-fp32| {fe[0]:.2e}/{fe[1]:.2e}  |unfused-fp32| {ue[0]:.2e}/{ue[1]:.2e}"
    )
    assert fe[0] <= MODEL_RATIO * ue[0] and fe[1] <= MODEL_RATIO * ue[1]

    def relative(grads, name):
        return ((grads[name] - ref_grads[name]).norm() / ref_grads[name].norm()).item()

    worst = []
    for name in ref_grads:
        fused_rel, unfused_rel = relative(fused_grads, name), relative(grads16, name)
        worst.append((fused_rel / max(unfused_rel, 1e-6), name, fused_rel, unfused_rel))
    worst.sort(reverse=True)
    for ratio, name, fused_rel, unfused_rel in worst[:3]:
        print(
            f"  grad {name}: relative error fused {fused_rel:.2e}, unfused {unfused_rel:.2e} (x{ratio:.2f})"
        )
    assert all(fused_rel <= MODEL_RATIO * unfused_rel + 1e-3 for _, _, fused_rel, unfused_rel in worst), (
        worst[:3]
    )


def main_grads_over_two_micro_batches(hf_dir, ids_BL: torch.Tensor, fuse: bool):
    """{name: fp32 main_grad} of the bf16 model (liger or compile kernels) in megatron DDP after two
    micro-batches' backward passes, and the number of layers whose weight gradient was fused."""
    from rlx.trainer.config import TrainConfig
    from rlx.trainer.trainable import wrap_for_training

    family = build(compose([*SHAPE, "model.kernels=auto"]).model)
    gpt = family.build_model(params_dtype=torch.bfloat16).to(ids_BL.device)
    family.load_hf_weights(gpt, hf_dir)
    (ddp,), _ = wrap_for_training([gpt], TrainConfig(precision="bf16"), 1e-5, torch.bfloat16, fuse_wgrad=fuse)
    ddp.zero_grad_buffer()
    for part in ids_BL.chunk(2):
        ddp(
            input_ids=part[:, :-1], position_ids=None, attention_mask=None, labels=part[:, 1:]
        ).mean().backward()
    fused = sum(getattr(m, "gradient_accumulation_fusion", False) is True for m in gpt.modules())
    # the parameters whose gradient went straight into main_grad: the fused linear layers' and, with
    # the liger set, the Triton norms' (rlx.models.triton_norm._weight_grad)
    direct = {name for name, p in gpt.named_parameters() if p.grad_added_to_main_grad}
    if family.kernels().name == "liger":
        norms = {name for name in direct if "layernorm" in name}
        assert norms == {name for name, _ in gpt.named_parameters() if "layernorm" in name}, norms
        assert len(norms) == 4 * 4 + 1  # each layer's input, pre-MLP, q and k norms; the final norm
    return {name: p.main_grad.clone() for name, p in gpt.named_parameters()}, fused


def test_weight_gradients_accumulate_in_the_fp32_grad_buffer(device, hf_dir):
    """`fuse_weight_gradients`: each linear layer's GEMM adds its weight gradient to DDP's fp32
    main_grad (no bf16 gradient per micro-batch). Over two micro-batches every parameter's
    gradient, the tied embedding's included (output layer and lookup both), is at least as close
    to the fp32 model's as the unfused path's; the 4 linear layers of each of the 4 decoder
    layers are fused, the tied output layer is not. The Triton norms (liger set) add theirs into
    main_grad in both runs."""
    ids_BL = torch.randint(0, 8192, (4, 513), generator=torch.Generator().manual_seed(1)).to(device)
    family = build(compose(SHAPE).model)
    gpt = family.build_model(params_dtype=torch.float32).to(device)
    family.load_hf_weights(gpt, hf_dir)
    for part in ids_BL.chunk(2):
        gpt(
            input_ids=part[:, :-1], position_ids=None, attention_mask=None, labels=part[:, 1:]
        ).mean().backward()
    ref = {name: p.grad for name, p in gpt.named_parameters()}
    fused_grads, num_fused = main_grads_over_two_micro_batches(hf_dir, ids_BL, fuse=True)
    unfused_grads, num_unfused = main_grads_over_two_micro_batches(hf_dir, ids_BL, fuse=False)
    assert (num_fused, num_unfused) == (16, 0)
    assert fused_grads.keys() == ref.keys()
    for name, r in ref.items():
        fused_rel = ((fused_grads[name] - r).norm() / r.norm()).item()
        unfused_rel = ((unfused_grads[name] - r).norm() / r.norm()).item()
        print(f"\n  {name}: relative error fused {fused_rel:.2e}, unfused {unfused_rel:.2e}", end="")
        assert fused_rel <= 1.05 * unfused_rel + 1e-4, (name, fused_rel, unfused_rel)
        assert fused_rel < 0.05, name  # nothing dropped (a lost embedding gradient would be ~1)


def test_weight_gradient_gemm_adds_in_fp32(device):
    """`WeightGradientGemm.wgrad_gemm_accum_fp32`: main_grad += grad_output^T @ input, in place,
    with the product kept in fp32 (against fp64: within fp32 rounding of the sum), where a bf16
    weight gradient added afterwards carries a bf16 rounding."""
    from rlx.models.kernels import WeightGradientGemm, fp32_accumulating_gemm_works

    assert fp32_accumulating_gemm_works(device)  # else fuse_weight_gradients leaves the layers unfused
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2048, 256, device=device, generator=gen).bfloat16()
    g = torch.randn(2048, 384, device=device, generator=gen).bfloat16()
    main_grad = torch.randn(384, 256, device=device, generator=gen)
    expected = main_grad.double() + g.double().t() @ x.double()
    fused = main_grad.clone()
    storage = fused.data_ptr()
    WeightGradientGemm.wgrad_gemm_accum_fp32(x, g, fused)
    unfused = main_grad + g.t() @ x  # megatron without apex: a bf16 gradient, then DDP's add
    fused_err, unfused_err = (fused - expected).abs().max().item(), (unfused - expected).abs().max().item()
    print(f"\n  |fused - fp64| {fused_err:.2e}, |bf16 gradient added - fp64| {unfused_err:.2e}")
    assert fused.data_ptr() == storage and fused.dtype == torch.float32
    assert fused_err <= 1e-5 * expected.abs().max().item()
    assert unfused_err > 10 * fused_err
