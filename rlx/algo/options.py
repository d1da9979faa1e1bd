"""The option names the loss functions of `rlx.algo.losses` accept, without torch: composing and
validating a config (`rlx.algo.config`'s rules) must not import it, so that a typo on the command
line fails in the time Hydra takes, not torch's (2 s)."""

from __future__ import annotations

from typing import Literal, get_args

LossAgg = Literal["token_mean", "sample_mean", "seq_mean_token_sum_norm"]
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAgg)
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3", "low_var_kl")  # the keys of losses.KL_ESTIMATORS
TIS_LEVELS = ("token", "sequence", "geometric")  # algo.tis_level
TIS_MODES = ("truncate", "mask")  # algo.tis_mode
