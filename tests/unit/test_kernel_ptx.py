"""The engine's Triton kernels (and the trainer's log-prob passes) compiled for Hopper (sm90) on the
CPU by bench/kernel_ptx.py, in a child process with the interpreter's Triton (`RLX_TRITON_DIR`, as
tests/unit/test_triton_interpreted.py runs it): none spills to local memory; the RMSNorm, the
engine's most called small kernel (57 calls a 1.7B decode step), loads its weight before its PDL
wait and nothing after its first store (summing a split GEMM's partials too), the small GEMM (its
split and SwiGLU forms too) asks the L2 for its weight before the wait and reads nothing before it, the q/k norm nothing after its first store, the sampler's
second kernel its six inputs before its first reduction (a load written after work on earlier data
is issued only once that data has arrived: docs/benchmarks.md, Decisions, PDL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_engine_kernels_compile_for_sm90_without_spills_and_load_first():
    triton_dir = os.environ.get("RLX_TRITON_DIR")
    if not triton_dir:
        pytest.skip("RLX_TRITON_DIR unset: scripts/test.sh installs Triton for the interpreter and sets it")
    path = [triton_dir, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    result = subprocess.run(
        [sys.executable, "bench/kernel_ptx.py"], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    kernels = {name: k for name, k in report.items() if isinstance(k, dict)}
    assert set(kernels) == {
        "add_rms_norm",
        "add_rms_norm_split",
        "qk_norm_rope_store",
        "silu_mul",
        "small_gemm",
        "small_gemm_split",
        "small_swiglu",
        "sample_blocks",
        "sample_select",
        "truncate_row_stats",
        "truncate_start_state",
        "truncate_search_pass",
        "truncate_search_pass_counts",
        "truncate_search_pass_masses",
        "truncate_next_state",
        "truncate_kept_blocks",
        "truncate_select",
        "logprob_stats",
        "logprob_grad",
    }
    assert all(k["local_bytes"] == 0 for k in kernels.values()), kernels
    ops = {name: [op for op, _ in k["memory_order"]] for name, k in kernels.items()}
    for name in ("add_rms_norm", "add_rms_norm_split"):
        weight = ops[name][: ops[name].index("griddepcontrol.wait")]
        assert any(op.startswith("ld.global") for op in weight), ops[name]
    for name in ("add_rms_norm", "add_rms_norm_split", "qk_norm_rope_store"):
        first_store = next(i for i, op in enumerate(ops[name]) if op.startswith("st.global"))
        assert not any(op.startswith("ld.global") for op in ops[name][first_store:]), (name, ops[name])

    for name in ("small_gemm", "small_gemm_split", "small_swiglu"):
        gemm = ops[name]  # its weight asked of the L2 first, x and the weight read by TMA after the wait
        wait = gemm.index("griddepcontrol.wait")
        assert gemm[0].startswith("prefetch.global"), (name, gemm)
        assert not any(op.startswith(("ld.global", "cp.async")) for op in gemm[:wait]), (name, gemm)
        assert any(op.startswith("cp.async.bulk.tensor.2d.shared") for op in gemm[wait:]), (name, gemm)

    def loads_before(name: str, prefix: str) -> int:
        order = kernels[name]["memory_order"]
        end = next(i for i, (op, _) in enumerate(order) if op.startswith(prefix))
        return sum(n for op, n in order[:end] if op.startswith("ld.global"))

    # Stats' maxima and sums, 1 / T, the greedy flag, the seed and the step
    assert loads_before("sample_select", "bar.sync") == 6, kernels["sample_select"]["memory_order"]
