"""torch.profiler around one trainer call (`debug.profile_train_steps`), and its op table.

Each profiled step leaves, per rank, in `<run dir>/profile/`:
- `step_NNNNNN_rank_R.<time>.pt.trace.json`: the timeline (CPU ops, CUDA kernels,
  memory copies), written by torch's TensorBoard trace handler; open it at https://ui.perfetto.dev
  (or chrome://tracing);
- `step_NNNNNN_rank_R_ops.txt`: the ops and kernels taking the most time, device time on a GPU
  (self time: a kernel counted once), CPU time otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

TOP_OPS = 40


def op_table(prof, num_rows: int = TOP_OPS) -> str:
    """Where the time went. With a GPU: the `num_rows` kernels with the most device time, then the
    ops that launched the most device time (inclusive: an op's children count in it too).
    Without: the ops with the most self CPU time. Each row: share, milliseconds, calls, name."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    if not kernels:
        return _table(events, lambda e: e.self_cpu_time_total, "CPU self time", num_rows)
    launchers = [e for e in events if e.device_type == DeviceType.CPU and e.device_time_total > 0]
    total_us = sum(e.self_device_time_total for e in kernels)
    return "\n".join(
        [
            _table(kernels, lambda e: e.self_device_time_total, "GPU kernel time", num_rows),
            _table(
                launchers,
                lambda e: e.device_time_total,
                "GPU time by the op that launched it",
                num_rows // 2,
                total_us,
            ),
        ]
    )


def _table(events, time_us, title: str, num_rows: int, total_us: float | None = None) -> str:
    timed = [e for e in events if time_us(e) > 0]
    total_us = total_us or sum(time_us(e) for e in timed)
    lines = [f"{title}: {total_us / 1e6:.3f} s in {len(timed)} entries; the {num_rows} largest:"]
    for e in sorted(timed, key=lambda e: -time_us(e))[:num_rows]:
        lines.append(
            f"  {time_us(e) / total_us:6.1%} {time_us(e) / 1e3:10.1f} ms {e.count:7d}x  {e.key[:120]}"
        )
    return "\n".join(lines)


@contextmanager
def profiled(profile_dir: Path, name: str) -> Iterator[None]:
    """Run the body under torch.profiler (CPU, and CUDA where there is a GPU); write its trace and
    op table as `profile_dir/name*` (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

    profile_dir.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(
        activities=activities, on_trace_ready=tensorboard_trace_handler(str(profile_dir), worker_name=name)
    ) as prof:
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    (profile_dir / f"{name}_ops.txt").write_text(op_table(prof) + "\n")
