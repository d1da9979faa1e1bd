"""Where a run's numbers go: metrics.jsonl, TensorBoard, the console, rollout dumps."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlx.sample import Sample

# Shown on the console line each step: (metric key, label, format).
_CONSOLE = [
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/response_len_mean", "len", "{:.1f}"),
    ("train/loss", "loss", "{:+.4f}"),
    ("train/logprob_abs_diff", "lp_gap", "{:.1e}"),
    ("time/rollout_s", "rollout", "{:.2f}s"),
    ("time/train_s", "train", "{:.2f}s"),
    ("time/weight_sync_s", "sync", "{:.2f}s"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
]


class Tracker:
    """Writes one record per step to every sink; `close()` flushes them."""

    def __init__(self, output_dir: str | Path, *, tensorboard: bool = True, dump_rollouts: bool = True):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(
            self.dir / "metrics.jsonl", "a", buffering=1
        )  # line-buffered: a crash loses no step
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))
        self.dump_rollouts = dump_rollouts

    def log(self, step: int, metrics: dict[str, float]) -> str:
        """Record `metrics` for `step`; return the console line."""
        self._jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        parts = [f"{label} {fmt.format(metrics[k])}" for k, label, fmt in _CONSOLE if k in metrics]
        return f"step {step:>4} | " + " | ".join(parts)

    def write_rollouts(self, step: int, samples: list[Sample]) -> None:
        if not self.dump_rollouts:
            return
        path = self.dir / "rollouts" / f"step_{step:06d}.jsonl"
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for s in samples:
                f.write(json.dumps(s.to_json()) + "\n")
        tmp.replace(path)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
