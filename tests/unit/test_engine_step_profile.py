"""bench/engine_step_profile.py's accounting of a decode step: kernels summed by part, and the
step's memory roofline. Its GPU profiling itself runs on a GPU only; the sums are checked here
on a kernel table it printed on an H200 (Qwen3-1.7B shape, batch 256)."""

from __future__ import annotations

import pytest
from helpers import bench_module

# `kernels` of `python3 bench/engine_step_profile.py --shape qwen3_1.7b --batch 256 --no-attention`
# on 1×H200, 2026-11-28 (its top 15 of 28 layers' kernels)
H200_TABLE = [
    (2.357, 28, "_paged_decode_kernel"),
    (0.561, 28, "nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_TNT"),
    (0.556, 56, "nvjet_sm90_tst_64x64_64x13_2x1_v_bz_TNT"),
    (0.293, 28, "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_TNT"),
    (0.208, 1, "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT"),
    (0.178, 1, "_sample_kernel"),
    (0.134, 57, "_add_rms_norm_kernel"),
    (0.104, 28, "_qk_norm_rope_store_kernel"),
    (0.07, 28, "_silu_mul_kernel"),
    (0.009, 3, "Memcpy HtoD (Pinned -> Device)"),
    (0.003, 2, "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::Tenso"),
]


@pytest.fixture(scope="module")
def profile():
    return bench_module("engine_step_profile")


def test_kernels_are_summed_by_part_with_the_lm_head_apart(profile):
    rows = [{"ms_per_step": ms, "calls": calls, "kernel": name} for ms, calls, name in H200_TABLE]
    assert profile.kernel_groups(rows, layers=28) == {
        "attention": 2.357,
        "gemm": 1.41,  # 0.561 + 0.556 + 0.293: qkv, o and gate_up, down (28 or 56 calls a step)
        "lm_head": 0.208,  # the one GEMM a step
        "sampler": 0.178,
        "norms": 0.134,
        "qk_norm_rope_store": 0.104,
        "swiglu": 0.07,
        "other": 0.012,  # the copies: 0.009 + 0.003
    }


def test_the_step_roofline_reads_every_weight_and_every_context_once(profile):
    # 4.8 GB of weights and 10 sequences of 100 tokens at 1,000 bytes of KV each, at 4.8 TB/s
    assert profile.step_roofline_ms(4_800_000_000, 1000, 10, 100, 4.8e12) == pytest.approx(4801 / 4800)
