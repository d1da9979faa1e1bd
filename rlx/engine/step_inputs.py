"""A scheduled batch turned into device tensors: token ids, positions, KV slots, attention
metadata, and which hidden rows give logits (sampled tokens and prompt logprobs).

Built on the host in one pass over the rows, moved with one copy per dtype. Nothing here waits for
the GPU (`upload`), so with the overlap schedule a step's inputs are built and its kernels queued
while the step before still runs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from rlx.engine.attention import AttentionMetadata
from rlx.engine.scheduler import ScheduledBatch
from rlx.engine.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [S] hidden rows whose logits give a next token
    sample_seqs: list[Sequence]
    prompt_rows: torch.Tensor | None = None  # [P] hidden rows predicting prompt tokens
    prompt_targets: torch.Tensor | None = None  # [P] the prompt token each predicts
    prompt_owners: list[Sequence] = field(default_factory=list)  # one per prompt row


def upload(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto `device` without waiting for the GPU: through pinned memory (torch's
    caching host allocator keeps the buffer until the copy has run) and a non-blocking copy. A
    blocking copy, or `torch.tensor(..., device=cuda)`, synchronizes the stream first."""
    if device.type != "cuda":
        return values
    return values.pin_memory().to(device, non_blocking=True)


def build_step_inputs(
    batch: ScheduledBatch,
    block_size: int,
    device: torch.device,
    use_decode_kernel: bool,
    flash_prefill: bool = False,
) -> StepInputs:
    """`flash_prefill` (attention.flash_prefill): the prefill rows' metadata for flash attention
    over unpadded rows, instead of the padded rows' index and mask."""
    ids, starts, tables, table_base = [], [], [], []
    sample_rows, sample_seqs = [], []
    prompt_rows, prompt_targets, prompt_owners = [], [], []
    for seq, num_new in zip(batch.seqs, batch.num_new, strict=True):
        start, end, offset = seq.num_computed, seq.num_computed + num_new, len(ids)
        ids.extend(seq.token_ids[start:end])
        starts.append(start)
        first_block = start // block_size  # the row's blocks, flat: its tokens' slots index them
        table_base.append(len(tables) - first_block)
        tables.extend(seq.block_table[first_block : (end - 1) // block_size + 1])
        if end == seq.num_tokens:
            sample_rows.append(offset + num_new - 1)
            sample_seqs.append(seq)
        if seq.wants_input_logprobs:
            first = max(start, seq.request.logprob_start_len + len(seq.input_logprobs) - 1)
            for p in range(first, min(end, seq.num_prompt - 1)):
                prompt_rows.append(offset + p - start)
                prompt_targets.append(seq.token_ids[p + 1])
                prompt_owners.append(seq)
    longs = upload(
        torch.from_numpy(_token_slots(ids, starts, batch.num_new, tables, table_base, block_size)), device
    )
    meta = AttentionMetadata(
        slot_block=longs[2],
        slot_offset=longs[3],
        num_decode=batch.num_decode,
        use_decode_kernel=use_decode_kernel,
    )
    _decode_metadata(meta, batch, block_size, device)
    _prefill_metadata(meta, batch, block_size, device, flash_prefill)
    rows = upload(torch.tensor(sample_rows, dtype=torch.int64), device)
    inputs = StepInputs(longs[0], longs[1], meta, rows, sample_seqs)
    if prompt_rows:
        inputs.prompt_rows, inputs.prompt_targets = upload(
            torch.tensor([prompt_rows, prompt_targets]), device
        )
        inputs.prompt_owners = prompt_owners
    return inputs


def _token_slots(ids, starts, num_new, tables, table_base, block_size: int) -> np.ndarray:
    """[ids, positions, cache blocks, offsets in them] of the step's tokens, int64 [4, T]: row r's
    tokens sit at positions starts[r] ... starts[r] + num_new[r] - 1, and its block for position
    p is tables[table_base[r] + p // block_size] (the rows' needed blocks, flat)."""
    counts = np.asarray(num_new, dtype=np.int64)
    out = np.empty((4, len(ids)), dtype=np.int64)
    out[0] = ids
    row_start = np.cumsum(counts) - counts  # each row's first token in the step
    out[1] = np.arange(len(ids)) + np.repeat(np.asarray(starts, dtype=np.int64) - row_start, counts)
    index = np.repeat(np.asarray(table_base, dtype=np.int64), counts) + out[1] // block_size
    out[2] = np.asarray(tables, dtype=np.int64)[index]
    out[3] = out[1] % block_size
    return out


def padded_tables(seqs: list[Sequence], num_blocks: list[int]) -> list[list[int]]:
    width = max(num_blocks)
    return [s.block_table[:n] + [0] * (width - n) for s, n in zip(seqs, num_blocks, strict=True)]


def _decode_metadata(meta: AttentionMetadata, batch: ScheduledBatch, block_size: int, device) -> None:
    if not batch.num_decode:
        return
    seqs = batch.seqs[: batch.num_decode]
    lens = [s.num_computed + 1 for s in seqs]
    tables = padded_tables(seqs, [-(-n // block_size) for n in lens])
    meta.decode_block_tables = upload(torch.tensor(tables, dtype=torch.int32), device)
    meta.decode_context_lens = upload(torch.tensor(lens, dtype=torch.int32), device)
    if not meta.use_decode_kernel:
        keys = torch.arange(len(tables[0]) * block_size, device=device)
        meta.decode_mask = (keys[None, :] < meta.decode_context_lens[:, None])[:, None, None, :]


def _prefill_metadata(
    meta: AttentionMetadata, batch: ScheduledBatch, block_size: int, device, flash: bool
) -> None:
    seqs, num_new = batch.seqs[batch.num_decode :], batch.num_new[batch.num_decode :]
    if not seqs:
        return
    starts = [s.num_computed for s in seqs]
    ends = [s + n for s, n in zip(starts, num_new, strict=True)]
    max_q = max(num_new)
    meta.prefill_max_q = max_q
    # CPU keeps the gather path: its numerics are what the CPU tests and golden runs recorded
    meta.prefill_fresh = device.type == "cuda" and not any(starts)
    if not (flash and meta.prefill_fresh):  # flash over the step's own K/V reads no table
        tables = padded_tables(seqs, [-(-e // block_size) for e in ends])
        meta.prefill_block_tables = upload(torch.tensor(tables, dtype=torch.int64), device)
    if flash:
        _flash_metadata(meta, num_new, ends, block_size, device)
        return
    counts = np.asarray(num_new, dtype=np.int64)  # row r's i-th query at r * max_q + i
    shift = np.arange(len(counts), dtype=np.int64) * max_q - (np.cumsum(counts) - counts)
    q_index = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(shift, counts)
    meta.prefill_q_index = upload(torch.from_numpy(q_index), device)
    if meta.prefill_fresh:
        return
    small = upload(torch.tensor([starts, num_new], dtype=torch.int64), device)
    q_pos = torch.arange(max_q, device=device)[None, :]
    keys = torch.arange(len(tables[0]) * block_size, device=device)
    mask = keys[None, None, :] <= (small[0][:, None] + q_pos)[:, :, None]  # causal over prefix + chunk
    padding = (q_pos >= small[1][:, None])[:, :, None] & (keys == 0)[None, None, :]
    meta.prefill_mask = (mask | padding)[:, None]  # padded queries see key 0: no empty softmax


def _flash_metadata(
    meta: AttentionMetadata, num_new: list[int], ends: list[int], block_size: int, device
) -> None:
    """Cumulative query counts; unless every row is fresh, cumulative key counts (prefix and
    chunk) and each key's cache block and offset, built on the device from the block tables
    (set before, for rows with a cached prefix)."""
    cumulative = upload(
        torch.tensor(
            [[0, *itertools.accumulate(num_new)], [0, *itertools.accumulate(ends)]], dtype=torch.int32
        ),
        device,
    )
    meta.prefill_cu_lens = cumulative[0]
    if meta.prefill_fresh:
        return
    meta.prefill_cu_keys, meta.prefill_max_k = cumulative[1], max(ends)
    starts, total = cumulative[1][:-1].long(), sum(ends)  # each row's first key in the flat list
    row = torch.repeat_interleave(
        torch.arange(len(ends), device=device), cumulative[1][1:] - cumulative[1][:-1], output_size=total
    )
    position = torch.arange(total, device=device) - starts[row]
    meta.prefill_key_blocks = meta.prefill_block_tables[row, position // block_size]
    meta.prefill_key_offsets = position % block_size
