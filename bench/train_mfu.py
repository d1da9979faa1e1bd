"""Train a Megatron GPTModel built by an rlx model family in bf16 on one GPU; print tokens/s and MFU.

    python bench/train_mfu.py                                     # Qwen3-1.7B shape, seq 4096, 32 rows a step
    python bench/train_mfu.py --seq-len 8192 --micro-batch 2 --accum 8 --profile 20
    python bench/train_mfu.py kernels=torch                        # megatron's unfused layers (no fusions)
    python bench/train_mfu.py kernels=compile                      # torch.compile'd norms/RoPE, no liger
    python bench/train_mfu.py --compile-layers                     # and torch.compile of each whole layer
    python bench/train_mfu.py --lora-rank 64                       # LoRA adapters on every linear layer, base frozen
    python bench/train_mfu.py num_layers=36 hidden_size=2560 ffn_hidden_size=9728 \\
        num_attention_heads=32                                    # Qwen3-4B shape
    # on the GPU machine:
    source .whl/install.sh && PYTHONUNBUFFERED=1 python3 bench/train_mfu.py

Positional arguments are `ModelConfig` overrides (OmegaConf dotlist, type-checked) on top of the
Qwen3-1.7B shape below, `_target_` (the family) and `megatron_overrides.<key>` included. Weights are
random (no checkpoint: speed does not depend on them); tokens are uniform random ids.

What is trained: the family's `build_model` (megatron's local spec, SDPA core attention, no
Transformer Engine, the fused kernels `model.kernels` selects: rlx.models.kernels) in bf16 through megatron's `Float16Module` (`rlx.models.precision`), megatron's
`DistributedDataParallel` (fp32 gradient buffer) and `get_megatron_optimizer` (Adam, bf16=True:
fp32 master weights; torch's fused Adam, or its multi-tensor one with `--adam foreach`), wrapped
by the trainer's own `wrap_for_training`, one optimizer step per `--micro-batch` x `--accum` sequences of `--seq-len`
tokens through `get_forward_backward_func`, loss = megatron's vocab-parallel cross entropy. No
activation recompute. `--warmup` steps are excluded; the clock is read after a device synchronize.
One more step is then timed in parts (`host_and_gpu_s`): when the GPU has nothing left to run once
the host has issued the forward-backward, the step is bound by the host's launches, not the GPU.

FLOPs (model FLOPs: what the model needs, not what the kernels do), per trained token:

    6 * N_matmul  +  6 * L * s * (a * d)

- N_matmul: the weights of every matrix product, i.e. the 2-D weights of the decoder (q/k/v/o
  projections, MLP fc1/fc2) plus the output layer's V * h, counted also when it is tied to the
  embedding (it is still a matmul). The embedding lookup (a gather), norms and biases are not
  counted. 6 = 2 (multiply-add) x 3 (forward, input grad, weight grad).
- Attention: QK^T and AV cost 2 * s_k * a * d FLOPs each per query in the forward pass; a causal
  mask leaves s/2 keys on average, so 2 * s * a * d forward, x3 with the backward: 6 * L * s * a * d
  (L layers, a query heads of size d). PaLM's convention counts no causal saving (12 * L * s * a * d);
  that figure is printed too, as `MFU (PaLM convention)`.

MFU = model FLOPs/s over 989.4 TFLOP/s, the H100/H200 SXM dense bf16 datasheet peak (override
with --peak-tflops). The share of the bf16 matmul rate measured on the H200 machine (about
790 TFLOP/s, the device README) is printed as well. Dense models only (MoE and MLA would need
active-parameter and latent-attention counts). With `--lora-rank`, the base weights are frozen
(no weight gradient, no optimizer state) and the adapters train (`rlx.lora`); FLOPs are still
counted as full fine-tuning's 6 * N_matmul, so its MFU compares throughput, not work done.
Measured figures: docs/benchmarks.md;
`bench/plain_mfu.py` is the yardstick (the same shape in plain torch under torch.compile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial

import torch
from omegaconf import OmegaConf

from rlx.config import build
from rlx.lora.adapter import is_adapter
from rlx.lora.apply import apply_lora
from rlx.lora.config import LoRAConfig
from rlx.models.config import ModelConfig
from rlx.ports import LOOPBACK, free_port
from rlx.trainer.parallel import destroy_distributed, init_distributed

# Qwen/Qwen3-1.7B's config.json (Qwen3ForCausalLM): about 1.72B parameters, tied embeddings.
QWEN3_1P7B = ModelConfig(
    _target_="rlx.models.qwen3.Qwen3",
    name="qwen3_1p7b_shape",
    tiny=False,
    num_layers=28,
    hidden_size=2048,
    ffn_hidden_size=6144,
    num_attention_heads=16,
    num_query_groups=8,
    kv_channels=128,
    vocab_size=151936,
    max_position_embeddings=40960,
    rotary_base=1000000.0,
    norm_epsilon=1e-6,
    tie_word_embeddings=True,
)
H200_BF16_DENSE_PEAK_TFLOPS = 989.4  # datasheet (same SXM tensor cores as the H100)
H200_BF16_MEASURED_TFLOPS = 790.0  # bf16 matmul on random data, measured on the device machine


def model_config(overrides: list[str]) -> ModelConfig:
    """The Qwen3-1.7B shape with `key=value` overrides applied (types checked by OmegaConf)."""
    merged = OmegaConf.merge(OmegaConf.structured(QWEN3_1P7B), OmegaConf.from_dotlist(overrides))
    cfg = OmegaConf.to_object(merged)
    if cfg.num_moe_experts or cfg.kv_lora_rank:
        raise SystemExit("train_mfu.py counts FLOPs for dense models only (no MoE, no MLA)")
    return cfg


def flops_per_token(model: torch.nn.Module, cfg: ModelConfig, seq_len: int) -> tuple[int, int, int]:
    """(N_matmul, model FLOPs per token with causal attention, with PaLM's non-causal count)."""
    decoder_matmul = sum(
        p.numel()
        for name, p in model.named_parameters()
        if p.dim() == 2 and "embedding" not in name and not is_adapter(p)
    )
    has_output_weight = any("output_layer" in name for name, _ in model.named_parameters())
    n_matmul = decoder_matmul + (0 if has_output_weight else cfg.vocab_size * cfg.hidden_size)
    attention_dim = cfg.num_attention_heads * cfg.kv_channels
    causal = 6 * n_matmul + 6 * cfg.num_layers * seq_len * attention_dim
    palm = 6 * n_matmul + 12 * cfg.num_layers * seq_len * attention_dim
    return n_matmul, causal, palm


def predicted_peak_gib(
    cfg: ModelConfig,
    micro_batch: int,
    accum: int,
    seq_len: int,
    lora: LoRAConfig | None = None,
    adam_fused: bool = True,
) -> float:
    """The memory plan's (rlx.memory) prediction of max_memory_allocated for this bench's step: bf16,
    no distributed optimizer, `micro_batch` rows of `seq_len`. Its logits term is the RL trainer's
    loss (bf16 logits, their gradient written over them); this bench's loss is megatron's cross
    entropy, which keeps a bf16 gradient beside them and takes both in fp32 as well, so the bench's
    own logits cost about 6 x tokens x vocabulary bytes more (`bench_peak_bytes`)."""
    from rlx.cluster import ClusterConfig
    from rlx.memory import GIB, Setup, trainer_peak_allocated
    from rlx.rollout.config import RolloutConfig
    from rlx.trainer.config import TrainConfig

    train = TrainConfig(
        precision="bf16",
        micro_batch_size=micro_batch,
        global_batch_size=micro_batch * accum,
        lora=lora or LoRAConfig(),
        adam_fused=adam_fused,
    )
    setup = Setup(cfg, train, ClusterConfig(gpus_per_node=1), RolloutConfig(max_response_len=seq_len))
    return trainer_peak_allocated(setup) / GIB


ROWS = 32  # sequences a step when --micro-batch is not given: the micro-batch x accumulation the plan fits
MARGIN = 0.10  # of the GPU left free beside the predicted peak (rlx.cluster's memory_margin)


def bench_peak_bytes(
    cfg: ModelConfig, micro_batch: int, accum: int, seq_len: int, lora=None, adam_fused: bool = True
) -> int:
    """This bench's predicted peak: the plan's (`predicted_peak_gib`), plus what its loss adds: megatron's
    cross entropy keeps the logits' bf16 gradient beside them (2 bytes a token and word) and takes
    both in fp32 as well (2 x 2 bytes more), where the RL loss the plan counts writes its gradient
    over its bf16 logits."""
    from rlx.memory import GIB

    loss_logits = (2 + 2 * 2) * micro_batch * seq_len * cfg.vocab_size
    return round(predicted_peak_gib(cfg, micro_batch, accum, seq_len, lora, adam_fused) * GIB) + loss_logits


def choose_micro_batch(
    cfg: ModelConfig, seq_len: int, gpu_bytes: int, rows: int = ROWS, lora=None, adam_fused: bool = True
) -> int:
    """The largest micro-batch (8, 4, 2 or 1, dividing `rows`) whose step leaves MARGIN of a GPU
    of `gpu_bytes` free by `bench_peak_bytes` (the default 4 x 8 ran out of memory on an H100)."""
    for micro_batch in (m for m in (8, 4, 2, 1) if rows % m == 0):
        peak = bench_peak_bytes(cfg, micro_batch, rows // micro_batch, seq_len, lora, adam_fused)
        if peak <= (1 - MARGIN) * gpu_bytes:
            return micro_batch
    return 1


def build_training(
    cfg: ModelConfig,
    device: torch.device,
    lr: float,
    fuse_wgrad: bool = True,
    lora: LoRAConfig | None = None,
    adam_fused: bool = True,
):
    """(DDP-wrapped bf16 model, megatron optimizer, bare GPTModel) for one GPU, wrapped as the
    trainer wraps its model (`rlx.trainer.trainable.wrap_for_training`: megatron DDP with an fp32
    grad buffer, megatron's Adam with fp32 masters, clip 1.0, no weight decay). `fuse_wgrad`:
    weight gradients accumulated into the fp32 grad buffer by their GEMMs where the kernel set does
    so (rlx.models.kernels.fuse_weight_gradients). `lora`: adapters on the model, the rest frozen,
    as the trainer puts them (rlx.lora.apply). `adam_fused`: `train.adam_fused`."""
    from rlx.trainer.config import TrainConfig
    from rlx.trainer.trainable import wrap_for_training

    family = build(cfg)
    # Torch norms are built on the CPU; Megatron-LM's get_model moves the whole model too.
    gpt = family.build_model(params_dtype=torch.bfloat16).to(device)
    if lora is not None:
        apply_lora(gpt, lora, seed=0)
    train_cfg = TrainConfig(precision="bf16", clip_grad=1.0, weight_decay=0.0, adam_fused=adam_fused)
    fuse = fuse_wgrad and family.kernels().wgrad_accumulation
    (model,), optimizer = wrap_for_training([gpt], train_cfg, lr, torch.bfloat16, fuse_wgrad=fuse)
    return model, optimizer, gpt


def _forward_step(data_iterator, model):
    tokens_BL, labels_BL = next(data_iterator)
    loss_BL = model(input_ids=tokens_BL, position_ids=None, attention_mask=None, labels=labels_BL)

    def loss_func(loss_BL):
        loss = loss_BL.mean()
        # megatron divides `loss` in place by the number of micro-batches: report a copy
        return loss, {"loss": loss.detach().clone()}

    return loss_BL, loss_func


def _forward_backward(model, optimizer, fwd_bwd, micro_batches: list, seq_len: int) -> list[dict]:
    """Zeroed gradients, then megatron's forward-backward over `micro_batches` (issued, not waited for)."""
    model.zero_grad_buffer()
    optimizer.zero_grad()
    return fwd_bwd(
        forward_step_func=_forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq_len,
        micro_batch_size=micro_batches[0][0].shape[0],
        forward_only=False,
    )


def train_step(model, optimizer, fwd_bwd, micro_batches: list, seq_len: int) -> float:
    """One optimizer step over `micro_batches`; returns the mean loss (a device sync)."""
    losses = _forward_backward(model, optimizer, fwd_bwd, micro_batches, seq_len)
    optimizer.step()
    return torch.stack([m["loss"] for m in losses]).mean().item()


def host_and_gpu_seconds(model, optimizer, fwd_bwd, micro_batches: list, seq_len: int) -> dict[str, float]:
    """One more step in parts: the host's time to issue the forward-backward, how long the GPU
    still ran after that (near 0: the GPU waited on the host's launches, the step is host-bound),
    then the optimizer step's host time and the GPU's after it."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    _forward_backward(model, optimizer, fwd_bwd, micro_batches, seq_len)
    issued = time.perf_counter()
    torch.cuda.synchronize()
    finished = time.perf_counter()
    optimizer.step()
    stepped = time.perf_counter()
    torch.cuda.synchronize()
    parts = {
        "forward_backward_host_s": issued - start,
        "forward_backward_gpu_after_host_s": finished - issued,
        "optimizer_host_s": stepped - finished,
        "optimizer_gpu_after_host_s": time.perf_counter() - stepped,
    }
    return {k: round(v, 4) for k, v in parts.items()}


def compile_layers(gpt: torch.nn.Module) -> None:
    """torch.compile every decoder layer in place. Megatron's RowParallelLinear warns (rank 0)
    that its tp_group is None on every call, and a warning is a graph break: dynamo is told to
    drop `warnings.warn` calls, which leaves one graph, shared by all layers, with none."""
    import warnings

    torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
    for layer in gpt.decoder.layers:
        layer.compile()


def with_sdpa_backend(backend: str, step):
    """`step()` with torch SDPA restricted to one backend (fails if it cannot run the shapes)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
    with sdpa_kernel(getattr(SDPBackend, names[backend])):
        return step()


def print_kernel_profile(step, num_rows: int) -> None:
    """Run one step under torch.profiler and print the kernels with the most GPU time."""
    from torch.profiler import ProfilerActivity, profile

    from rlx.trainer.profiling import op_table

    # CPU too: the second table (the ops that launched the GPU time) is made from the CPU's ops
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(op_table(prof, num_rows))


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="ModelConfig overrides, key=value")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument(
        "--micro-batch",
        type=int,
        help=f"default: the largest the memory plan fits on this GPU with {MARGIN:.0%} free, {ROWS} rows a step",
    )
    parser.add_argument(
        "--accum", type=int, help="micro-batches per optimizer step (default: 8, or to make 32 rows)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_PEAK_TFLOPS)
    parser.add_argument(
        "--sdpa-backend",
        choices=["default", "flash", "cudnn", "efficient"],
        default="default",
        help="restrict torch SDPA to one kernel family (default: torch's own choice)",
    )
    parser.add_argument(
        "--compile-layers",
        action="store_true",
        help="torch.compile each whole decoder layer (over the kernels `model.kernels` put in it)",
    )
    parser.add_argument(
        "--unfused-wgrad",
        action="store_true",
        help="bf16 weight gradients added to the fp32 grad buffer by DDP's hook (megatron's path without apex)",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=None, help="train LoRA adapters of this rank (base frozen)"
    )
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument(
        "--adam",
        choices=["fused", "foreach"],
        default="fused",
        help="torch's fused Adam (train.adam_fused, the default) or its multi-tensor one",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="after timing, print the N GPU kernels taking most time in one step",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("train_mfu.py needs a CUDA GPU")

    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg = model_config(args.overrides)
    fused = args.adam == "fused"
    lora = LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha) if args.lora_rank else None
    if args.micro_batch is None:  # from the GPU's memory: no default run fails for want of it
        total = torch.cuda.mem_get_info()[1]
        args.micro_batch = choose_micro_batch(cfg, args.seq_len, total, lora=lora, adam_fused=fused)
        args.accum = args.accum or ROWS // args.micro_batch
        print(f"micro-batch {args.micro_batch} x {args.accum}: the largest the memory plan fits on "
              f"{torch.cuda.get_device_name()} ({total / 2**30:.1f} GiB) with {MARGIN:.0%} free", flush=True)  # fmt: skip
    args.accum = args.accum or 8
    device = init_distributed(0, 1, LOOPBACK, free_port(), seed=args.seed)
    try:
        model, optimizer, gpt = build_training(
            cfg, device, args.lr, fuse_wgrad=not args.unfused_wgrad, lora=lora, adam_fused=fused
        )
        if args.compile_layers:
            compile_layers(gpt)
        n_matmul, flops_causal, flops_palm = flops_per_token(gpt, cfg, args.seq_len)
        n_params = sum(p.numel() for p in gpt.parameters() if not is_adapter(p))
        n_trainable = sum(p.numel() for p in gpt.parameters() if p.requires_grad)
        generator = torch.Generator(device=device).manual_seed(args.seed)
        micro_batches = []
        for _ in range(args.accum):
            ids = torch.randint(
                cfg.vocab_size, (args.micro_batch, args.seq_len + 1), device=device, generator=generator
            )
            micro_batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
        fwd_bwd = get_forward_backward_func()
        step = partial(train_step, model, optimizer, fwd_bwd, micro_batches, args.seq_len)
        in_parts = partial(host_and_gpu_seconds, model, optimizer, fwd_bwd, micro_batches, args.seq_len)
        if args.sdpa_backend != "default":
            step = partial(with_sdpa_backend, args.sdpa_backend, step)
            in_parts = partial(with_sdpa_backend, args.sdpa_backend, in_parts)

        losses, seconds = [], []
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = step()  # .item() synchronises; the explicit one makes it independent of that
            torch.cuda.synchronize()
            if i >= args.warmup:
                seconds.append(time.perf_counter() - start)
            losses.append(loss)
            print(f"step {i}{' (warm-up)' if i < args.warmup else ''}: loss {loss:.4f}", flush=True)
        host_bound = in_parts()
        print(f"one more step in parts: {host_bound}", flush=True)
        if args.profile:
            print_kernel_profile(step, args.profile)
        if args.compile_layers:
            from torch._dynamo.utils import counters

            graph_breaks = sum(counters["graph_break"].values())
            print(
                f"compiled layers: {graph_breaks} graph breaks, {counters['stats']['unique_graphs']} graph(s)"
            )
    finally:
        destroy_distributed()

    tokens_per_step = args.micro_batch * args.accum * args.seq_len
    mean_s = statistics.fmean(seconds)
    tokens_per_s = tokens_per_step / mean_s
    result = {
        "model": cfg.name,
        "overrides": args.overrides,
        "params": n_params,
        "trainable_params": n_trainable,
        "lora_rank": args.lora_rank,
        "matmul_params": n_matmul,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "accum": args.accum,
        "tokens_per_step": tokens_per_step,
        "timed_steps": args.steps,
        "step_s_mean": mean_s,
        "step_s_median": statistics.median(seconds),
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_causal,
        "model_tflops_per_s": flops_causal * tokens_per_s / 1e12,
        "mfu": flops_causal * tokens_per_s / (args.peak_tflops * 1e12),
        "mfu_palm": flops_palm * tokens_per_s / (args.peak_tflops * 1e12),
        "share_of_measured_matmul": flops_causal * tokens_per_s / (H200_BF16_MEASURED_TFLOPS * 1e12),
        "peak_tflops": args.peak_tflops,
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "adam": args.adam,
        "predicted_peak_gib": predicted_peak_gib(
            cfg, args.micro_batch, args.accum, args.seq_len, lora, fused
        ),
        # with the bench's own logits (what chose the micro-batch when none was given)
        "predicted_bench_peak_gib": bench_peak_bytes(
            cfg, args.micro_batch, args.accum, args.seq_len, lora, fused
        )
        / 2**30,
        "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "losses": losses,
        "sdpa_backend": args.sdpa_backend,
        "kernels": build(cfg).kernels().name,
        "compile_layers": args.compile_layers,
        "host_and_gpu_s": host_bound,
        "fused_wgrad": sum(getattr(m, "gradient_accumulation_fusion", False) for m in gpt.modules()),
        "gpu": torch.cuda.get_device_name(),
    }
    print(
        f"{cfg.name} (kernels: {result['kernels']}): {n_params / 1e9:.3f}B params ({n_matmul / 1e9:.3f}B in matmuls), "
        f"seq {args.seq_len}, micro-batch {args.micro_batch} x {args.accum} accumulation "
        f"= {tokens_per_step} tokens/step\n"
        f"  step {mean_s:.3f} s mean, {result['step_s_median']:.3f} s median over {args.steps} steps "
        f"({args.warmup} warm-up excluded)\n"
        f"  {tokens_per_s:,.0f} tokens/s; FLOPs/token = 6*N_matmul + 6*L*s*a*d (causal) = {flops_causal / 1e9:.2f} G\n"
        f"  {result['model_tflops_per_s']:.1f} TFLOP/s = MFU {result['mfu']:.1%} of {args.peak_tflops} TFLOP/s "
        f"(bf16 dense spec); MFU (PaLM convention, 12*L*s*a*d) {result['mfu_palm']:.1%}; "
        f"{result['share_of_measured_matmul']:.1%} of the measured {H200_BF16_MEASURED_TFLOPS:.0f} TFLOP/s matmul\n"
        f"  peak memory {result['max_memory_allocated_gib']:.1f} GiB allocated, "
        f"{result['max_memory_reserved_gib']:.1f} GiB reserved; the memory plan predicts "
        f"{result['predicted_peak_gib']:.1f} GiB (rlx.memory; its logits are the RL loss's bf16, this loss's fp32)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
