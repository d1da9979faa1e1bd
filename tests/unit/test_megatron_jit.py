"""Without CUDA, megatron's torch.compile'd helpers load as plain functions once rlx is imported
(rlx.compat.megatron_jit), which asks no CUDA to tell; with CUDA each is compiled when first
called; each case imports in a fresh interpreter, as a new process would."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys, torch
{before}
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.transformer.moe import router
print(jit.jit_fuser is jit.noop_decorator, jit.jit_fuser is torch.compile,
      hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable"),
      hasattr(router.TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable"),
      "torch._inductor.compile_fx" in sys.modules)
"""

GPU_MACHINE = (
    "torch.version.cuda = '12.8'; torch.cuda.is_available = lambda: 1 / 0; "
    "import rlx.compat.megatron_jit as j; j.NVIDIA_DEVICE = '/'"
)


def _imports(before: str) -> list[str]:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", CHECK.format(before=before)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@pytest.mark.parametrize(
    "before, expected",
    [
        # rlx first, no CUDA: megatron's own no-op decorator, and inductor is never loaded
        ("import rlx", ["True", "False", "False", "False", "False"]),
        # megatron first: too late to change it, megatron compiles as it always did
        ("import megatron.core; import rlx", ["False", "True", "True", "True", "True"]),
        # a GPU machine (a CUDA build, the driver's device node): compiled on the first call (below),
        # so inductor is not loaded with megatron; CUDA is not asked (a Ray worker preloading
        # megatron is told its GPU later: rlx.trainer.preload)
        (GPU_MACHINE + "; import rlx", ["False", "False", "False", "False", "False"]),
    ],
    ids=["rlx first", "megatron first", "with CUDA"],
)
def test_megatron_helpers_are_compiled_only_with_cuda(before, expected):
    assert _imports(before) == expected


def test_with_cuda_a_helper_compiles_at_its_first_call_once():
    """torch.compile recorded instead of run: nothing compiled as megatron loads, swiglu at its
    first call, and not again at its second; its result is the function's own."""
    script = (
        "import torch; " + GPU_MACHINE + "; import rlx\n"
        "compiled = []\n"
        "torch.compile = lambda fn: compiled.append(fn.__name__) or fn\n"
        "from megatron.core.fusions import fused_bias_swiglu as f\n"
        "print(len(compiled))\n"
        "x = torch.randn(3, 8)\n"
        "y = f.swiglu(x)\n"
        "f.swiglu(x)\n"
        "a, b = x.chunk(2, -1)\n"
        "print(compiled, torch.equal(y, torch.nn.functional.silu(a) * b))\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["0", "['swiglu'] True"]


def test_the_trainer_loads_neither_dynamo_nor_inductor():
    """A trainer rank's modules (`rlx.trainer.megatron`, megatron with them) import no torch._dynamo
    or inductor on a machine without CUDA: both only where something compiles."""
    script = (
        "import sys, torch, rlx.trainer.megatron\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
