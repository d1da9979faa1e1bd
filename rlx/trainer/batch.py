"""Turning samples into padded micro-batch tensors for the trainer.

Shapes: B samples, L prompt+response tokens (right-padded), T response tokens (right-padded).
Right padding keeps causal attention exact for the real tokens, so no attention mask is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from rlx.sample import Sample


@dataclass
class MicroBatch:
    """One micro-batch; response tensors are aligned so column t is response token t."""

    tokens_BL: torch.Tensor  # prompt + response ids, right-padded with 0
    position_ids_BL: torch.Tensor
    prompt_len_B: torch.Tensor
    response_len_B: torch.Tensor
    mask_BT: torch.Tensor  # float: 1 for response tokens that count in the loss
    extras: dict[str, torch.Tensor]  # per-token fields [B, T], e.g. adv, rollout_logp, old_logp
    # Counts of the whole global batch this micro-batch belongs to (all its micro-batches on all
    # DP ranks), by which losses normalise; 0 in forward-only micro-batches.
    num_global_tokens: int = 0  # loss tokens
    num_global_samples: int = 0

    @property
    def num_samples(self) -> int:
        return self.tokens_BL.shape[0]

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch on `device` (the model's)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if f.name.endswith(("_BL", "_B", "_BT"))
        }
        return replace(self, **moved, extras={k: v.to(device) for k, v in self.extras.items()})


def pad_2d(rows: list[list[float]] | list[torch.Tensor], width: int, dtype=torch.float32) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, row in enumerate(rows):
        row_t = torch.as_tensor(row, dtype=dtype)
        out[i, : len(row_t)] = row_t
    return out


def make_micro_batch(
    samples: list[Sample],
    extras: dict[str, list],
    pad_multiple: int = 1,
    *,
    num_global_tokens: int = 0,
    num_global_samples: int = 0,
) -> MicroBatch:
    """Pad `samples` (and per-sample per-token `extras`, aligned with samples) into tensors;
    the global batch's counts travel with it.

    The sequence width is rounded up to `pad_multiple` (sequence parallelism splits it over
    tensor-parallel ranks); right padding leaves the real tokens' outputs unchanged.
    """
    width_L = max(len(s.prompt_ids) + s.response_len for s in samples)
    width_L = -(-width_L // pad_multiple) * pad_multiple
    width_T = max(max(s.response_len for s in samples), 1)
    tokens_BL = pad_2d([s.tokens for s in samples], width_L, torch.long)
    masks = [s.loss_mask if s.loss_mask else [1] * s.response_len for s in samples]
    return MicroBatch(
        tokens_BL=tokens_BL,
        position_ids_BL=torch.arange(width_L).unsqueeze(0).expand_as(tokens_BL).contiguous(),
        prompt_len_B=torch.tensor([len(s.prompt_ids) for s in samples]),
        response_len_B=torch.tensor([s.response_len for s in samples]),
        mask_BT=pad_2d(masks, width_T),
        extras={k: pad_2d(v, width_T) for k, v in extras.items()},
        num_global_tokens=num_global_tokens,
        num_global_samples=num_global_samples,
    )


def response_slice(values_BL: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Gather per-position values predicting each response token: [B, L-1] -> [B, T].

    Position p's output predicts token p + 1, so response token t (at absolute position
    prompt_len + t) is predicted at prompt_len + t - 1.
    """
    width_T = mb.mask_BT.shape[1]
    offsets_1T = torch.arange(width_T, device=values_BL.device).unsqueeze(0)
    index_BT = (mb.prompt_len_B.to(values_BL.device).unsqueeze(1) - 1 + offsets_1T).clamp(
        max=values_BL.shape[1] - 1
    )
    return values_BL.gather(1, index_BT)


def split(items: list, size: int) -> list[list]:
    """Consecutive chunks of `size` (the last may be shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def num_loss_tokens(sample: Sample) -> int:
    """Response tokens of `sample` that count in the loss."""
    return sum(sample.loss_mask) if sample.loss_mask else sample.response_len
