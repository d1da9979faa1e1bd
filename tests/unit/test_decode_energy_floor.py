"""bench/decode_energy.py's power floor: the step's parts at their cheapest, by hand."""

from __future__ import annotations

import pytest
from helpers import bench_module


@pytest.fixture(scope="module")
def decode_energy():
    return bench_module("decode_energy")


def rows():
    return [
        {"part": "gemm_qkv", "algo": "torch", "mJ": 200.0, "power_limit_w": 700.0},
        {"part": "gemm_qkv", "algo": "lt1", "mJ": 190.0},
        {"part": "gemm_lm_head", "algo": "torch", "mJ": 180.0},
        {"part": "gemm_lm_head", "algo": "lt0", "mJ": None},  # no counter: not counted
        {"part": "attention", "launch": "rule", "context": 512, "mJ": 2560.0},
        {"part": "kv_read", "how": "streamed", "context": 512, "mJ": 2304.0},
        {"part": "kv_read", "how": "paged", "context": 512, "mJ": 2400.0},
    ]


def test_floor_by_hand(decode_energy):
    step = {"context": 496, "ms": 5.6, "roofline_ms": 3.75}
    got = decode_energy.power_floor(rows(), step)
    # attention: the streamed read's 2304 mJ at 512 tokens, scaled to 496: 2304 * 496 / 512 = 2232
    assert got["floor_mJ_by_part"] == {"gemm_qkv": 190.0, "gemm_lm_head": 180.0, "attention": 2232.0}
    assert got["floor_mJ"] == 2602.0  # 190 + 180 + 2232
    assert got["power_limit_w"] == 700.0
    assert got["floor_ms"] == pytest.approx(3.7171, abs=1e-4)  # 2602 mJ / 700 W
    assert got["best_fraction"] == pytest.approx(1.0088, abs=1e-4)  # 3.75 ms / 3.7171 ms
    assert got["engine_fraction"] == pytest.approx(0.6696, abs=1e-4)  # 3.75 / 5.6


def test_no_floor_without_a_limit_or_an_attention(decode_energy):
    step = {"context": 496, "ms": 5.6, "roofline_ms": 3.75}
    no_limit = [dict(r, power_limit_w=None) for r in rows()]
    assert decode_energy.power_floor(no_limit, step) is None
    no_attention = [r for r in rows() if r["part"] not in ("attention", "kv_read")]
    assert decode_energy.power_floor(no_attention, step) is None
    # the step's own limit counts where the parts' logs had none
    assert decode_energy.power_floor(no_limit, dict(step, power_limit_w=650.0))["power_limit_w"] == 650.0
