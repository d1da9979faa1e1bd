"""Paged attention over the KV cache: the step's K/V are written, then every query attends.

A step's tokens are ordered decode rows first (one query each), then prefill rows (a chunk
of queries each, causal over the cached prefix plus the chunk). Two implementations:

- gather + SDPA (every device): the rows' blocks are gathered into a padded
  [rows, kv_heads, blocks x block_size, head_dim] tensor and torch's SDPA runs with a mask
  of valid, causal positions: decode on CPU, prefill on CPU and in fp32 (a GPU's fp32 rows
  without a cached prefix: SDPA over their own chunk, padded);
- a Triton paged decode kernel (CUDA): one program per (row, kv head) streams the row's
  blocks once with an online softmax; all query heads of a GQA group share each K/V load.
  The gather path would read the KV twice (gather, then SDPA) and allocate the padded copy.

An fp8 cache (`kv_cache_dtype`) holds the keys and values rounded to one byte; each path reads
them back into the queries' dtype. Rows without a cached prefix attend to the step's own K/V
as computed (SGLang's Triton backend likewise), so only keys from earlier steps are rounded.

On a CUDA GPU in bf16/fp16 (`flash_prefill`) prefill rows take torch's variable-length flash
attention instead (`varlen_attn`, rows told apart by their cumulative lengths, causal from the
bottom right, so a row's queries see its cached prefix): rows without a cached prefix
(`prefill_fresh`) over the step's K/V as they lie, the others over their keys gathered from
the cache, unpadded. The padding's copies had cost more than the attention: a chunk of 8,192
fresh tokens (Qwen3-0.6B's heads) 246 -> 88 µs a layer for 32 rows of 256, 333 -> 146 for 24
rows of 16-600 (1×H200, torch 2.11).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where this step's K/V go and what each row attends to (all tensors on the device)."""

    slot_block: torch.Tensor  # [T] block of each new token
    slot_offset: torch.Tensor  # [T] its slot in the block
    num_decode: int  # leading rows with one query each
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor | None = None  # [num_decode] int32, this token included
    decode_mask: torch.Tensor | None = None  # gather path: [num_decode, 1, 1, K] valid keys
    prefill_block_tables: torch.Tensor | None = None  # [num_prefill, blocks] (gather path)
    prefill_q_index: torch.Tensor | None = None  # [T - num_decode] flat index into [rows x max_q]
    prefill_mask: torch.Tensor | None = None  # [num_prefill, 1, max_q, K] causal and valid
    prefill_max_q: int = 0
    prefill_fresh: bool = False  # CUDA: every prefill row starts at position 0 (no cached prefix)
    # flash prefill (`flash_prefill`): the rows' cumulative query and key counts (int32), and
    # where each key of a row with a cached prefix lies in the cache ([sum of keys] block, offset)
    prefill_cu_lens: torch.Tensor | None = None
    prefill_cu_keys: torch.Tensor | None = None
    prefill_max_k: int = 0
    prefill_key_blocks: torch.Tensor | None = None
    prefill_key_offsets: torch.Tensor | None = None
    use_decode_kernel: bool = False  # Triton kernel for the decode rows (CUDA)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> None:
    """Store the step's keys and values ([T, kv_heads, head_dim]) at their slots, in the cache's
    dtype: an fp8 cache rounds them, saturating at its largest finite value as the GPU's
    conversion does (torch's gives e5m2 infinities)."""
    k_cache[meta.slot_block, :, meta.slot_offset] = to_cache(k, k_cache.dtype)
    v_cache[meta.slot_block, :, meta.slot_offset] = to_cache(v, v_cache.dtype)


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype.itemsize == 1:
        x = x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    return x.to(dtype)


