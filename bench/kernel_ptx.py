"""The engine's Triton kernels (and the trainer's log-prob passes) compiled for a GPU on a machine
without one: each kernel's global memory operations in program order (loads, stores, barriers,
the PDL wait and launch), and its registers and local memory (spills) from the cubin; prints one
JSON line.

A warp issues its instructions in order, so a load written after work on an earlier load's data
is issued only once that data has arrived, and the compiler may not move a load above a store
that could alias it or above a barrier: a kernel that reads its inputs in stages pays a memory
round trip a stage (the engine's RMSNorm read its weight after its reduction and the residual's
store: docs/benchmarks.md, Decisions, PDL). The order shows where. The kernels are compiled at decode shapes (Qwen3-1.7B:
hidden 2048, heads of 128, two query heads a KV head, a 151,936-word vocabulary at 256 rows),
bf16, with their launches' settings; pointers 16-byte aligned and integers multiples of 16, as
the engine's are.

    PYTHONPATH=$RLX_TRITON_DIR python bench/kernel_ptx.py [--arch 90] [--kernels add_rms_norm,...]

Triton 3.9 (what scripts/test.sh installs for the interpreter, under `RLX_TRITON_DIR`) brings the
compiler, ptxas and cuobjdump; tests/unit/test_kernel_ptx.py runs this.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

MEMORY_OPS = re.compile(
    r"\b(ld\.global[.\w]*|st\.global[.\w]*|cp\.async\.[.\w:]*?global[.\w]*|prefetch\.global[.\w]*"
    r"|griddepcontrol\.\w+|bar\.sync)\b"
)


def _i32(*names: str) -> dict[str, str]:
    return dict.fromkeys(names, "i32")


def kernels() -> dict[str, tuple]:
    """name -> (the jit function, its signature's types, its constexprs, num_warps[, num_stages])."""
    from rlx.engine import triton_gemm, triton_layers, triton_sample, triton_truncate

    bf16 = "*bf16"
    norm_ints = _i32("stride_x", "stride_r", "stride_o", "stride_split", "N") | {"eps": "fp32"}

    def gemm_args(out: str) -> dict[str, str]:  # the small GEMM's TMA descriptors and pointers
        tiles = {"x_desc": "tensordesc<bf16[64, 128]>", "w_desc": "tensordesc<bf16[32, 128]>"}
        return tiles | {"out_desc": f"tensordesc<{out}>", "W": bf16, "B": bf16} | _i32("N", "K")

    return {
        "add_rms_norm": (
            triton_layers._add_rms_norm_kernel,
            dict.fromkeys(["X", "R", "W", "Out", "ResOut"], bf16) | norm_ints,
            {"HAS_RES": True, "BLOCK": 2048, "SPLIT": 1, "PDL": 2},
            4,
        ),
        "add_rms_norm_split": (  # summing a split o or down's two fp32 partials (Qwen3-0.6B: hidden 1,024)
            triton_layers._add_rms_norm_kernel,
            {"X": "*fp32"} | dict.fromkeys(["R", "W", "Out", "ResOut"], bf16) | norm_ints,
            {"HAS_RES": True, "BLOCK": 1024, "SPLIT": 2, "PDL": 2},
            4,
        ),
        "qk_norm_rope_store": (
            triton_layers._qk_norm_rope_store_kernel,
            dict.fromkeys(["Q", "K", "V", "QW", "KW"], bf16)
            | {"Cos": "*fp32", "Sin": "*fp32", "Pos": "*i64", "SlotBlock": "*i64", "SlotOffset": "*i64"}
            | {"KCache": bf16, "VCache": bf16}
            | _i32("stride_qt", "stride_kt", "stride_vt", "stride_cos", "stride_cb", "stride_ch")
            | {"eps": "fp32"},
            {"GROUP": 2, "BLOCK_G": 2, "D": 128, "HAS_NORM": True, "PDL": 2},
            1,
        ),
        "silu_mul": (
            triton_layers._silu_mul_kernel,
            dict.fromkeys(["G", "U", "Out"], bf16) | _i32("stride_g", "stride_u", "N"),
            {"BLOCK": 1024, "PDL": 2},
            4,
        ),
        "sample_blocks": (
            triton_sample._sample_blocks,
            {"Logits": bf16, "stride_row": "i32", "InvT": "*fp32", "Greedy": "*i32", "Stats": "*fp32"}
            | {"Index": "*i32", "V": "i32"},
            {"NB": 75, "BLOCK": triton_sample.BLOCK, "SHARE": 9, "PDL": 2},
            8,
        ),
        "sample_select": (
            triton_sample._sample_select,
            {"Logits": bf16, "stride_row": "i32", "InvT": "*fp32", "Greedy": "*i32", "Seed": "*i64"}
            | {"Step": "*i64", "Stats": "*fp32", "Index": "*i32", "Tokens": "*fp32", "Logprobs": "*fp32"}
            | {"V": "i32"},
            {"NB": 75, "NB_P2": 128, "BLOCK": triton_sample.BLOCK, "PDL": 2},
            8,
        ),
        "small_gemm": (  # Qwen3-0.6B's qkv at 64 rows, as small_gemm_settings launches it
            triton_gemm._small_gemm_kernel,
            gemm_args("bf16[64, 32]"),
            {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "HAS_BIAS": False, "PREFETCH": True, "LINE": 64}
            | {"SWIGLU": False, "SPLIT": 1, "PDL": 2},
            4,
            6,
        ),
        "small_gemm_split": (  # its o at 64 rows in four fp32 partials, as small_split_settings launches it
            triton_gemm._small_gemm_kernel,
            gemm_args("fp32[1, 64, 32]"),
            {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "HAS_BIAS": False, "PREFETCH": True, "LINE": 64}
            | {"SWIGLU": False, "SPLIT": 4, "PDL": 2},
            4,
            6,
        ),
        "small_swiglu": (  # its gate_up at 64 rows with SwiGLU, as small_swiglu_settings launches it
            triton_gemm._small_gemm_kernel,
            gemm_args("bf16[64, 32]"),
            {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "HAS_BIAS": False, "PREFETCH": True, "LINE": 64}
            | {"SWIGLU": True, "SPLIT": 1, "PDL": 2},
            4,
            6,
        ),
        **truncation_kernels(triton_truncate),
        **logprob_kernels(),
    }


def logprob_kernels() -> dict[str, tuple]:
    """The trainer's log-prob and entropy passes (rlx.trainer.triton_logprobs: a program a position,
    bf16 logits of any row strides, at a temperature, with the entropy), forward and backward."""
    from rlx.trainer import triton_logprobs

    rows = {"X": "*bf16", "T": "*i64", "OWNED": "*i1"} | _i32("n_pos", "V", "stride_b", "stride_s")
    settings = {"SCALE": True, "ENTROPY": True, "BLOCK": triton_logprobs.BLOCK_V}
    return {
        "logprob_stats": (
            triton_logprobs._stats_kernel,
            rows | dict.fromkeys(["M", "S", "W", "A_T"], "*fp32") | {"inv_t": "fp32"},
            settings,
            triton_logprobs.NUM_WARPS,
        ),
        "logprob_grad": (
            triton_logprobs._grad_kernel,
            rows
            | {"OUT": "*bf16"}
            | dict.fromkeys(["MAX", "LOG_Z", "EXPECTED", "G_LOGP", "G_H"], "*fp32")
            | _i32("out_stride_b", "out_stride_s")
            | {"inv_t": "fp32"},
            settings,
            triton_logprobs.NUM_WARPS,
        ),
    }


def truncation_kernels(module) -> dict[str, tuple]:
    """The truncating sampler's kernels (bf16 logits, 16-bit keys; 33 shares a row of 149 blocks
    of 1,024, as at 256 rows on 132 SMs)."""
    logits = {"Logits": "*bf16", "stride_row": "i32", "Rows": "*i64", "InvT": "*fp32"}
    state = {"StateI": "*i64", "StateF": "*fp32"}
    narrow = {"BLOCK": module.BLOCK, "WIDE": False}
    return {
        "truncate_row_stats": (
            module._row_stats,
            logits | {"Stats": "*fp32", "KeyRange": "*i32"} | _i32("V", "SH", "SHARE"),
            narrow,
            4,
        ),
        "truncate_start_state": (
            module._start_state,
            {"Logits": "*bf16", "Rows": "*i64", "InvT": "*fp32", "TopK": "*i64", "TopP": "*fp32"}
            | {"Stats": "*fp32", "KeyRange": "*i32"}
            | state
            | {"Keys": "*i64"}
            | _i32("passes", "SH"),
            {"SH_P2": 256, "WIDE": False},
            1,
        ),
        **{
            f"truncate_search_pass{suffix}": (  # the sums a batch's rows need: both, counts, masses
                module._search_pass,
                logits
                | state
                | {"Keys": "*i64", "Part": "*fp32"}
                | _i32("R", "V", "p", "passes", "SH", "SHARE"),
                {"TILE": module.SEARCH_TILE, "SUMS": sums} | narrow,
                module.SEARCH_WARPS,
            )
            for suffix, sums in (("", 3), ("_counts", 1), ("_masses", 2))
        },
        "truncate_next_state": (
            module._next_state,
            {"Rows": "*i64", "TopK": "*i64", "TopP": "*fp32"}
            | state
            | {"Keys": "*i64", "Part": "*fp32"}
            | _i32("R", "p", "passes", "SH"),
            {"SH_P2": 256, "WIDE": False},
            1,
        ),
        "truncate_kept_blocks": (
            module._kept_blocks,
            logits | {"MinP": "*fp32"} | state | {"Blocks": "*fp32"} | _i32("V", "passes", "SHARE"),
            {"NB": 149} | narrow,
            4,
        ),
        "truncate_select": (
            module._truncated_select,
            logits
            | {"TopK": "*i64", "TopP": "*fp32", "MinP": "*fp32", "Seed": "*i64", "Step": "*i64"}
            | state
            | {"Blocks": "*fp32", "Tokens": "*fp32", "Logprobs": "*fp32"}
            | _i32("V", "passes"),
            {"NB": 149, "NB_P2": 256} | narrow,
            8,
        ),
    }


def memory_order(ptx: str) -> list[list]:
    """[operation, count] runs of the PTX's global loads and stores, barriers and PDL calls."""
    runs: list[list] = []
    for match in MEMORY_OPS.finditer(ptx):
        op = match.group(1)
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return runs


def resources(cubin: bytes, bin_dir: str) -> dict[str, int]:
    """Registers and local memory (bytes a thread: spills) that cuobjdump reads from the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [os.path.join(bin_dir, "cuobjdump"), "-res-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    found = dict(re.findall(r"\b(REG|LOCAL):(\d+)", out))
    return {"registers": int(found["REG"]), "local_bytes": int(found["LOCAL"])}


def compile_kernel(
    fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 3, *, arch: int
) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = signature | dict.fromkeys(constexprs, "constexpr")
    names = list(fn.arg_names)
    # pointers 16-byte aligned and integers multiples of 16, as Triton specializes the engine's
    # launches (its shapes and strides are)
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t[0] in "*i"}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps, "num_stages": num_stages}
    )
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return {"memory_order": memory_order(compiled.asm["ptx"]), **resources(compiled.asm["cubin"], bin_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--arch", type=int, default=90, help="the compute capability compiled for (90: Hopper)"
    )
    parser.add_argument("--kernels", help="comma-separated names (default: all)")
    args = parser.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while it is unset
    table = kernels()
    chosen = args.kernels.split(",") if args.kernels else list(table)
    result = {"arch": f"sm{args.arch}"}
    for name in chosen:
        result[name] = compile_kernel(*table[name], arch=args.arch)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
