"""Fused GPU kernels for the dense families' layers, chosen by `model.kernels` (CUDA only).

Without Transformer Engine, megatron's local spec runs RMSNorm, SwiGLU and RoPE as chains of
unfused torch ops; on 1xH200 (Qwen3-1.7B shape, seq 4096) that elementwise work was 41% of the
GPU time of a bf16 training step (docs/benchmarks.md). A `KernelSet` replaces those pieces
through the hooks megatron has for them, so the layer's forward is megatron's own:

- norms: the module in the hidden-size RMSNorm slots of the layer spec (input, pre-MLP) and the
  block's final norm, and in the q/k norm slots;
- SwiGLU: a module in `MLPSubmodules.activation_func`, which megatron calls on fc1's
  [gate | up] output when `use_te_activation_func` is set (the flag only selects the
  spec-provided activation module; nothing of Transformer Engine is used);
- RoPE: megatron's `fused_apply_rotary_pos_emb` slot (`apply_rope_fusion`), empty without TE.

Kernel sets (`KERNEL_SETS`): "liger" (liger-kernel's gate-up SwiGLU and vocab-parallel cross
entropy, the `gpu` extra, and rlx's own Triton RMSNorm and RoPE), "compile" (torch.compile of the
same torch math, no extra dependency), "torch" (megatron's unfused layers). liger's RoPE kernel
wants [b, s, h, d] memory and megatron's is [s, b, h, d]: the compile set's RoPE is torch.compile
of megatron's own `_apply_rotary_pos_emb_bshd`, the liger set's `rlx.models.triton_rope` (the
compiled one evaluates cos and sin for every element: three times RoPE's memory time at the 1.7B
shape). The liger set's norms are
`rlx.models.triton_norm`'s: torch's `rms_norm` reduces the weight's gradient at a quarter of the
memory bandwidth on the per-head q/k norms and copies their strided input, and liger's RMSNorm
was no faster than torch's while its per-call Python made the step at RL's short micro-batches
16% slower (docs/benchmarks.md); rlx's kernel reads the rows where they lie and sums the weight's
gradient per program (the 1.7B step at seq 4096 3.32 -> 3.15 s on 1×H100).

On a machine without CUDA every set resolves to "torch": the CPU path (and CI, which has no
triton) builds exactly the layers it always did. Nothing here imports triton or liger until a
fused set is resolved on CUDA.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from rlx.compat import liger
from rlx.errors import ConfigError
from rlx.models.config import KERNEL_CHOICES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelSet:
    """What replaces megatron's unfused layers; None leaves megatron's own in place."""

    name: str
    # -> RMSNorm module class (megatron norm constructor): the hidden-size norms (each layer's two,
    # the block's final one), and the per-head q/k norms (Qwen3's [s, b, heads, 128] rows)
    norm: Callable[[], type] | None = None
    qk_norm: Callable[[], type] | None = None
    swiglu: Callable[[], type] | None = None  # -> activation module class: [.., 2f] -> [.., f]
    rope: Callable[[], Callable] | None = None  # -> fused_apply_rotary_pos_emb(t, freqs, interleaved)
    cross_entropy: Callable[[], Callable] | None = (
        None  # -> (logits [s,b,V/tp], labels, tp_group, _) -> loss [s,b]
    )
    requires: str | None = None  # the package (pip name) the set imports, checked when resolved
    modules: tuple[str, ...] = ()  # that package's modules the set's pieces import (`load_ahead`)
    # each linear layer's weight gradient accumulated into DDP's fp32 main_grad by its GEMM
    # (`fuse_weight_gradients`, after the model is wrapped in DDP)
    wgrad_accumulation: bool = False


def _liger_swiglu() -> type:
    return LigerSwiGLU


def _liger_cross_entropy() -> Callable:
    ce = liger.module("liger_kernel.megatron").LigerMegatronCrossEntropy()
    return lambda logits, labels, tp_group, is_cg_capturable=False: ce(logits, labels, tp_group=tp_group)


def _compiled_norm() -> type:
    return CompiledRMSNorm


def _compiled_rope() -> Callable:
    return compiled_rope


def _triton_norm() -> type:
    return importlib.import_module("rlx.models.triton_norm").TritonRMSNorm


def _triton_rope() -> Callable:
    return triton_rope


KERNEL_SETS: dict[str, KernelSet] = {
    "torch": KernelSet("torch"),
    "liger": KernelSet(
        "liger",
        norm=_triton_norm,
        qk_norm=_triton_norm,
        swiglu=_liger_swiglu,
        rope=_triton_rope,
        cross_entropy=_liger_cross_entropy,
        requires="liger-kernel",
        modules=("liger_kernel.ops", "liger_kernel.megatron"),
        wgrad_accumulation=True,
    ),
    "compile": KernelSet(
        "compile", norm=_compiled_norm, qk_norm=_compiled_norm, rope=_compiled_rope, wgrad_accumulation=True
    ),
}


def resolve(name: str) -> KernelSet:
    """The kernel set `model.kernels=name` selects on this machine: "torch" without CUDA;
    "auto" is "liger" where liger-kernel is installed, else "compile"."""
    if name not in KERNEL_CHOICES:
        raise ConfigError(f"model.kernels={name}: choose one of {', '.join(KERNEL_CHOICES)}")
    if not torch.cuda.is_available():
        return KERNEL_SETS["torch"]
    if name == "auto":
        name = "liger" if importlib.util.find_spec("liger_kernel") else "compile"
    kernels = KERNEL_SETS[name]
    if kernels.requires and importlib.util.find_spec(kernels.requires.replace("-", "_")) is None:
        raise ConfigError(
            f"model.kernels={name} needs {kernels.requires} on the GPU machine: pip install 'rlx[gpu]' "
            "(or model.kernels=compile, which needs nothing extra)"
        )
    return kernels


def load_ahead(name: str) -> None:
    """Import the modules of the kernel set `model.kernels=name` resolves to on this machine
    (liger's, without the 3.6 s of peft's: `rlx.compat.liger`) ahead of the model's build: a
    trainer rank's warm-up. Raises `resolve`'s ConfigError."""
    for module in resolve(name).modules:
        liger.module(module)


def fusion_kwargs(kernels: KernelSet, *, params_dtype: torch.dtype, rotary_interleaved: bool) -> dict:
    """TransformerConfig flags for `kernels` (resolved for this machine) and the model's dtype.

    Megatron's two fusions that need neither TE nor apex are on with any fused set: SwiGLU
    through torch.compile (`bias_activation_fusion`, unless the set brings its own SwiGLU
    module) and the native fused cross entropy (unless the set brings its own, which goes in
    megatron's TE cross-entropy slot), which returns bf16 logit gradients whatever the logits'
    dtype, so it is on for bf16 models only. RoPE fusion is left off for interleaved RoPE
    (GLM-4), which megatron routes to TE >= 2.3 only.
    """
    if kernels.name == "torch":
        return {}
    kwargs: dict = dict(
        bias_activation_fusion=kernels.swiglu is None,
        use_te_activation_func=kernels.swiglu is not None,
        cross_entropy_loss_fusion=params_dtype == torch.bfloat16,
        cross_entropy_fusion_impl="native",
    )
    if kernels.cross_entropy is not None and kwargs["cross_entropy_loss_fusion"]:
        _fill_slot(
            "megatron.core.models.common.language_module.language_module",
            "te_parallel_cross_entropy",
            kernels.cross_entropy,
        )
        kwargs["cross_entropy_fusion_impl"] = "te"
    if kernels.rope is not None and not rotary_interleaved:
        _fill_slot(
            "megatron.core.models.common.embeddings.rope_utils", "fused_apply_rotary_pos_emb", kernels.rope
        )
        kwargs["apply_rope_fusion"] = True
    return kwargs


def _fill_slot(module: str, name: str, make: Callable[[], Callable]) -> None:
    """Put `make()` in the megatron module global `name`, a Transformer Engine kernel that is None
    without TE (RoPE: `rope_utils.fused_apply_rotary_pos_emb`, read when a config with
    `apply_rope_fusion` is built and at every call; cross entropy: `language_module.
    te_parallel_cross_entropy`, read under `cross_entropy_fusion_impl="te"`). A slot TE already
    filled is left alone; megatron reads these flags only where this module set them."""
    target = importlib.import_module(module)
    if getattr(target, name) is None:
        setattr(target, name, make())


@cache
def _compiled_rope_bshd() -> Callable:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return torch.compile(_apply_rotary_pos_emb_bshd)


def compiled_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, **_) -> torch.Tensor:
    """Megatron's unfused RoPE over [s, b, h, d] (`freqs` [s, 1, 1, rot_dim] angles), compiled:
    the same arithmetic as `apply_rope_fusion=False`, in one kernel each way."""
    return _compiled_rope_bshd()(t, freqs, rotary_interleaved=interleaved)


@cache
def _triton_rope_module():
    return importlib.import_module("rlx.models.triton_rope")


def triton_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, **_) -> torch.Tensor:
    """RoPE through `rlx.models.triton_rope`'s kernels where they take (t, freqs) (non-interleaved,
    one angle a position), else `compiled_rope`."""
    kernel = _triton_rope_module()
    if not interleaved and kernel.supported(t, freqs):
        return kernel.apply_rope(t, freqs)
    return compiled_rope(t, freqs, interleaved=interleaved)


@cache
def _compiled_rms_norm() -> Callable:
    return torch.compile(torch.nn.functional.rms_norm)


class CompiledRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` (what megatron's local spec builds) with a torch.compile'd forward.

    Takes megatron's norm constructor arguments; parameters and state-dict keys are the same
    as the torch norm's (`weight`)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _compiled_rms_norm()(x, self.normalized_shape, self.weight, self.eps)


class LigerSwiGLU(torch.nn.Module):
    """SwiGLU on fc1's [gate | up] output with liger's one-kernel gate-up SiLU-multiply.

    Built by megatron's MLP from `MLPSubmodules.activation_func` (as `cls(config=...)`) and
    called on [s, b, 2 * ffn] (or [tokens, 2 * ffn]); returns [..., ffn]."""

    def __init__(self, config=None):
        super().__init__()
        self._function = liger.module("liger_kernel.ops").LigerFusedGateUpSiLUMulFunction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._function.apply(x.reshape(-1, x.shape[-1]), False)
        return out.view(*x.shape[:-1], out.shape[-1])

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Nothing to checkpoint: megatron's MLP asks each child module for its sharded state
        (distributed checkpoints of a model built with these kernels failed without this)."""
        return {}


