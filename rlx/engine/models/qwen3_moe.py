"""Qwen3-MoE: Qwen3 attention with a top-k routed MoE MLP (softmax router, optional top-k
renormalisation), dense MLPs on `mlp_only_layers` and between `decoder_sparse_step` layers.

Experts are stored stacked, [E, 2I, H] and [E, H, I] (transformers 5's fused names), and the
per-expert checkpoint names (`experts.3.gate_proj.weight`) load into views of those stacks.
The expert loop selects tokens per expert, which needs the routing on the host: MoE models
run their decode eagerly (no CUDA graph), see `ModelRunner`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rlx.engine.models.dense import CausalLM


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, index_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in index_TK.unique().tolist():
            token, slot = torch.where(index_TK == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * weight_TK[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


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
    supports_cuda_graph = False  # the expert loop reads the routing on the host

    def make_mlp(self, cfg, layer: int) -> nn.Module:
        sparse = layer not in (cfg.mlp_only_layers or []) and (layer + 1) % cfg.decoder_sparse_step == 0
        if cfg.num_experts > 0 and sparse:
            return SparseMoE(cfg)
        return super().make_mlp(cfg, layer)

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
