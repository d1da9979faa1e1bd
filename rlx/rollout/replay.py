"""`debug.train_only`: batches read back from a run's rollout dumps instead of generated, so the
trainer can be tested alone and a bad step replayed (`debug.load_rollouts=RUN_DIR`)."""

from __future__ import annotations

import json
from pathlib import Path

from rlx.errors import ConfigError
from rlx.sample import Sample


def rollouts_dir(path: str) -> Path:
    """The `rollouts/` directory of a run directory (or the directory itself)."""
    root = Path(path).expanduser().resolve()
    return root / "rollouts" if (root / "rollouts").is_dir() else root


class DumpReplay:
    """Step k's batch is `rollouts/step_k.jsonl` of the dumped run, as it was trained on."""

    def __init__(self, path: str):
        self.dir = rollouts_dir(path)

    def batch(self, step: int, train_version: int) -> tuple[list[Sample], dict[str, float]]:
        file = self.dir / f"step_{step:06d}.jsonl"
        if not file.is_file():
            raise ConfigError(
                f"debug.load_rollouts: {file} does not exist (the dumped run has no step {step}); "
                "set run.num_rollout to at most the number of dumped steps"
            )
        samples = [Sample.from_json(json.loads(line)) for line in file.read_text().splitlines()]
        n = max(len(samples), 1)
        return samples, {
            "rollout/reward_mean": sum(s.reward or 0.0 for s in samples) / n,
            "rollout/response_len_mean": sum(s.response_len for s in samples) / n,
        }

    def published(self, version: int) -> None:
        pass

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"ready": [], "carried": [], "groups_in": 0}

    def load_state_dict(self, state: dict) -> None:
        pass