class WeightGradientGemm:
    """Stands in for apex's `fused_weight_gradient_mlp_cuda`, which megatron's linear layers call
    under `gradient_accumulation_fusion`: `main_grad += grad_output^T @ input` in one GEMM that
    reads half-precision operands and accumulates into, and writes, the fp32 main_grad (torch's
    `addmm` with `out_dtype=float32`, cuBLAS underneath; CUDA only). Without it each micro-batch
    writes a half-precision weight gradient, which DDP's hook then adds to main_grad in a
    separate pass over both, and the gradient is rounded to bf16 once per micro-batch."""

    @staticmethod
    def wgrad_gemm_accum_fp32(
        total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
    ) -> None:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(
        total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
    ) -> None:
        main_grad.addmm_(grad_output.t(), total_input)


def wgrad_fusable_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The column- and row-parallel linear layers of `model` (a DDP-wrapped chunk) whose own
    half-precision CUDA weight has an fp32 `main_grad`. Left out: a layer that borrows its weight
    at call time (the output layer tied to the embedding, whose gradient megatron must still sum
    with the embedding's in DDP's hook) and every weight without a main_grad (a model outside
    DDP: its backward would have nowhere to accumulate)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    def fusable(weight) -> bool:
        main_grad = getattr(weight, "main_grad", None)
        return (
            isinstance(weight, torch.nn.Parameter)
            and weight.requires_grad
            and weight.is_cuda
            and weight.dtype in (torch.bfloat16, torch.float16)
            and main_grad is not None
            and main_grad.dtype == torch.float32
        )

    return [
        m
        for m in model.modules()
        if isinstance(m, ColumnParallelLinear | RowParallelLinear) and fusable(getattr(m, "weight", None))
    ]


