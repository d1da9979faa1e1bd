"""The engine's prefill attention on CUDA (rlx.engine.attention): torch's variable-length flash
attention over unpadded rows (`flash_prefill`), against SDPA over the same rows padded to the
longest (the path it replaced, still the fp32 one), for rows without a cached prefix and rows
with one. Skipped without a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

HEADS, KV_HEADS, DIM, PAGE = 16, 8, 128, 16  # Qwen3's GQA


@pytest.fixture(autouse=True)
def needs_flash():
    from rlx.engine.attention import flash_prefill

    if not flash_prefill(torch.device("cuda"), torch.bfloat16):
        pytest.skip("this torch or GPU has no variable-length flash attention")


def seq(computed: int, tokens: int, blocks: list[int]):
    return SimpleNamespace(
        num_computed=computed, token_ids=list(range(tokens)), num_tokens=tokens, num_prompt=tokens,
        block_table=blocks, wants_input_logprobs=False,
    )  # fmt: skip


def batch_of(rows: list[tuple[int, int]], seed: int = 0):
    """A prefill chunk: (cached prefix, new tokens) a row, each row's blocks distinct and shuffled."""
    from rlx.engine.scheduler import ScheduledBatch

    order = torch.randperm(200, generator=torch.Generator().manual_seed(seed)).tolist()
    seqs, at = [], 0
    for prefix, new in rows:
        count = -(-(prefix + new) // PAGE)
        seqs.append(seq(prefix, prefix + new, order[at : at + count]))
        at += count
    return ScheduledBatch(seqs=seqs, num_new=[n for _, n in rows], num_decode=0)


def attend(batch, qkv, caches, flash: bool):
    """The engine's order: this chunk's K/V stored at its slots, then paged_attention."""
    from rlx.engine.attention import paged_attention
    from rlx.engine.step_inputs import build_step_inputs

    inputs = build_step_inputs(batch, PAGE, torch.device("cuda"), True, flash)
    tokens = qkv.shape[0]
    q, k, v = qkv.split([HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM], dim=-1)
    q, k, v = q.view(tokens, HEADS, DIM), k.view(tokens, KV_HEADS, DIM), v.view(tokens, KV_HEADS, DIM)
    return paged_attention(q, k, v, caches, inputs.meta, DIM**-0.5), inputs.meta


@pytest.mark.parametrize(
    "rows",
    [[(0, 37), (0, 1), (0, 300), (0, 128)], [(0, 37), (32, 1), (96, 12), (288, 16), (0, 5)]],
    ids=["fresh rows", "cached prefixes beside fresh rows"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_prefill_matches_the_padded_rows(rows, dtype):
    """Rows of 1 to 300 new tokens, with cached prefixes of 32-288 tokens (a row with a prefix of
    its own whole prompt but one token, as the n samples of a prompt have) or none; q/k/v as the
    row-strided views of one qkv output the engine passes. The flash path's output matches the
    padded SDPA's within a rounding, and no query sees a later key or another row's: changing
    a row's last token changes nothing before it, nor any other row."""
    batch = batch_of(rows)
    g = torch.Generator(device="cuda").manual_seed(1)
    caches = tuple(
        torch.randn(200, KV_HEADS, PAGE, DIM, device="cuda", generator=g).to(dtype) for _ in range(2)
    )
    tokens = sum(n for _, n in rows)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, device="cuda", generator=g).to(dtype)
    out, meta = attend(batch, qkv, tuple(c.clone() for c in caches), flash=True)
    padded, padded_meta = attend(batch, qkv, tuple(c.clone() for c in caches), flash=False)
    assert meta.prefill_cu_lens is not None and padded_meta.prefill_cu_lens is None
    assert meta.prefill_fresh == all(prefix == 0 for prefix, _ in rows)
    assert out.shape == padded.shape == (tokens, HEADS, DIM)
    assert (out.float() - padded.float()).abs().max().item() <= 2e-2
    last = rows[0][1] - 1  # row 0's last token: its own query, key and value
    changed = qkv.clone()
    changed[last] = torch.randn(qkv.shape[1], device="cuda", generator=g).to(dtype)
    again, _ = attend(batch, changed, tuple(c.clone() for c in caches), flash=True)
    assert torch.equal(again[:last], out[:last]) and torch.equal(again[last + 1 :], out[last + 1 :])
    assert not torch.equal(again[last], out[last])


def test_the_key_index_walks_each_rows_blocks():
    """A row with a cached prefix: its keys are prefix + chunk in position order, read from its
    own blocks (block_table[p // 16], p % 16); the cumulative counts are the rows' lengths."""
    from rlx.engine.step_inputs import build_step_inputs

    batch = batch_of([(32, 3), (0, 17)], seed=2)
    meta = build_step_inputs(batch, PAGE, torch.device("cuda"), True, True).meta
    assert not meta.prefill_fresh
    assert meta.prefill_cu_lens.tolist() == [0, 3, 20] and meta.prefill_cu_keys.tolist() == [0, 35, 52]
    assert meta.prefill_max_q == 17 and meta.prefill_max_k == 35
    expected = [
        (s.block_table[p // PAGE], p % PAGE)
        for s, end in zip(batch.seqs, (35, 17), strict=True)
        for p in range(end)
    ]
    got = list(zip(meta.prefill_key_blocks.tolist(), meta.prefill_key_offsets.tolist(), strict=True))
    assert got == expected
