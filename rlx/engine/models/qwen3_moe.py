"""Qwen3-MoE: Qwen3 attention with a top-k routed MoE MLP (softmax router, optional top-k
renormalisation), dense MLPs on `mlp_only_layers` and between `decoder_sparse_step` layers.

Experts are stored stacked, [E, 2I, H] and [E, H, I] (transformers 5's fused names), and the
per-expert checkpoint names (`experts.3.gate_proj.weight`) load into views of those stacks.

Three ways to run the experts, chosen per step by `Qwen3MoeLM.forward` (`step_path`):
- `loop` (everything on CPU; prefill and mixed steps where `dense` decodes): one GEMM pair per
  expert that has tokens; selecting them reads the routing on the host, so it cannot be captured
  in a graph;
- `grouped` (every step on CUDA, bf16 on Hopper/Blackwell): the T*K (token, expert) pairs
  sorted by expert, offsets from a search over the sorted ids, torch's grouped GEMM
  (`torch._grouped_mm`, CUTLASS) over all experts with those device-side offsets, then each
  pair's output put back in token order and summed over its K experts. Every shape is fixed by
  T and K, nothing is read on the host: decode steps run in the CUDA graphs, and a prefill
  chunk's 128 experts are two kernels instead of 128 GEMM pairs and a host sync. This is what
  transformers' `grouped_mm` experts and SGLang's fused MoE (`moe_align_block_size` + one
  grouped kernel reading per-block expert ids) do;
- `dense` (decode steps on CUDA in other dtypes or GPUs, where torch's grouped GEMM falls back
  to a host loop): every expert over every token as two batched GEMMs, outputs weighted by a
  [T, E] routing matrix that is zero off the top-k. E/K times the FLOPs of `grouped`, also
  static; meant for fp32 test models, not for serving large ones.

Legend: T tokens, K experts per token, S = T*K routed pairs, E experts, H hidden, I expert FFN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlx.engine.models.dense import CausalLM


def sort_by_expert(index_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed pairs ordered by expert: `order_S[s]` is the flat pair index (token
    `order_S[s] // K`, slot `% K`) of sorted row s, and `offsets_E[e]` (int32) is the end of
    expert e's rows (grouped GEMM's `offs`). Fixed shapes, no host sync."""
    expert_S, order_S = torch.sort(index_TK.flatten(), stable=True)
    experts_E = torch.arange(num_experts, device=index_TK.device, dtype=expert_S.dtype)
    offsets_E = torch.searchsorted(expert_S, experts_E, right=True).to(torch.int32)
    return order_S, offsets_E


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.is_cuda and gate.dim() == 2:
        from rlx.engine.triton_layers import silu_mul

        return silu_mul(gate, up)
    return F.silu(gate) * up