@cache
def fp32_accumulating_gemm_works(device: torch.device) -> bool:
    """Whether this torch has `WeightGradientGemm`'s kernel on `device`: bf16 operands added into
    an fp32 matrix in place by `addmm(..., out_dtype=float32)` (CUDA in recent torch; no CPU
    kernel, and older versions lack the argument), checked on a 2 x 2 product."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        out = torch.ones(2, 2, dtype=torch.float32, device=device)
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
    except (TypeError, RuntimeError):
        return False
    return bool((out == 3.0).all())


def fuse_weight_gradients(ddp_chunks: list[torch.nn.Module]) -> int:
    """Turn on megatron's `gradient_accumulation_fusion` in each layer of `wgrad_fusable_layers`,
    with `WeightGradientGemm` as its kernel where apex's is not installed; the layers turned on.

    Per layer, after DDP has made the main_grad buffers, rather than in the TransformerConfig:
    megatron would otherwise fuse every layer of every model built from the config, the frozen
    reference and models outside DDP included, and fail in their backward."""
    from megatron.core.tensor_parallel import layers

    fusable = [m for chunk in ddp_chunks for m in wgrad_fusable_layers(chunk)]
    if not fusable:
        return 0
    if not layers._grad_accum_fusion_available:
        if not fp32_accumulating_gemm_works(fusable[0].weight.device):
            log.warning(
                "torch %s has no half-precision GEMM with an fp32 output (addmm's out_dtype) on %s: "
                "weight gradients are added to the fp32 buffer after each micro-batch instead",
                torch.__version__,
                fusable[0].weight.device,
            )
            return 0
        layers.fused_weight_gradient_mlp_cuda = WeightGradientGemm
        layers._grad_accum_fusion_available = True
    for module in fusable:
        module.gradient_accumulation_fusion = True
    return len(fusable)


__all__ = ["KERNEL_SETS", "KernelSet", "fuse_weight_gradients", "fusion_kwargs", "resolve"]
