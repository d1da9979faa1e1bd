"""rlx.colocation.GpuTurns: the order of a colocated hand-over's calls (slime's order) and the time
each part took, against fakes that record the calls and take a known time each."""

from __future__ import annotations

import time

import pytest

from rlx.colocation import GpuTurns

PAUSE = {
    "release": 0.03,
    "onload": 0.05,
    "resume weights": 0.02,
    "sync": 0.04,
    "offload state": 0.07,
    "offload": 0.06,
    "resume kv": 0.01,
}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.took: dict[str, float] = {}  # each call's own seconds (a loaded machine oversleeps)

    def did(self, call: str) -> None:
        self.calls.append(call)
        start = time.perf_counter()
        time.sleep(PAUSE[call])
        self.took[call] = time.perf_counter() - start


class FakePool:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def release_memory(self, tags=None) -> None:
        assert tags is None  # everything: weights and KV cache
        self.recorder.did("release")

    def resume_memory(self, tags=None) -> None:
        self.recorder.did({("weights",): "resume weights", ("kv_cache",): "resume kv"}[tuple(tags)])


class FakeTrainer:
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.moved_state: list[tuple[bool, bool]] = []

    def onload(self) -> dict[str, float]:
        self.recorder.did("onload")
        return {"colocate/before_onload_device_used_gib": 4.0}

    def offload(self, move_state: bool, keep_params: bool = False) -> dict[str, float]:
        self.moved_state.append((move_state, keep_params))
        self.recorder.did("offload state" if keep_params else "offload")
        return {"colocate/trainer_offloaded_process_reserved_gib": 0.5 if keep_params else 0.1}


def turns(
    colocated: bool, offload_trainer: bool = True, release_memory: bool = True
) -> tuple[GpuTurns, Recorder]:
    recorder = Recorder()
    gpu_turns = GpuTurns(colocated, FakeTrainer(recorder), offload_trainer, release_memory)
    gpu_turns.pool = FakePool(recorder)
    return gpu_turns, recorder


@pytest.mark.parametrize("offload_trainer", [True, False])
def test_colocated_hand_overs_run_in_order_and_time_each_part(offload_trainer):
    gpu_turns, recorder = turns(colocated=True, offload_trainer=offload_trainer)
    gpu_turns.before_engines_start()
    recorder.calls.clear()
    to_trainer = gpu_turns.to_trainer()

    def sync(version: int) -> float:
        assert version == 3
        recorder.did("sync")
        return 0.04

    to_engines = gpu_turns.publish(sync, 3)
    # the trainer's gradients and optimizer state leave before the engines' weights come back, its
    # weights (which the sync reads) after the sync
    assert recorder.calls == [
        "release", "onload", "offload state", "resume weights", "sync", "offload", "resume kv"
    ]  # fmt: skip
    assert gpu_turns.trainer.moved_state == [  # cluster.offload_trainer
        (offload_trainer, False),  # before the engines start
        (offload_trainer, True),
        (offload_trainer, False),
    ]
    assert to_trainer["colocate/before_onload_device_used_gib"] == 4.0
    assert to_engines["colocate/trainer_offloaded_process_reserved_gib"] == 0.1
    parts = {
        "time/colocate/engines_release_s": "release",
        "time/colocate/trainer_onload_s": "onload",
        "time/colocate/trainer_offload_state_s": "offload state",
        "time/colocate/engines_resume_weights_s": "resume weights",
        "time/colocate/trainer_offload_s": "offload",
        "time/colocate/engines_resume_kv_cache_s": "resume kv",
    }
    timed = to_trainer | to_engines
    for key, call in parts.items():  # its own call's time (measured: sleeps overshoot under load), no other's
        assert recorder.took[call] <= timed[key] < recorder.took[call] + 0.02, key
    assert to_engines["time/weight_sync_s"] == 0.04
    # each turn's whole is its parts (the sync included in the second), to the clock's resolution
    assert to_trainer["time/colocate_to_trainer_s"] == pytest.approx(
        timed["time/colocate/engines_release_s"] + timed["time/colocate/trainer_onload_s"], abs=1e-3
    )
    engines_parts = sum(timed[k] for k in list(parts)[2:])
    assert engines_parts + PAUSE["sync"] <= to_engines["time/colocate_to_engines_s"] < engines_parts + 0.06


def test_nothing_released_means_no_turns_the_weight_sync_alone():
    """cluster.release_memory=false with the trainer's state kept: trainer and engines stay
    resident, so no side releases, offloads, onloads or resumes anything; a hand-over is the
    weight sync alone, as under split placement."""
    gpu_turns, recorder = turns(colocated=True, offload_trainer=False, release_memory=False)
    assert gpu_turns.before_engines_start() == {} and gpu_turns.to_trainer() == {}
    assert gpu_turns.publish(lambda version: recorder.did("sync") or 0.04, 1) == {"time/weight_sync_s": 0.04}
    assert recorder.calls == ["sync"] and gpu_turns.trainer.moved_state == []
    # an offloaded state makes turns whatever release_memory says (the config refuses the pair)
    gpu_turns, recorder = turns(colocated=True, offload_trainer=True, release_memory=False)
    gpu_turns.before_engines_start()
    gpu_turns.to_trainer()
    assert gpu_turns.trainer.moved_state == [(True, False)] and recorder.calls[-2:] == ["release", "onload"]


def test_split_placement_hands_nothing_over():
    gpu_turns, recorder = turns(colocated=False)
    assert gpu_turns.to_trainer() == {}
    assert gpu_turns.publish(lambda version: 0.5, 1) == {"time/weight_sync_s": 0.5}
    assert recorder.calls == []