def grouped_experts(x_TH, index_TK, weight_TK, gate_up_E2IH, down_EHI) -> torch.Tensor:
    """Every token's weighted sum over its K experts, through two grouped GEMMs (see module)."""
    num_tokens, k = index_TK.shape
    inter = down_EHI.shape[2]
    order_S, offsets_E = sort_by_expert(index_TK, gate_up_E2IH.shape[0])
    x_SH = x_TH[order_S // k]
    gate_up_S2I = torch._grouped_mm(x_SH, gate_up_E2IH.transpose(1, 2), offs=offsets_E)
    h_SI = _silu_mul(gate_up_S2I[:, :inter], gate_up_S2I[:, inter:])
    y_SH = torch._grouped_mm(h_SI, down_EHI.transpose(1, 2), offs=offsets_E)
    y_SH = y_SH * weight_TK.flatten()[order_S, None]
    # back to (token, slot) order; a permutation, so no two rows collide (deterministic)
    pairs_SH = torch.empty_like(y_SH).index_copy_(0, order_S, y_SH)
    return pairs_SH.view(num_tokens, k, -1).sum(dim=1)


def dense_experts(x_TH, index_TK, weight_TK, gate_up_E2IH, down_EHI) -> torch.Tensor:
    """The same sum with every expert applied to every token (see module)."""
    inter = down_EHI.shape[2]
    gate_up_ET2I = torch.matmul(x_TH, gate_up_E2IH.transpose(1, 2))
    h_ETI = F.silu(gate_up_ET2I[..., :inter]) * gate_up_ET2I[..., inter:]
    y_ETH = torch.bmm(h_ETI, down_EHI.transpose(1, 2))
    routing_TE = torch.zeros(index_TK.shape[0], gate_up_E2IH.shape[0], dtype=y_ETH.dtype, device=y_ETH.device)
    routing_TE.scatter_(1, index_TK, weight_TK.to(y_ETH.dtype))
    return torch.einsum("te,eth->th", routing_TE, y_ETH)


def loop_experts(x_TH, index_TK, weight_TK, gate_up_E2IH, down_EHI) -> torch.Tensor:
    """The same sum, one GEMM pair per expert that has tokens (reads the routing on the host)."""
    out = torch.zeros_like(x_TH)
    for expert in index_TK.unique().tolist():
        token, slot = torch.where(index_TK == expert)
        gate, up = F.linear(x_TH[token], gate_up_E2IH[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_EHI[expert]) * weight_TK[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


EXPERT_PATHS = {"loop": loop_experts, "grouped": grouped_experts, "dense": dense_experts}


def grouped_gemm_on_device(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs its device kernel here (bf16 on sm90/sm100; elsewhere
    it copies the offsets to the host and loops, which a CUDA graph cannot capture)."""
    return (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(device)[0] in (9, 10)
    )


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.path = "loop"  # one of EXPERT_PATHS, set for each step by Qwen3MoeLM.forward

    def forward(self, x: torch.Tensor, index_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        return EXPERT_PATHS[self.path](x, index_TK, weight_TK, self.gate_up_proj, self.down_proj)


class Gate(nn.Module):
    def __init__(self, num_experts: int, hidden: int, top_k: int, renormalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float)
        weight, index = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return index, weight.to(x.dtype)


class SparseMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate = Gate(cfg.num_experts, cfg.hidden_size, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index, weight = self.gate(x)
        return self.experts(x, index, weight)


class Qwen3MoeLM(CausalLM):
    _experts: list[Experts] | None = None
    _decode_path = "loop"

    def make_mlp(self, cfg, layer: int) -> nn.Module:
        sparse = layer not in (cfg.mlp_only_layers or []) and (layer + 1) % cfg.decoder_sparse_step == 0
        if cfg.num_experts > 0 and sparse:
            return SparseMoE(cfg)
        return super().make_mlp(cfg, layer)

    def decode_path(self, device: torch.device, dtype: torch.dtype) -> str:
        """The expert path of decode steps on `device` (prefill: `step_path`)."""
        if device.type != "cuda":
            return "loop"  # CPU keeps the numerics its tests and golden runs recorded
        return "grouped" if grouped_gemm_on_device(device, dtype) else "dense"

    @staticmethod
    def step_path(decode_path: str, decode_only: bool) -> str:
        """The expert path of one step: decode steps take `decode_path`; prefill and mixed steps
        the grouped GEMM where decode does (no host sync), else the loop (`dense` would multiply a
        prefill's FLOPs by E/K)."""
        return decode_path if decode_only or decode_path == "grouped" else "loop"

    def forward(self, input_ids, positions, kv_cache, meta) -> torch.Tensor:
        if self._experts is None:  # built lazily: the modules exist only after __init__
            weight = self.model.embed_tokens.weight
            self._experts = [m for m in self.modules() if isinstance(m, Experts)]
            self._decode_path = self.decode_path(weight.device, weight.dtype)
        path = self.step_path(self._decode_path, meta.num_decode == input_ids.shape[0])
        for experts in self._experts:
            experts.path = path
        return super().forward(input_ids, positions, kv_cache, meta)

    def weight_views(self) -> dict[str, torch.Tensor]:
        views = super().weight_views()
        for name, module in self.named_modules():
            if not isinstance(module, Experts):
                continue
            inter = module.intermediate
            for e in range(module.gate_up_proj.shape[0]):
                views[f"{name}.{e}.gate_proj.weight"] = module.gate_up_proj.data[e, :inter]
                views[f"{name}.{e}.up_proj.weight"] = module.gate_up_proj.data[e, inter:]
                views[f"{name}.{e}.down_proj.weight"] = module.down_proj.data[e]
        return views
