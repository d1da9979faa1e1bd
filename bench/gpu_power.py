"""The GPU's clocks and power while a bench runs, sampled by `nvidia-smi` (no added dependency).

A decode step at 256 rows of the Qwen3-1.7B shape on an H200 draws the GPU's 700 W limit: the
driver then lowers the SM clock (to 1.35-1.9 GHz from 1.98), and the figure a bench prints
depends on how long it ran, how warm the GPU was and the machine. Benches that time the
engine print this summary beside their figures (`PowerLog`), so that a figure says whether it
was measured at the power cap:

    with PowerLog() as power:
        ...  # the timed work
    entry["gpu_power"] = power.summary()

The energy is NVML's counter (`libnvidia-ml`, which comes with the driver, read through ctypes)
where it answers, else the mean sampled power times the time. Without `nvidia-smi` (CPU
machines) the summary is empty.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
import time

FIELDS = (
    "clocks.sm",
    "power.draw",
    "enforced.power.limit",
    "temperature.gpu",
    "clocks_throttle_reasons.sw_power_cap",
    "clocks_throttle_reasons.sw_thermal_slowdown",
    "clocks_throttle_reasons.hw_slowdown",
)


def parse(text: str) -> list[dict]:
    """Rows of `nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits` output; a line that
    does not parse (a truncated last line, "[N/A]") is skipped."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(FIELDS):
            continue
        try:
            mhz, watts, limit, temp = (float(c) for c in cells[:4])
        except ValueError:
            continue
        capped, thermal, hw = (c.lower() == "active" for c in cells[4:])
        rows.append({"mhz": mhz, "w": watts, "limit_w": limit, "temp_c": temp, "capped": capped,
                     "slowed": thermal or hw})  # fmt: skip
    return rows


def summarize(rows: list[dict], seconds: float, joules: float | None = None) -> dict:
    """Means over the samples: the SM clock (and its lowest), the power draw against the limit,
    the share of samples at the power cap or slowed down by heat, and the energy: `joules` (a
    counter's) where given, else the mean power x `seconds`. `power.draw` is the driver's
    average over its last second (H100/H200): over a loop of a few seconds after idle it lags,
    and the counter's joules / `seconds` is the true mean."""
    if not rows:
        return {}
    n = len(rows)
    mean_w = sum(r["w"] for r in rows) / n
    return {
        "samples": n,
        "sm_mhz_mean": round(sum(r["mhz"] for r in rows) / n),
        "sm_mhz_min": round(min(r["mhz"] for r in rows)),
        "power_w_mean": round(mean_w, 1),
        "power_limit_w": round(max(r["limit_w"] for r in rows), 1),
        "at_power_cap": round(sum(r["capped"] for r in rows) / n, 2),
        "slowed_by_heat": round(sum(r["slowed"] for r in rows) / n, 2),
        "temperature_c_max": round(max(r["temp_c"] for r in rows)),
        "energy_j": round(mean_w * seconds if joules is None else joules, 2),
        "power_w_from_energy": None if joules is None or seconds <= 0 else round(joules / seconds, 1),
        "energy_from": "power x time" if joules is None else "counter",
    }


def energy_counter(device: str | None):
    """A function giving NVML's energy counter of `device` (a "GPU-..." UUID; None: the first
    GPU) in joules, or None where NVML does not answer (no driver, a GPU older than Volta)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    handle = ctypes.c_void_p()
    if nvml.nvmlInit_v2() != 0:
        return None
    if device:
        found = nvml.nvmlDeviceGetHandleByUUID(device.encode(), ctypes.byref(handle))
    else:
        found = nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle))
    millijoules = ctypes.c_ulonglong()

    def read() -> float | None:
        ok = nvml.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(millijoules)) == 0
        return millijoules.value / 1e3 if ok else None

    return read if found == 0 and read() is not None else None


def _device_id() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    except Exception:  # an older torch without uuid: the first GPU
        pass
    return None


class PowerLog:
    """Samples the GPU every `interval_ms` while the `with` block runs (module docstring)."""

    def __init__(self, interval_ms: int = 50):
        self.interval_ms = interval_ms
        self.rows: list[dict] = []
        self.seconds = 0.0
        self._proc = self._energy = None
        self.joules: float | None = None

    def __enter__(self) -> PowerLog:
        smi = shutil.which("nvidia-smi")
        if smi:
            self._out = tempfile.TemporaryFile(mode="w+")
            device = _device_id()
            self._energy = energy_counter(device)
            self._joules0 = self._energy() if self._energy else None
            cmd = [smi, f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                   "-lms", str(self.interval_ms)] + (["-i", device] if device else [])  # fmt: skip
            self._proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.DEVNULL)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._start
        if self._proc is None:
            return
        if self._energy and self._joules0 is not None:
            end = self._energy()
            self.joules = None if end is None else end - self._joules0
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._out.seek(0)
        self.rows = parse(self._out.read())
        self._out.close()

    def summary(self) -> dict:
        return summarize(self.rows, self.seconds, self.joules)
