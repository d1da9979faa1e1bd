"""The `train.lora` section's schema: low-rank adapters on the policy's linear layers.

LoRA (Hu et al., 2021) freezes the base weights and learns, beside each targeted linear layer
W, a low-rank update: y = W x + (alpha / rank) * B A x, A [rank, in], B [out, rank], B = 0 at
the start (the policy starts as the base model). Only A and B get gradients, optimizer state and
checkpoint space; the engines receive W + (alpha / rank) B A (`rlx.lora.adapter.merged_weight`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlx.config.rules import POSITIVE, UNIT_OPEN_HIGH, Rule

# target_modules' word for every tensor-parallel linear layer of the decoder (PEFT's spelling):
# attention's projections and the MLP's, whatever the family names them (`ModelFamily.lora_modules`)
ALL_LINEAR = "all-linear"


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy (null rank: full fine-tuning)."""

    rank: int | None = None  # the adapters' rank r; null: no LoRA, every weight trains
    alpha: float = 16.0  # the update is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapter's input (PEFT's lora_dropout)
    # Megatron's names of the decoder's linear layers to adapt (linear_qkv, linear_proj, linear_fc1,
    # linear_fc2; MLA: linear_q_proj or linear_q_up_proj, linear_kv_up_proj), or all-linear
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    # MoE: adapt each routed expert's linear_fc1 / linear_fc2 too (one adapter per expert); the
    # shared experts and dense layers follow target_modules either way
    experts: bool = False

    RULES: ClassVar[dict[str, Rule]] = {
        "rank": Rule(">= 1, or null to train every weight without LoRA", lambda v: v >= 1),
        "alpha": POSITIVE,
        "dropout": UNIT_OPEN_HIGH,
    }

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of the low-rank update."""
        return self.alpha / self.rank
