"""The learning-rate schedule at chosen optimizer steps, worked out by hand."""

from __future__ import annotations

import math

import pytest

from rlx.trainer.config import TrainConfig
from rlx.trainer.schedule import lr_factor


def lrs(cfg: TrainConfig, total: int, steps: list[int]) -> list[float]:
    return [cfg.lr * lr_factor(k, cfg, total) for k in steps]


def test_constant_without_warmup_is_the_peak_everywhere():
    assert lrs(TrainConfig(lr=1e-3), 10, [0, 5, 9, 20]) == [1e-3] * 4


def test_linear_warmup_then_constant():
    # warmup 4: steps 0..3 use 1/4, 2/4, 3/4, 4/4 of the peak; the first step is not wasted at 0
    cfg = TrainConfig(lr=0.8, lr_warmup_steps=4)
    assert lrs(cfg, 10, [0, 1, 2, 3, 4, 9]) == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])


def test_cosine_decays_from_the_peak_to_min_lr_at_the_last_step():
    # warmup 2, total 12 steps: decay over steps 2..11 (9 intervals), lr = 0.1 + 0.9 * (1 + cos(pi * p)) / 2
    cfg = TrainConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=2, lr_decay="cosine")
    got = lrs(cfg, 12, [0, 1, 2, 5, 11, 30])
    # step 5: p = 3 / 9, cos(pi / 3) = 0.5 -> 0.1 + 0.9 * 0.75 = 0.775; step 11: p = 1 -> 0.1
    assert got == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.1, 0.1])
    # the midpoint of the decay (p = 1/2) is halfway between peak and floor
    mid = TrainConfig(lr=1.0, min_lr=0.0, lr_decay="cosine")
    assert lr_factor(5, mid, 11) == pytest.approx(0.5)
    assert lr_factor(1, mid, 11) == pytest.approx(0.1 * 0 + 0.5 * (1 + math.cos(math.pi * 0.1)))
