"""The trainer's log-prob and entropy passes on the GPU: rlx's Triton kernels against the same
arithmetic under torch.compile (what rlx ran before), first calls and warm; one JSON line per
implementation and vocabulary.

Each implementation runs in a process of its own (so that its first calls pay what a trainer
rank's do), with empty Triton and inductor caches under `--fresh-caches` (a fresh machine's), on
a sequence of micro-batch shapes as a run meets them: the first of a new batch and length, then
others. A call is the forward and backward of `sum(log p) + 0.1 sum(H)` over bf16 logits
[B, S, V], the gradient written over them (the trainer's way); `first_s` is each shape's first
call, `warm_ms` the median of five after it.

    source .whl/install.sh && python3 bench/logprob_passes.py [--vocab 49152,151936] [--fresh-caches]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPES = [(64, 130), (64, 120), (32, 100), (16, 516)]  # (micro-batch, positions) in the order met


def compiled_passes():
    """rlx.trainer.logprobs as it ran before its Triton kernels: each torch pass compiled."""
    import torch

    import rlx.trainer.logprobs as lp

    passes = {name: torch.compile(getattr(lp, name)) for name in
              ("_row_max", "_log_z_and_picked", "_expected_shifted", "_grad_over_logits")}  # fmt: skip

    def forward(logits, target, owned, temperature, with_entropy):
        max_ = passes["_row_max"](logits, temperature)
        sum_exp, picked = passes["_log_z_and_picked"](logits, max_, target, owned, temperature)
        log_z = sum_exp.log()
        expected = passes["_expected_shifted"](logits, max_, log_z, temperature) if with_entropy else None
        return max_, log_z, picked - log_z, expected

    lp._forward_cuda = forward
    grad = passes["_grad_over_logits"]

    def grad_logits(*args, out=None):
        assert out is not None, "the bench writes the gradient over the logits"
        grad(*args)
        return out

    import rlx.trainer.triton_logprobs as tl

    tl.grad_logits = grad_logits


def child(impl: str, vocab: int) -> dict:
    import torch

    from rlx.trainer.parallel import init_distributed

    init_distributed(0, 1, "127.0.0.1", int(os.environ["BENCH_PORT"]))
    if impl == "compile":
        compiled_passes()
    from rlx.trainer.logprobs import logprobs_and_entropy

    def call(logits, target):
        x = logits * 1.0  # not a leaf: the gradient goes over it
        logp, entropy = logprobs_and_entropy(x, target, grad_over_logits=True)
        (logp.sum() + 0.1 * entropy.sum()).backward()
        torch.cuda.synchronize()

    result = {"impl": impl, "vocab": vocab, "first_s": {}, "warm_ms": {}}
    for batch, length in SHAPES:
        logits = torch.randn(batch, length, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, vocab, (batch, length), device="cuda")
        torch.cuda.synchronize()
        began = time.perf_counter()
        call(logits, target)
        result["first_s"][f"{batch}x{length}"] = round(time.perf_counter() - began, 3)
        times = []
        for _ in range(5):
            began = time.perf_counter()
            call(logits, target)
            times.append(time.perf_counter() - began)
        result["warm_ms"][f"{batch}x{length}"] = round(sorted(times)[2] * 1e3, 2)
    result["first_calls_s"] = round(sum(result["first_s"].values()), 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--impls", default="triton,compile")
    parser.add_argument("--vocab", default="49152,151936", help="vocabulary sizes (SmolLM2's, Qwen3's)")
    parser.add_argument("--fresh-caches", action="store_true", help="empty Triton and inductor caches each")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child[0], int(args.child[1]))), flush=True)
        return
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from rlx.ports import free_port

    for vocab in args.vocab.split(","):
        for impl in args.impls.split(","):
            env = dict(os.environ, BENCH_PORT=str(free_port()))
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
            with tempfile.TemporaryDirectory() as caches:
                if args.fresh_caches:
                    env.update(
                        TRITON_CACHE_DIR=f"{caches}/triton", TORCHINDUCTOR_CACHE_DIR=f"{caches}/inductor"
                    )
                out = subprocess.run([sys.executable, __file__, "--child", impl, vocab], env=env,
                                     capture_output=True, text=True, timeout=600)  # fmt: skip
            lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
            if out.returncode != 0 or not lines:
                raise SystemExit(f"{impl} at V={vocab} failed:\n{out.stderr[-3000:]}")
            print(lines[-1][len("RESULT ") :], flush=True)


if __name__ == "__main__":
    main()