def gather_attention(
    q_RHQD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """SDPA over each row's gathered blocks (in q's dtype); q [rows, heads, max_q, head_dim]."""
    rows, num_blocks = block_tables.shape
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    k, v = (
        c[block_tables]
        .transpose(1, 2)
        .reshape(rows, num_kv_heads, num_blocks * block_size, head_dim)
        .to(q_RHQD.dtype)
        for c in (k_cache, v_cache)
    )
    gqa = q_RHQD.shape[1] != num_kv_heads
    return F.scaled_dot_product_attention(q_RHQD, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    kv_written: bool = False,
) -> torch.Tensor:
    """Attention for the step's queries q [T, heads, head_dim]; writes k, v into the cache first
    (unless the fused rotary kernel already stored them: `kv_written`)."""
    k_cache, v_cache = kv
    if not kv_written:
        write_kv(k_cache, v_cache, k, v, meta)
    num_decode, num_tokens = meta.num_decode, q.shape[0]
    if num_decode == num_tokens:
        return _decode(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if num_decode:
        out[:num_decode] = _decode(q[:num_decode], k_cache, v_cache, meta, scale)
    if meta.prefill_fresh:
        out[num_decode:] = _prefill_fresh(q[num_decode:], k[num_decode:], v[num_decode:], meta, scale)
    else:
        out[num_decode:] = _prefill(q[num_decode:], k_cache, v_cache, meta, scale)
    return out


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if meta.use_decode_kernel:
        from rlx.engine.triton_decode import paged_decode

        return paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    out = gather_attention(q[:, :, None], k_cache, v_cache, meta.decode_block_tables, meta.decode_mask, scale)
    return out[:, :, 0]


def _pad_rows(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[tokens, heads, D] -> [rows, heads, max_q, D], each row's tokens first, zeros after."""
    rows, max_q = meta.prefill_block_tables.shape[0], meta.prefill_max_q
    padded = x.new_zeros(rows * max_q, *x.shape[1:])
    padded[meta.prefill_q_index] = x
    return padded.view(rows, max_q, *x.shape[1:]).transpose(1, 2)


@functools.cache
def varlen_attention():
    """torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`), or None
    where this torch lacks it (looked up once: each prefill layer calls it)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def flash_prefill(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prefill attention runs as `varlen_attn` (flash attention: sm80+, 2-byte dtypes;
    fp32 and the CPU keep SDPA, whose numerics the tests and golden runs recorded)."""
    return (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(device) >= (8, 0)
        and varlen_attention() is not None
    )


def _varlen(q, k, v, meta: AttentionMetadata, cu_keys, max_k: int, scale: float) -> torch.Tensor:
    """window (-1, 0): causal from the bottom right, each row's queries being its last keys."""
    cu, max_q = meta.prefill_cu_lens, meta.prefill_max_q
    return varlen_attention()(q, k, v, cu, cu_keys, max_q, max_k, scale=scale, window_size=(-1, 0))


def _prefill_fresh(q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Rows without a cached prefix attend to their own chunk only, causally: flash attention
    over the rows as they lie (`flash_prefill`; GQA native), else SDPA over padded rows (flash
    kernel; no gather, no mask): the padding sits after each row's tokens, so causality keeps it
    from every real query."""
    if meta.prefill_cu_lens is not None:
        return _varlen(q, k, v, meta, meta.prefill_cu_lens, meta.prefill_max_q, scale)
    q_pad, k_pad, v_pad = (_pad_rows(x, meta) for x in (q, k, v))
    gqa = q_pad.shape[1] != k_pad.shape[1]
    out = F.scaled_dot_product_attention(q_pad, k_pad, v_pad, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(-1, *q.shape[1:])[meta.prefill_q_index]


def _prefill(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Rows with a cached prefix (and any fresh rows beside them): each row's keys gathered from
    the cache, then flash attention (`flash_prefill`), else SDPA over rows padded to the longest
    with a mask of valid, causal keys."""
    if meta.prefill_cu_keys is not None:
        blocks, offsets = meta.prefill_key_blocks, meta.prefill_key_offsets
        k, v = (c[blocks, :, offsets].to(q.dtype) for c in (k_cache, v_cache))  # [keys, kv_heads, D]
        return _varlen(q, k, v, meta, meta.prefill_cu_keys, meta.prefill_max_k, scale)
    padded = _pad_rows(q, meta)
    out = gather_attention(padded, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_mask, scale)
    return out.transpose(1, 2).reshape(-1, *q.shape[1:])[meta.prefill_q_index]
