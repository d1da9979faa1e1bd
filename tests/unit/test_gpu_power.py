"""bench/gpu_power.py: nvidia-smi's samples read and summed by hand-computed values; the log
run end to end against a stand-in `nvidia-smi` on PATH; empty where there is none."""

from __future__ import annotations

import os
import time

import pytest
from helpers import bench_module

# three samples as `nvidia-smi --format=csv,noheader,nounits` prints them, a fourth cut short
SAMPLES = """1980, 652.10, 700.00, 44, Not Active, Not Active, Not Active
1365, 701.30, 700.00, 48, Active, Not Active, Not Active
1830, 695.60, 700.00, 51, Active, Active, Not Active
1830, 69"""


@pytest.fixture(scope="module")
def gpu_power():
    return bench_module("gpu_power")


def test_samples_are_parsed_and_a_cut_line_skipped(gpu_power):
    rows = gpu_power.parse(SAMPLES + "\n[N/A], [N/A], 700.00, 40, Active, Not Active, Not Active")
    assert [r["mhz"] for r in rows] == [1980, 1365, 1830]
    assert [r["capped"] for r in rows] == [False, True, True]
    assert [r["slowed"] for r in rows] == [False, False, True]


def test_summary_by_hand(gpu_power):
    got = gpu_power.summarize(gpu_power.parse(SAMPLES), seconds=2.0)
    # (1980 + 1365 + 1830) / 3 = 1725; (652.1 + 701.3 + 695.6) / 3 = 683.0; x 2 s = 1366 J
    assert got == {
        "samples": 3,
        "sm_mhz_mean": 1725,
        "sm_mhz_min": 1365,
        "power_w_mean": 683.0,
        "power_limit_w": 700.0,
        "at_power_cap": 0.67,
        "slowed_by_heat": 0.33,
        "temperature_c_max": 51,
        "energy_j": 1366.0,
        "power_w_from_energy": None,
        "energy_from": "power x time",
    }
    counted = gpu_power.summarize(gpu_power.parse(SAMPLES), seconds=2.0, joules=1290.5)
    assert counted["energy_j"] == 1290.5 and counted["energy_from"] == "counter"
    assert counted["power_w_from_energy"] == 645.2  # 1290.5 J / 2 s, rounded
    assert gpu_power.summarize([], 1.0) == {}


def test_the_log_runs_a_stand_in_nvidia_smi(gpu_power, tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    body = "".join(f"echo '{line}'\n" for line in SAMPLES.splitlines()[:3])
    smi.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\n{body}exec sleep 60\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gpu_power, "energy_counter", lambda device: None)  # as on a machine without NVML
    with gpu_power.PowerLog(interval_ms=20) as power:
        deadline = time.time() + 10
        while not (tmp_path / "args").exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    got = power.summary()
    assert got["samples"] == 3 and got["sm_mhz_mean"] == 1725 and got["at_power_cap"] == 0.67
    assert got["energy_j"] == pytest.approx(683.0 * power.seconds, abs=0.01)
    assert got["energy_from"] == "power x time"
    assert "-lms 20" in (tmp_path / "args").read_text()


def test_no_nvidia_smi_no_summary(gpu_power, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with gpu_power.PowerLog() as power:
        pass
    assert power.summary() == {}
