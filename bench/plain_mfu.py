"""Train a plain-PyTorch Qwen3-shaped decoder under torch.compile on one GPU; print tokens/s and MFU.

    python bench/plain_mfu.py                          # Qwen3-1.7B shape, seq 4096, 4 x 8, amp, layers compiled
    python bench/plain_mfu.py --precision bf16         # bf16 weights, gradients and Adam state
    python bench/plain_mfu.py --compile model          # the whole model as one graph
    # on the GPU machine:
    source .whl/install.sh && PYTHONUNBUFFERED=1 python3 bench/plain_mfu.py

The yardstick for `bench/train_mfu.py`: the same shape (bench/train_mfu.py's QWEN3_1P7B), the same
tokens per step, the same FLOP count and peak, but no megatron: a decoder written in plain torch
(RMSNorm, q/k norms, RoPE, SDPA with grouped KV heads, SwiGLU, tied output, fp32 cross entropy)
that torch.compile (inductor) fuses as it likes. What is left between this figure and
train_mfu.py's is what megatron's layer structure costs without Transformer Engine; what is left
between this one and 100% is the GPU's matmul and attention rates and what cannot be fused.

--precision amp (default): fp32 weights under autocast to bf16, fp32 gradients, fused AdamW on the
fp32 weights: megatron's mixed precision (fp32 master weights and grad buffer). --precision bf16:
bf16 weights, gradients and Adam state (no master copy): less memory traffic, less accurate.

--compile layer (default): one compiled function for every decoder layer plus one for the loss
head; model: the whole forward as one graph; none: eager.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from train_mfu import H200_BF16_DENSE_PEAK_TFLOPS, H200_BF16_MEASURED_TFLOPS, QWEN3_1P7B  # noqa: E402


class Layer(nn.Module):
    def __init__(self, hidden: int, ffn: int, heads: int, groups: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.groups, self.head_dim, self.eps = heads, groups, head_dim, eps
        self.attn_norm = nn.Parameter(torch.ones(hidden))
        self.qkv = nn.Linear(hidden, (heads + 2 * groups) * head_dim, bias=False)
        self.q_norm = nn.Parameter(torch.ones(head_dim))
        self.k_norm = nn.Parameter(torch.ones(head_dim))
        self.proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(hidden))
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)


def rope(x_BHSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    half = x_BHSD.shape[-1] // 2
    rotated = torch.cat((-x_BHSD[..., half:], x_BHSD[..., :half]), dim=-1)
    return x_BHSD * cos_SD + rotated * sin_SD


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


def layer_forward(
    layer: Layer, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor
) -> torch.Tensor:
    B, S, _ = x_BSH.shape
    h_BSH = rms(x_BSH, layer.attn_norm, layer.eps)
    qkv = layer.qkv(h_BSH).view(B, S, layer.heads + 2 * layer.groups, layer.head_dim)
    q_BSAD, k_BSGD, v_BSGD = qkv.split([layer.heads, layer.groups, layer.groups], dim=2)
    q_BASD = rms(q_BSAD, layer.q_norm, layer.eps).transpose(1, 2)
    k_BGSD = rms(k_BSGD, layer.k_norm, layer.eps).transpose(1, 2)
    q_BASD, k_BGSD = rope(q_BASD, cos_SD, sin_SD), rope(k_BGSD, cos_SD, sin_SD)
    o_BASD = F.scaled_dot_product_attention(
        q_BASD, k_BGSD, v_BSGD.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    x_BSH = x_BSH + layer.proj(o_BASD.transpose(1, 2).reshape(B, S, -1))
    h_BSH = rms(x_BSH, layer.mlp_norm, layer.eps)
    gate, up = layer.gate_up(h_BSH).chunk(2, dim=-1)
    return x_BSH + layer.down(F.silu(gate) * up)


def head_loss(
    x_BSH: torch.Tensor, norm_H: torch.Tensor, eps: float, embedding_VH: torch.Tensor, labels_BS
) -> torch.Tensor:
    h_BSH = rms(x_BSH, norm_H, eps)
    logits = F.linear(h_BSH, embedding_VH)
    return F.cross_entropy(logits.float().flatten(0, 1), labels_BS.flatten())


class Decoder(nn.Module):
    def __init__(self, cfg, seq_len: int, compile_mode: str):
        super().__init__()
        self.eps = cfg.norm_epsilon
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Layer(cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads, cfg.num_query_groups,
                  cfg.kv_channels, cfg.norm_epsilon)
            for _ in range(cfg.num_layers)
        )  # fmt: skip
        self.final_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        inv_freq = 1.0 / (cfg.rotary_base ** (torch.arange(0, cfg.kv_channels, 2).float() / cfg.kv_channels))
        angles = torch.outer(torch.arange(seq_len).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        compiled = compile_mode == "layer"
        self.layer_fn = torch.compile(layer_forward) if compiled else layer_forward
        self.head_fn = torch.compile(head_loss) if compiled else head_loss

    def forward(self, ids_BS: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        # the residual stream in bf16, as megatron keeps it (fp32_residual_connection off)
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else self.cos.dtype
        x = self.embedding(ids_BS).to(dtype)
        cos, sin = self.cos.to(dtype), self.sin.to(dtype)
        for layer in self.layers:
            x = self.layer_fn(layer, x, cos, sin)
        return self.head_fn(x, self.final_norm, self.eps, self.embedding.weight, labels_BS)


def flops_per_token(cfg, seq_len: int) -> tuple[int, int, int]:
    """(N_matmul, model FLOPs, the same with PaLM's attention count) per token: train_mfu.py's
    count, 6 N_matmul + 6 L s a d (causal attention), and PaLM's 12 L s a d (no causal saving)."""
    attention = cfg.num_layers * seq_len * cfg.num_attention_heads * cfg.kv_channels
    qkvo = cfg.hidden_size * cfg.kv_channels * (2 * cfg.num_attention_heads + 2 * cfg.num_query_groups)
    n_matmul = cfg.num_layers * (qkvo + 3 * cfg.hidden_size * cfg.ffn_hidden_size)
    n_matmul += cfg.vocab_size * cfg.hidden_size  # the output layer (tied to the embedding)
    return n_matmul, 6 * n_matmul + 6 * attention, 6 * n_matmul + 12 * attention


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accum", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--precision", choices=["amp", "bf16"], default="amp")
    parser.add_argument("--compile", choices=["layer", "model", "none"], default="layer")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_PEAK_TFLOPS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("plain_mfu.py needs a CUDA GPU")
    cfg, device = QWEN3_1P7B, torch.device("cuda")
    torch._dynamo.config.cache_size_limit = 64  # one layer graph is expected; never fall back to eager
    torch.manual_seed(0)
    weight_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = Decoder(cfg, args.seq_len, args.compile).to(device=device, dtype=weight_dtype)
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    forward = torch.compile(model) if args.compile == "model" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    generator = torch.Generator(device=device).manual_seed(0)
    batches = []
    for _ in range(args.accum):
        ids = torch.randint(
            cfg.vocab_size, (args.micro_batch, args.seq_len + 1), device=device, generator=generator
        )
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))

    def step() -> float:
        total = torch.zeros((), device=device)
        for ids, labels in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.precision == "amp"):
                loss = forward(ids, labels) / args.accum
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return total.item()

    seconds = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            seconds.append(time.perf_counter() - start)
        print(f"step {i}{' (warm-up)' if i < args.warmup else ''}: loss {loss:.4f}", flush=True)

    from torch._dynamo.utils import counters

    print(
        f"compiled: {sum(counters['graph_break'].values())} graph breaks, {counters['stats']['unique_graphs']} graph(s)"
    )
    n_matmul, flops, palm_flops = flops_per_token(cfg, args.seq_len)
    tokens_per_step = args.micro_batch * args.accum * args.seq_len
    mean_s = statistics.fmean(seconds)
    tflops = flops * tokens_per_step / mean_s / 1e12
    result = {
        "model": "plain torch, " + cfg.name,
        "precision": args.precision,
        "compile": args.compile,
        "matmul_params": n_matmul,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "accum": args.accum,
        "tokens_per_step": tokens_per_step,
        "step_s_mean": round(mean_s, 4),
        "step_s_median": round(statistics.median(seconds), 4),
        "tokens_per_s": round(tokens_per_step / mean_s),
        "model_tflops_per_s": round(tflops, 1),
        "mfu": round(tflops / args.peak_tflops, 4),
        "mfu_palm": round(palm_flops * tokens_per_step / mean_s / 1e12 / args.peak_tflops, 4),
        "of_measured_matmul_rate": round(tflops / H200_BF16_MEASURED_TFLOPS, 4),
        "peak_alloc_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "device": torch.cuda.get_device_name(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
