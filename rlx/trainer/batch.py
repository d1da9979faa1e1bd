"""Turning samples into micro-batch tensors for the trainer: padded rows, or packed.

Shapes: B samples, R rows of L tokens (right-padded), T response tokens (right-padded).
Padded (`make_micro_batch`): one sample per row (R = B); right padding keeps causal attention
exact for the real tokens, so no attention mask is needed. Packed (`make_packed_micro_batch`):
the samples end to end in one row (R = 1) with a block-diagonal causal mask, so no token sees
another sample's; `pack` chooses which samples share a row under a token budget.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from rlx.flat import flat_tensor, pad_2d
from rlx.sample import Sample


def pad_multiple(tp: int, cp: int) -> int:
    """What every micro-batch's sequence length is padded to a multiple of: TP (sequence
    parallelism splits it over TP ranks), and with CP > 1, 2 × CP chunks each a multiple of it."""
    return tp if cp == 1 else 2 * cp * tp


@dataclass
class MicroBatch:
    """One micro-batch; response tensors are aligned so column t is response token t.

    The token tensors hold R rows (named `_BL` for the padded case, where R = B); sample b
    starts at column `start_B[b]` of row `row_B[b]`.
    """

    tokens_BL: torch.Tensor  # [R, L] prompt + response ids, right-padded with 0
    position_ids_BL: torch.Tensor  # [R, L] each sample's own positions from 0
    prompt_len_B: torch.Tensor
    response_len_B: torch.Tensor
    mask_BT: torch.Tensor  # float: 1 for response tokens that count in the loss
    extras: dict[str, torch.Tensor]  # per-token fields [B, T], e.g. adv, rollout_logp, old_logp
    # Counts of the whole global batch this micro-batch belongs to (all its micro-batches on all
    # DP ranks), by which losses normalise; 0 in forward-only micro-batches.
    num_global_tokens: int = 0  # loss tokens
    num_global_samples: int = 0
    row_B: torch.Tensor | None = None  # None: sample b is row b
    start_B: torch.Tensor | None = None  # None: every sample starts at column 0
    # [R, 1, L, L] True where attention is forbidden (megatron's convention); None: causal
    attention_mask_B1LL: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return self.response_len_B.shape[0]

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch on `device` (the model's)."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if f.name.endswith(("_BL", "_B", "_BT", "_B1LL")) and getattr(self, f.name) is not None
        }
        return replace(self, **moved, extras={k: v.to(device) for k, v in self.extras.items()})


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


def make_packed_micro_batch(
    samples: list[Sample],
    extras: dict[str, list],
    pad_multiple: int = 1,
    *,
    num_global_tokens: int = 0,
    num_global_samples: int = 0,
) -> MicroBatch:
    """`samples` end to end in one row (right-padded to a multiple of `pad_multiple`), each with
    its own positions from 0 and a block-diagonal causal attention mask: every real token sees
    exactly the tokens it sees in `make_micro_batch` (RoPE depends only on the distance between
    positions, so the sample's logits match up to floating-point rounding). Response tensors
    and `extras` are per sample, as there. A row of one sample (a long response fills the token
    budget alone) needs no mask: causal attention is its own, and the padding after it is seen by
    no real token; without one SDPA takes its flash kernel, not the masked one, and no L x L mask
    is built (67 MB of bools at 8k tokens)."""
    lengths = torch.tensor([len(s.prompt_ids) + s.response_len for s in samples])
    total = int(lengths.sum())
    width_L = -(-total // pad_multiple) * pad_multiple
    starts = lengths.cumsum(0) - lengths
    tokens_L = torch.zeros(width_L, dtype=torch.long)
    positions_L = torch.zeros(width_L, dtype=torch.long)
    # segment of each column: its sample, or len(samples) for the padding after the last one
    segment_L = torch.full((width_L,), len(samples))
    tokens_L[:total] = flat_tensor((s.tokens for s in samples), torch.long)
    segment_L[:total] = torch.repeat_interleave(torch.arange(len(samples)), lengths)
    positions_L[:total] = torch.arange(total) - starts[segment_L[:total]]  # each sample's own, from 0
    if len(samples) == 1:
        mask_B1LL = None
    else:
        causal_LL = torch.ones(width_L, width_L, dtype=torch.bool).tril()
        allowed_LL = causal_LL & (segment_L.unsqueeze(0) == segment_L.unsqueeze(1))
        mask_B1LL = ~allowed_LL.view(1, 1, width_L, width_L)
    padded = make_micro_batch(
        samples, extras, num_global_tokens=num_global_tokens, num_global_samples=num_global_samples
    )
    return replace(
        padded,
        tokens_BL=tokens_L.unsqueeze(0),
        position_ids_BL=positions_L.unsqueeze(0),
        row_B=torch.zeros(len(samples), dtype=torch.long),
        start_B=starts,
        attention_mask_B1LL=mask_B1LL,
    )


def widen(mb: MicroBatch, width_L: int) -> MicroBatch:
    """`mb` (padded, not packed) right-padded to `width_L` columns: the same outputs for its real
    tokens. Megatron's interleaved schedule needs every micro-batch of a call in one shape."""
    if mb.attention_mask_B1LL is not None:
        raise ValueError("a packed micro-batch cannot be widened")
    extra = width_L - mb.tokens_BL.shape[1]
    if extra <= 0:
        return mb
    num_rows, device = mb.tokens_BL.shape[0], mb.tokens_BL.device
    positions_BL = torch.arange(width_L, device=device).expand(num_rows, -1).contiguous()
    tokens_BL = torch.cat([mb.tokens_BL, mb.tokens_BL.new_zeros(num_rows, extra)], dim=1)
    return replace(mb, tokens_BL=tokens_BL, position_ids_BL=positions_BL)


def response_slice(values_BL: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Gather per-position values predicting each response token: [R, L-1] -> [B, T].

    Position p's output predicts token p + 1, so response token t (at position
    start + prompt_len + t of its row) is predicted at start + prompt_len + t - 1. Columns past
    a sample's response are clamped into its row (masked out of every loss).
    """
    width_T = mb.mask_BT.shape[1]
    device = values_BL.device
    offsets_1T = torch.arange(width_T, device=device).unsqueeze(0)
    first_B = mb.prompt_len_B.to(device) - 1
    if mb.start_B is not None:
        first_B = first_B + mb.start_B.to(device)
    index_BT = (first_B.unsqueeze(1) + offsets_1T).clamp(max=values_BL.shape[1] - 1)
    rows_BL = values_BL if mb.row_B is None else values_BL[mb.row_B.to(device)]
    return rows_BL.gather(1, index_BT)


def split(items: list, size: int) -> list[list]:
    """Consecutive chunks of `size` (the last may be shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def pack(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of `lengths` in bins of at most `budget` tokens each: first-fit decreasing.

    Longest first (ties by index), each into the first bin it fits, else a new bin; each bin's
    indices ascending. Deterministic: every pipeline stage and every run packs alike.
    Raises ValueError naming the first item longer than `budget`.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > budget:
            raise ValueError(f"item {i} has {lengths[i]} tokens, more than the budget of {budget}")
        fit = next((b for b, free in enumerate(room) if lengths[i] <= free), None)
        if fit is None:
            bins.append([])
            room.append(budget)
            fit = len(bins) - 1
        bins[fit].append(i)
        room[fit] -= lengths[i]
    return [sorted(b) for b in bins]


def num_tokens(sample: Sample) -> int:
    """Prompt + response tokens of `sample` (its length in a packed row)."""
    return len(sample.prompt_ids) + sample.response_len


def num_loss_tokens(sample: Sample) -> int:
    """Response tokens of `sample` that count in the loss."""
    return sum(sample.loss_mask) if sample.loss_mask else sample.response_len
