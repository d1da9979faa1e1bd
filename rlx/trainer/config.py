"""The `train` section's schema: how the trainer optimises the policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlx.config.rules import AT_LEAST_1, NON_NEGATIVE, POSITIVE, UNIT_OPEN_HIGH, Rule, one_of
from rlx.lora.config import LoRAConfig

# train.precision -> the torch dtype (by name) the trainer builds its models in
PRECISION_DTYPES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
LR_DECAY_STYLES = ("constant", "cosine")  # rlx.trainer.schedule.lr_factor
OLD_LOGPROBS = ("auto", "recompute")  # train.old_logprobs
# train.recompute -> megatron TransformerConfig settings: activations recomputed in the backward
# pass instead of kept (full: every layer's input only; selective: core attention's internals)
RECOMPUTE: dict[str, dict] = {
    "none": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
}


@dataclass
class TrainConfig:
    """Optimisation of the policy."""

    global_batch_size: int = 256  # samples per optimizer step
    micro_batch_size: int = 64  # samples per forward/backward (unused when packing)
    # sequence packing: each micro-batch is one row of samples end to end, at most this many
    # prompt + response tokens (first-fit decreasing), so short samples do not pay for padding
    # to the longest one; null: micro_batch_size samples per micro-batch, right-padded
    max_tokens_per_micro_batch: int | None = None
    # the forward-only passes (old and reference log-probs, the critic's values) keep no
    # activations for a backward, so they can take larger micro-batches (fewer kernel launches,
    # larger matmuls); null: the training micro-batch (samples, or with packing, tokens)
    logprob_micro_batch_size: int | None = None
    logprob_max_tokens_per_micro_batch: int | None = None  # packing only
    num_steps_per_rollout: int = 1  # optimizer steps per rollout batch
    # The old policy's log-probs (the PPO ratio's denominator, the proximal policy of the
    # decoupled objective): recompute runs a forward-only pass over the batch before training;
    # auto skips it where the training pass gives the same numbers, i.e. one optimizer step per
    # rollout (the weights have not moved when each micro-batch's forward runs), an algorithm
    # whose advantages do not read them (no KL in the reward) and engine log-probs on every
    # sample (for train/logprob_abs_diff): the training forward's log-probs, detached, are then
    # the old policy's, and the pass (a third of a trainer call) is saved.
    old_logprobs: str = "auto"
    # peak learning rate (PPO's critic uses algo.critic_lr on the same schedule); the default suits a
    # pretrained model (verl's and slime's); the toy tasks' random tiny models take 2e-3 (conf/data/toy_*)
    lr: float = 1e-6
    # learning-rate schedule over the run's optimizer steps (run.num_rollout x num_steps_per_rollout):
    lr_warmup_steps: int = 0  # linear warmup: optimizer step k (from 0) uses lr * (k + 1) / lr_warmup_steps
    lr_decay: str = "constant"  # after warmup: constant at lr, or cosine from lr down to min_lr at the end
    min_lr: float = 0.0  # where the cosine decay ends
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # gradient-norm clipping (0: off)
    # fp32 | bf16 | fp16: bf16/fp16 run the models in megatron's Float16Module with fp32 master
    # weights in the optimizer
    precision: str = "fp32"
    recompute: str = "none"  # none | full | selective: activation recompute, memory for compute
    # shard the optimizer state (fp32 master weights, Adam moments) over data-parallel ranks
    distributed_optimizer: bool = False
    # torch's fused Adam (megatron builds torch's Adam without TE or apex): one kernel over all
    # tensors, reading each state tensor once, no temporaries (the way TE's and apex's FusedAdam
    # step). false: torch's unfused Adam, as `adam_foreach` says.
    adam_fused: bool = True
    # with adam_fused=false, on GPUs: true, torch's multi-tensor step, whose fp32 sqrt(v) temporary
    # is as large as a third of the optimizer state (12 GiB a rank for a 30B-A3B slice); false, one
    # tensor at a time (a temporary of the largest tensor; more kernel launches), the same
    # arithmetic. On CPU torch's unfused Adam steps one tensor at a time either way.
    adam_foreach: bool = True
    # low-rank adapters on the policy, its base weights frozen (rlx.lora); off unless lora.rank is set
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    RULES: ClassVar[dict[str, Rule]] = {
        "global_batch_size": AT_LEAST_1,
        "micro_batch_size": AT_LEAST_1,
        "max_tokens_per_micro_batch": AT_LEAST_1,
        "logprob_micro_batch_size": AT_LEAST_1,
        "logprob_max_tokens_per_micro_batch": AT_LEAST_1,
        "num_steps_per_rollout": AT_LEAST_1,
        "old_logprobs": one_of(OLD_LOGPROBS),
        "lr": POSITIVE,
        "lr_warmup_steps": NON_NEGATIVE,
        "lr_decay": one_of(LR_DECAY_STYLES),
        "min_lr": NON_NEGATIVE,
        "weight_decay": NON_NEGATIVE,
        "adam_beta1": UNIT_OPEN_HIGH,
        "adam_beta2": UNIT_OPEN_HIGH,
        "adam_eps": POSITIVE,
        "clip_grad": NON_NEGATIVE,
        "precision": one_of(PRECISION_DTYPES),
        "recompute": one_of(RECOMPUTE),
    }
