"""The engine's prefill attention for rows without a cached prefix (rlx.engine.attention) on CUDA:
torch's variable-length flash attention over the step's rows as they lie, against causal SDPA
over the same rows padded to the longest (the path it replaced, and the fp32 path). Skipped
without a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def fresh_meta(lens: list[int], cu_lens: bool) -> SimpleNamespace:
    """What build_step_inputs gives _prefill_fresh: the padding's index, the rows' cumulative
    lengths (None: the padded path)."""
    max_q = max(lens)
    index = [row * max_q + i for row, n in enumerate(lens) for i in range(n)]
    cumulative = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return SimpleNamespace(
        prefill_block_tables=torch.zeros(len(lens), 1, device="cuda"), prefill_max_q=max_q,
        prefill_q_index=torch.tensor(index, device="cuda"), prefill_cu_lens=cumulative if cu_lens else None,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_rows_match_the_padded_rows(dtype):
    """Rows of 1 to 300 tokens (one of a single token), Qwen3's GQA of 16 query heads on 8 KV
    heads, q/k/v as the row-strided views of one qkv output that the engine passes: the flash
    kernel's output matches the padded SDPA's within a rounding, and no query sees a later key
    or another row's (changing a row's last token changes nothing before it, nor other rows)."""
    from rlx.engine.attention import _prefill_fresh, varlen_attention

    if varlen_attention() is None or torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("this torch or GPU has no variable-length flash attention")
    heads, kv_heads, dim = 16, 8, 128
    lens = [37, 1, 300, 128, 64]
    tokens = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda", generator=g).to(dtype)

    def attend(qkv, cu_lens):
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
        return _prefill_fresh(q, k, v, fresh_meta(lens, cu_lens), dim**-0.5)

    out, padded = attend(qkv, True), attend(qkv, False)
    assert out.shape == padded.shape == (tokens, heads, dim)
    assert (out.float() - padded.float()).abs().max().item() <= 2e-2
    changed = qkv.clone()
    last = lens[0] - 1  # row 0's last token: its own query, key and value
    changed[last] = torch.randn(qkv.shape[1], device="cuda", generator=g).to(dtype)
    again = attend(changed, True)
    assert torch.equal(again[:last], out[:last]) and torch.equal(again[lens[0] :], out[lens[0] :])
    assert not torch.equal(again[last], out[last])


def test_the_engine_gives_fresh_prefill_rows_their_cumulative_lengths():
    """build_step_inputs on CUDA: a chunk of fresh rows carries their cumulative lengths, which
    send its attention to the flash kernel; a row with a cached prefix sends the chunk to the
    gather path, without them."""
    from rlx.engine.scheduler import ScheduledBatch
    from rlx.engine.step_inputs import build_step_inputs

    def seq(computed: int, tokens: int):
        return SimpleNamespace(
            num_computed=computed, token_ids=list(range(tokens)), num_tokens=tokens, num_prompt=tokens,
            block_table=list(range(1, 40)), wants_input_logprobs=False,
        )  # fmt: skip

    fresh = ScheduledBatch(seqs=[seq(0, 5), seq(0, 17)], num_new=[5, 17], num_decode=0)
    meta = build_step_inputs(fresh, 16, torch.device("cuda"), True).meta
    assert meta.prefill_fresh and meta.prefill_cu_lens.tolist() == [0, 5, 22]
    cached = ScheduledBatch(seqs=[seq(0, 5), seq(16, 20)], num_new=[5, 4], num_decode=0)
    meta = build_step_inputs(cached, 16, torch.device("cuda"), True).meta
    assert not meta.prefill_fresh and meta.prefill_cu_lens is None
