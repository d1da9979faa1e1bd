"""Time each weight-sync path between two processes; print one JSON line.

    python bench/weight_sync.py                                   # CPU, a ~25M-parameter bf16 model
    python bench/weight_sync.py --shape qwen3_1.7b --device cuda  # 3.4 GB bf16 on the GPU machine
    python bench/weight_sync.py --shape qwen3_1.7b --device cuda --receiver-device cuda:1  # split

The sender (this process) holds HF-named weights of a Qwen3-like shape; a spawned receiver holds
parameters of the same shapes and copies every received tensor into them, as an engine does.
A sync is timed from the first byte the sender touches to the receiver's acknowledgement that all
parameters hold the new values (after a device synchronize), median of `--repeats` after one
warm-up. Paths:
  tensor       one payload for all tensors (per-tensor CUDA IPC handles / shared-memory files)
  tensor_flat  one payload per bucket, each bucket flattened into one buffer first
  distributed  a broadcast per bucket over the private group (NCCL on CUDA, gloo on CPU); needs a
               receiver on another GPU for NCCL (NCCL refuses two ranks on one GPU)
  disk         safetensors shard written by the sender, loaded by the receiver (today's path)
Each round exports fresh tensors (clones, outside the clock), as the trainer's gather does.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch
import torch.multiprocessing as mp

from rlx.ports import free_port
from rlx.weight_sync.buckets import iter_buckets
from rlx.weight_sync.distributed import WeightReceiver, WeightSender
from rlx.weight_sync.tensor import TensorHandoff, deserialize

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, head dim, vocab
    "small": (512, 1536, 4, 8, 4, 64, 32000),
    "qwen3_0.6b": (1024, 3072, 28, 16, 8, 128, 151936),
    "qwen3_1.7b": (2048, 6144, 28, 16, 8, 128, 151936),
    # Qwen3-30B-A3B's layer x 4 (untied): the MLP is 128 experts of width 768, a tensor each, and
    # a router: 1,575 tensors, as many small ones as a MoE sync sends (3.1B parameters)
    "qwen3_30b_a3b_4l": (2048, 768, 4, 32, 4, 128, 151936),
}
EXPERTS = {"qwen3_30b_a3b_4l": 128}
WAIT_S = 600.0
PATHS = ("tensor", "tensor_flat", "distributed", "disk")


def weight_specs(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes of a Qwen3-like model (embedding tied to the output layer; a MoE shape's
    untied, its experts one tensor each as an HF checkpoint names them)."""
    hidden, inter, layers, heads, kv_heads, head_dim, vocab = SHAPES[shape]
    specs = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (p + "self_attn.q_norm.weight", (head_dim,)),
            (p + "self_attn.k_norm.weight", (head_dim,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
        mlps = [f"{p}mlp.experts.{e}." for e in range(EXPERTS[shape])] if shape in EXPERTS else [p + "mlp."]
        specs += [(p + "mlp.gate.weight", (len(mlps), hidden))] if shape in EXPERTS else []
        for m in mlps:
            specs += [(m + "gate_proj.weight", (inter, hidden)), (m + "up_proj.weight", (inter, hidden)),
                      (m + "down_proj.weight", (hidden, inter))]  # fmt: skip
    untied = [("lm_head.weight", (vocab, hidden))] if shape in EXPERTS else []
    return specs + [("model.norm.weight", (hidden,))] + untied


def _watchdog(seconds: float) -> None:
    """After `seconds`, print every thread's stack to stderr and exit: where a hang is."""
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True)


def _receiver(specs, dtype, device: str, commands, acks, watchdog_s: float = 0.0) -> None:
    """The engine stand-in: parameters of the given shapes, filled by whichever path is asked."""
    _watchdog(watchdog_s)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    params = {name: torch.empty(shape, dtype=dtype, device=device) for name, shape in specs}
    receiver = WeightReceiver()

    def load(named) -> None:
        for name, tensor in named:
            params[name].copy_(tensor, non_blocking=True)

    def done() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        acks.put("ok")

    while (command := commands.get(timeout=WAIT_S))[0] != "stop":
        kind, arg = command
        if kind == "tensor":
            received = deserialize(arg)
            load(received)
            del received  # drop the mapping before acknowledging (the lifetime rule)
            done()
        elif kind == "init":
            receiver.init(*arg)
            acks.put("ok")
        elif kind == "bucket":
            load(receiver.receive(arg))
        elif kind == "end":
            done()
        elif kind == "disk":
            from safetensors.torch import load_file

            load(load_file(arg, device=str(device)).items())
            done()
    receiver.close()


def _time_rounds(run_once, fresh_weights, repeats: int) -> dict[str, float]:
    times = []
    for _ in range(repeats + 1):  # the first is warm-up
        weights = fresh_weights()
        started = time.perf_counter()
        run_once(weights)
        times.append(time.perf_counter() - started)
    return {"median_s": round(statistics.median(times[1:]), 4), "min_s": round(min(times[1:]), 4)}


def bench_paths(args, specs, commands, acks) -> dict[str, dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    source = [(name, torch.randn(shape, generator=gen, device=device).to(dtype)) for name, shape in specs]
    fresh = lambda: [(name, t.clone()) for name, t in source]  # noqa: E731
    bucket_bytes = args.bucket_mb << 20
    ack = lambda: acks.get(timeout=WAIT_S)  # noqa: E731
    results = {}

    def tensor(weights):
        with TensorHandoff(weights) as payload:
            commands.put(("tensor", payload))
            ack()

    def tensor_flat(weights):
        for bucket in iter_buckets(weights, bucket_bytes):
            with TensorHandoff(bucket, flat=True) as payload:
                commands.put(("tensor", payload))
                ack()

    same_device = args.receiver_device == args.device or device.type == "cpu"
    paths = {
        "tensor": lambda: _time_rounds(tensor, fresh, args.repeats) if same_device else None,
        "tensor_flat": lambda: _time_rounds(tensor_flat, fresh, args.repeats) if same_device else None,
        "distributed": lambda: bench_distributed(args, fresh, bucket_bytes, commands, ack),
        "disk": lambda: bench_disk(args, fresh, commands, ack),
    }
    for name in args.paths:
        started = time.perf_counter()
        if (result := paths[name]()) is not None:  # tensor paths: one device only (CUDA IPC)
            results[name] = result
            print(f"{name}: {result} ({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)
    return results


def bench_distributed(args, fresh, bucket_bytes: int, commands, ack) -> dict:
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    if backend == "nccl" and args.receiver_device == args.device:
        return {"skipped": "NCCL needs the receiver on another GPU (--receiver-device cuda:1)"}
    port, sender = free_port(), WeightSender()
    started = time.perf_counter()
    commands.put(("init", ("127.0.0.1", port, 1, 2, backend, "bench", 120.0)))
    sender.init("127.0.0.1", port, 2, backend=backend, group_name="bench", timeout_s=120.0)
    ack()
    init_s = time.perf_counter() - started

    def distributed(weights):
        sender.send(weights, bucket_bytes, announce=lambda meta: commands.put(("bucket", meta)))
        commands.put(("end", None))
        ack()

    try:
        return {
            "backend": backend,
            "init_s": round(init_s, 4),
            **_time_rounds(distributed, fresh, args.repeats),
        }
    finally:
        sender.close()


def bench_disk(args, fresh, commands, ack) -> dict:
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(dir=args.disk_dir) as tmp:
        path = str(Path(tmp) / "model.safetensors")

        def disk(weights):
            save_file(dict(weights), path)
            commands.put(("disk", path))
            ack()

        return _time_rounds(disk, fresh, args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu", help="the sender's device: cpu or cuda[:i]")
    parser.add_argument("--receiver-device", default=None, help="default: the sender's (colocated)")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--disk-dir", default=None, help="where the disk path writes (default: the temp dir)")
    parser.add_argument(
        "--paths", nargs="+", choices=PATHS, default=list(PATHS), help="the paths to time, in this order"
    )
    parser.add_argument(
        "--watchdog-s", type=float, default=0.0, help="print both processes' stacks and exit after this long"
    )
    args = parser.parse_args()
    _watchdog(args.watchdog_s)
    args.device = str(torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device))
    args.receiver_device = args.receiver_device or args.device
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    specs = weight_specs(args.shape)
    ctx = mp.get_context("spawn")
    commands, acks = ctx.Queue(), ctx.Queue()
    dtype = getattr(torch, args.dtype)
    proc = ctx.Process(
        target=_receiver,
        args=(specs, dtype, args.receiver_device, commands, acks, args.watchdog_s),
        daemon=True,
    )
    proc.start()
    try:
        paths = bench_paths(args, specs, commands, acks)
    finally:
        commands.put(("stop", None))
        proc.join(timeout=60)
    total_bytes = sum(torch.Size(shape).numel() for _, shape in specs) * dtype.itemsize
    for result in paths.values():
        if "median_s" in result:
            result["GB_per_s"] = round(total_bytes / result["median_s"] / 1e9, 2)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
    record = {
        "bench": "weight_sync", "date": date.today().isoformat(), "machine": platform.node(),
        "device": device_name or platform.machine(), "sender": args.device, "receiver": args.receiver_device,
        "shape": args.shape, "dtype": args.dtype, "num_tensors": len(specs), "total_bytes": total_bytes,
        "bucket_bytes": args.bucket_mb << 20, "paths": paths,
    }  # fmt: skip
    print(json.dumps(record))


if __name__ == "__main__":
    main()
