"""Building blocks shared by the model families: RMSNorm, rotary tables, gated MLP.

Numerics follow transformers' modules (norm in fp32, cast back before the weight; rotary
angles in fp32 then cast to the activation dtype), so fp32 outputs match transformers'.
"""

from __future__ import annotations

import contextlib
import importlib

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _SmallGemms:
    in_graphs = False  # inside `small_gemms_in_graphs`


@contextlib.contextmanager
def small_gemms_in_graphs():
    """The layers' small GEMMs (`Linear.small_settings`, `GatedMLP.small_swiglu`) run only inside
    this: the decode graphs' warm-up and capture (rlx/engine/cuda_graph.py). An engine's eager
    steps (a prefill chunk of at most `small_rows` tokens, as a multi-turn rollout's short
    continuations make) keep cuBLAS's: eager, the host's launch of Triton's kernel with its TMA
    descriptors costs more than it saves (rlx/engine/model_runner.py)."""
    before, _SmallGemms.in_graphs = _SmallGemms.in_graphs, True
    try:
        yield
    finally:
        _SmallGemms.in_graphs = before


def takes_small_gemm(settings: dict | None, x: torch.Tensor, rows: int) -> bool:
    return settings is not None and _SmallGemms.in_graphs and x.dim() == 2 and x.shape[0] <= rows


class Linear(nn.Linear):
    """nn.Linear whose GEMM at few rows may be `rlx.engine.triton_gemm.small_gemm` (CUDA), in the
    decode graphs (`small_gemms_in_graphs`): `small_settings` its launch settings, set by
    `CausalLM.enable_small_gemms`; None: F.linear. Settings with a `split` (a layer's o and
    down, whose output only `add_rms_norm` reads) make it return the product's fp32 partials
    [split, rows, out] there, which that norm sums."""

    small_settings: dict | None = None
    small_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes_small_gemm(self.small_settings, x, self.small_rows):
            from rlx.engine.triton_gemm import small_gemm

            return small_gemm(x, self.weight, self.bias, self.small_settings)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several HF linears stacked along the output dim, so a small-batch decode runs one GEMM
    instead of two or three launch-bound ones. `parts` are the HF module names and their output
    sizes: their checkpoint tensors load into row views of this one weight (`part_views`)."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]], bias: bool):
        super().__init__(in_features, sum(size for _, size in parts), bias=bias)
        self.parts = parts
        self.sizes = [size for _, size in parts]

    def part_views(self, prefix: str) -> dict[str, torch.Tensor]:
        views, start = {}, 0
        for name, size in self.parts:
            views[f"{prefix}.{name}.weight"] = self.weight.data[start : start + size]
            if self.bias is not None:
                views[f"{prefix}.{name}.bias"] = self.bias.data[start : start + size]
            start += size
        return views


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), HF names gate_proj / up_proj / down_proj. `small_swiglu`:
    gate_up's launch settings with SwiGLU (`triton_gemm.small_swiglu_settings`, set by
    `CausalLM.enable_small_gemms`), the GEMM, silu and the product in one kernel up to
    `small_rows` rows, in the decode graphs (`small_gemms_in_graphs`)."""

    small_swiglu: dict | None = None
    small_rows = 0

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.gate_up: MergedLinear | None = None

    def merge_projections(self) -> None:
        """gate_proj and up_proj become one `gate_up` (CUDA builds; before weights load)."""
        size = self.gate_proj.out_features
        bias = self.gate_proj.bias is not None
        self.gate_up = MergedLinear(
            self.gate_proj.in_features, [("gate_proj", size), ("up_proj", size)], bias
        )
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if takes_small_gemm(self.small_swiglu, x, self.small_rows):
            from rlx.engine.triton_gemm import small_gemm

            gated = small_gemm(x, self.gate_up.weight, self.gate_up.bias, self.small_swiglu, swiglu=True)
            return self.down_proj(gated)
        if self.gate_up is not None:
            gate, up = self.gate_up(x).split(self.gate_up.sizes, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if x.is_cuda and x.dim() == 2:  # one kernel for silu and the product
            from rlx.engine.triton_layers import silu_mul

            return self.down_proj(silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)


class FusedGatedMLP(nn.Module):
    """GLM-4's MLP: one gate_up_proj whose halves are gate and up."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


# Families whose transformers rotary module computes "default" RoPE as below (transformers 5.x
# `compute_default_rope_parameters`); True: it applies rope_parameters' partial_rotary_factor.
# Computing it here spares the engine importing the family's modeling module (1.5 s, and
# torch._dynamo with it: 4 s of the engine's start on CPU). Other families import it.
DEFAULT_ROPE_PARTIAL = {"llama": False, "qwen3": False, "qwen3_moe": False, "deepseek_v3": False,
                        "glm4": True, "glm4_moe": True}  # fmt: skip


def family_rotary(hf_config) -> nn.Module:
    """The family's own transformers rotary module (imports its modeling module: seconds)."""
    model_type = hf_config.model_type
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))
    return cls(config=hf_config)


def rotary_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling as the family's transformers rotary module computes them,
    so every rope type (llama3, yarn, partial rotary) matches transformers."""
    partial = DEFAULT_ROPE_PARTIAL.get(hf_config.model_type)
    if partial is None:  # a family not checked against the formula: its own module computes it
        rotary = family_rotary(hf_config)
        return rotary.inv_freq.float().cpu(), float(rotary.attention_scaling)
    rope = hf_config.rope_parameters
    if rope["rope_type"] != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config)
        return inv_freq.float().cpu(), float(scaling)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0)) if partial else head_dim
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0


class RotaryTable(nn.Module):
    """cos/sin for every position up to the context length, looked up by position."""

    def __init__(self, hf_config, max_positions: int, interleaved: bool):
        super().__init__()
        inv_freq, scaling = rotary_inv_freq(hf_config)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        if interleaved:  # GLM: each frequency covers an adjacent pair of dims
            emb = freqs.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self.rotary_dim = emb.shape[-1]
        self.interleaved = interleaved

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """Rotate q [T, H, D] and k [T, Hkv, D] (the first rotary_dim dims) in their dtype."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.interleaved:
            half = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
        else:
            first, second = rot.chunk(2, dim=-1)
            half = torch.cat((-second, first), dim=-1)
        out = rot * cos + half * sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
