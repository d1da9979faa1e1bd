"""rlx.engine on CPU: block accounting, prefix sharing, staggered arrivals, aborts, preemption
and chunked prefill, each checked against transformers (greedy tokens equal, logprobs 1e-4)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlx.engine import Engine, EngineArgs, GenerateRequest, SamplingParams
from rlx.engine.block_manager import BlockManager
from rlx.engine.scheduler import Scheduler
from rlx.engine.sequence import Sequence, SequenceStatus

PROMPTS = [[5], [2, 3, 4], [9, 8, 7, 6, 5, 4, 12], [3, 13, 2, 14, 6, 11, 10, 4, 7, 12, 15, 2, 9, 9]]


@pytest.fixture(scope="module")
def hf_model(scrambled_dir):
    return AutoModelForCausalLM.from_pretrained(str(scrambled_dir), dtype=torch.float32).eval()


def make_engine(path, **kwargs) -> Engine:
    return Engine(EngineArgs(model_path=str(path), device="cpu", **kwargs))


def greedy(prompt, max_new=12, **extra) -> GenerateRequest:
    return GenerateRequest(
        list(prompt), SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True, **extra)
    )


@torch.no_grad()
def check_against_transformers(model, prompt, output_ids, output_logprobs, temperature=1.0):
    """Logprobs within 1e-4 of transformers' log-softmax; returns transformers' greedy choice at
    every position of this output (teacher-forced: equal to `generate`'s greedy tokens exactly
    when the output is greedy, without generate's EOS handling under ignore_eos)."""
    logits = model(torch.tensor([prompt + output_ids])).logits[0, len(prompt) - 1 : -1]
    ref = (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(output_ids)[:, None])[:, 0]
    assert (torch.tensor(output_logprobs) - ref).abs().max().item() <= 1e-4
    return logits.argmax(-1).tolist()


def seq_of(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, GenerateRequest(tokens), max_new=4, seed=0)


def test_block_manager_counts_and_shares_blocks():
    blocks = BlockManager(num_blocks=9, block_size=4)  # block 0 reserved: 8 usable
    first, second = seq_of(list(range(10)), 0), seq_of(list(range(10)), 1)
    assert blocks.can_allocate(first)
    blocks.allocate(first)  # 10 tokens -> 3 blocks, nothing cached yet
    assert len(first.block_table) == 3 and blocks.num_free == 5 and first.num_computed == 0
    blocks.mark_computed(first, 10)  # only blocks wholly before the last prompt token: (10-1)//4 = 2
    blocks.allocate(second)
    assert second.block_table[:2] == first.block_table[:2] and second.block_table[2] != first.block_table[2]
    assert second.num_computed == second.num_shared == 8 and blocks.num_free == 4
    assert [blocks.ref_count[b] for b in second.block_table] == [2, 2, 1]
    blocks.release(first)
    assert blocks.num_free == 5 and [blocks.ref_count[b] for b in second.block_table] == [1, 1, 1]
    blocks.release(second)
    assert blocks.num_free == 8
    third = seq_of(list(range(10)) + [3, 3], 2)  # a freed block keeps its hash: still a hit
    blocks.allocate(third)
    assert third.num_shared == 8 and blocks.num_free == 8 - 3
    blocks.release(third)
    blocks.forget_cached()
    fourth = seq_of(list(range(10)), 3)
    blocks.allocate(fourth)
    assert fourth.num_shared == 0


def test_free_blocks_are_reused_least_recently_freed_first():
    """Never-used blocks go first, then freed ones in the order they were freed: a prompt freed a
    moment ago keeps its cached blocks longest."""
    blocks = BlockManager(num_blocks=7, block_size=4)  # blocks 1-6
    a, b, c = (seq_of([i] * 4, i) for i in (1, 2, 3))
    for seq in (a, b, c):
        blocks.allocate(seq)
    assert [a.block_table, b.block_table, c.block_table] == [[1], [2], [3]]
    blocks.release(b)
    blocks.release(a)
    d = seq_of(list(range(16)), 4)
    blocks.allocate(d)
    assert d.block_table == [4, 5, 6, 2] and blocks.num_free == 1
    blocks.grow_to(d, 17)
    assert d.block_table[-1] == 1 and blocks.num_free == 0


def test_growth_needs_a_block_only_at_a_boundary():
    blocks = BlockManager(num_blocks=3, block_size=4)
    seq = seq_of([1, 2, 3])
    blocks.allocate(seq)
    seq.token_ids.append(4)  # 4 tokens: still one block
    assert blocks.can_append_pending(seq)
    blocks.grow_to(seq, seq.num_tokens)
    assert len(seq.block_table) == 1
    seq.token_ids += [5, 6, 7, 8, 9]  # 9 tokens need 3 blocks, 2 exist in all
    assert not blocks.can_append_pending(seq)


def run_step(scheduler: Scheduler) -> list[int]:
    """One scheduled step, computed as the engine counts it (a token sampled per finished
    prompt); the ids of its rows."""
    batch = scheduler.schedule()
    for seq, num_new in zip(batch.seqs, batch.num_new, strict=True):
        seq.num_computed += num_new
        if seq.num_computed == seq.num_tokens:
            seq.token_ids.append(1)
    return [s.seq_id for s in batch.seqs]


def test_waiting_requests_join_in_groups():
    """With `admission_group` 2 and every slot taken, one freed slot admits no one; two admit
    the next two; a last request alone joins as soon as it fits. Nothing running: all may join."""
    scheduler = Scheduler(BlockManager(num_blocks=64, block_size=4), 4, 64, admission_group=2)
    seqs = [seq_of([1, 2, 3], i) for i in range(7)]
    for seq in seqs:
        scheduler.add(seq)
    assert run_step(scheduler) == [0, 1, 2, 3]  # nothing ran: the running cap is the limit
    scheduler.finish(seqs[0])
    assert run_step(scheduler) == [1, 2, 3]  # one free slot, two wait
    assert not scheduler._can_admit()  # and a decode behind the one in flight goes on
    scheduler.finish(seqs[1])
    assert scheduler._can_admit()
    assert run_step(scheduler) == [2, 3, 4, 5]  # decodes first, then the new prompts
    scheduler.finish(seqs[2])
    assert run_step(scheduler) == [3, 4, 5, 6]  # one waits, one slot: it joins
    plain = Scheduler(BlockManager(num_blocks=64, block_size=4), 4, 64)
    for seq in [seq_of([1, 2, 3], i) for i in range(6)]:
        plain.add(seq)
    run_step(plain)
    plain.finish(plain.running[0])
    assert run_step(plain) == [1, 2, 3, 4]  # groups of 1: a freed slot is taken at once


def test_a_group_waits_for_the_blocks_of_all_its_requests():
    """Slots free, but blocks for only one of the next two prompts (3 blocks each; 4 free of 20,
    under the group's share of the cache, 20 x 2/8 = 5): with groups of 2 no one joins until
    the running sequence frees its blocks."""
    for group, joined in ((1, [0, 1]), (2, [0])):
        scheduler = Scheduler(BlockManager(num_blocks=21, block_size=4), 8, 128, admission_group=group)
        running = seq_of(list(range(63)), 0)  # 16 blocks of the 20 usable
        scheduler.add(running)
        run_step(scheduler)
        for i in (1, 2):
            scheduler.add(seq_of([100 * i + j for j in range(12)], i))
        assert run_step(scheduler) == joined
    scheduler.finish(running)
    assert run_step(scheduler) == [1, 2]  # nothing runs: the first fits, and then the second


def test_a_group_limited_by_the_cache_joins_once_its_share_of_blocks_is_free():
    """Prompts of 4 blocks, a cache of 32: a group of 8 never fits while any sequence runs, so
    requests join once 8/16 of the cache (16 blocks) is free, not only when nothing runs."""
    scheduler = Scheduler(BlockManager(num_blocks=33, block_size=4), 16, 256, admission_group=8)
    seqs = [seq_of([100 * i + j for j in range(15)], i) for i in range(18)]  # 15 tokens: 4 blocks
    for seq in seqs:
        scheduler.add(seq)
    assert run_step(scheduler) == list(range(8))  # 8 x 4 blocks fill the cache
    for i in range(3):
        scheduler.finish(seqs[i])
    assert scheduler.blocks.num_free == 12 and not scheduler._can_admit()
    scheduler.finish(seqs[3])
    assert scheduler._can_admit()
    assert run_step(scheduler) == [4, 5, 6, 7, 8, 9, 10, 11]  # 16 tokens each: no growth yet


def test_group_shares_its_prompt_prefill(scrambled_dir):
    engine = make_engine(scrambled_dir, page_size=4)
    computed = []
    run = engine.runner.run
    engine.runner.run = lambda batch: (computed.append(batch.num_tokens), run(batch))[1]
    prompt = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 13 tokens: 3 full shareable blocks
    seqs = [
        engine.add(
            GenerateRequest(prompt, SamplingParams(max_new_tokens=3, sampling_seed=i, ignore_eos=True))
        )
        for i in range(4)
    ]
    engine.step()
    shared = seqs[0].block_table[:3]
    assert all(s.block_table[:3] == shared for s in seqs)
    assert [engine.blocks.ref_count[b] for b in shared] == [4, 4, 4]
    assert computed[0] == 13 + 3 * 1  # one prefill of the prompt, then one token per sibling
    while engine.has_work():
        engine.step()
    assert all(s.num_output == 3 for s in seqs)
    assert len({tuple(s.output_ids) for s in seqs}) > 1  # different seeds, different samples


def test_staggered_arrivals_and_abort_match_transformers(scrambled_dir, hf_model):
    engine = make_engine(scrambled_dir, page_size=4)
    seqs = []
    for prompt in PROMPTS:  # one request joins every two steps, while the others decode
        seqs.append(engine.add(greedy(prompt, 12)))
        engine.step()
        engine.step()
    victim = engine.add(greedy([4, 4, 5], 30))
    engine.step()
    engine.step()
    engine.abort(victim)
    while engine.has_work():
        engine.step()
    assert victim.finish_reason["type"] == "abort" and 0 < victim.num_output < 30
    for prompt, seq in zip(PROMPTS, seqs, strict=True):
        out = seq.output()
        assert out.finish_reason == {"type": "length", "length": 12}
        assert out.output_ids == check_against_transformers(
            hf_model, prompt, out.output_ids, out.output_logprobs
        )


def test_preemption_under_a_tiny_kv_budget_recomputes_and_matches(scrambled_dir, hf_model):
    engine = make_engine(scrambled_dir, page_size=4, max_total_tokens=40)  # 10 blocks for 6 x ~20 tokens
    prompts = [[2 + i, 3, 4 + i, 5, 6] for i in range(6)]
    outputs = engine.generate([greedy(p, 14) for p in prompts])
    assert engine.scheduler.num_preempted > 0
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1  # every block came back
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out.output_ids) == 14
        assert out.output_ids == check_against_transformers(
            hf_model, prompt, out.output_ids, out.output_logprobs
        )


def test_sampled_logprobs_under_preemption_match_transformers(scrambled_dir, hf_model):
    engine = make_engine(scrambled_dir, page_size=4, max_total_tokens=40)
    requests = [
        GenerateRequest(
            [2 + i, 3, 4], SamplingParams(max_new_tokens=14, temperature=0.8, top_k=6, ignore_eos=True)
        )
        for i in range(6)
    ]
    for out, request in zip(engine.generate(requests), requests, strict=True):
        check_against_transformers(hf_model, request.input_ids, out.output_ids, out.output_logprobs, 0.8)


def test_chunked_prefill_with_prompt_logprobs(scrambled_dir, hf_model):
    engine = make_engine(scrambled_dir, page_size=4, chunked_prefill_size=5, max_running_requests=4)
    prompt = PROMPTS[3] * 2  # 28 tokens in chunks of at most 5
    request = GenerateRequest(
        prompt, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True), logprob_start_len=3
    )
    (out,) = engine.generate([request, greedy(PROMPTS[2], 6)])[:1]
    with torch.no_grad():
        logp = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    expected = logp[3:-1].gather(-1, torch.tensor(prompt[4:])[:, None])[:, 0]
    assert out.input_logprobs[0] is None and len(out.input_logprobs) == len(prompt) - 3
    assert (torch.tensor(out.input_logprobs[1:]) - expected).abs().max().item() <= 1e-4
    assert out.output_ids == check_against_transformers(hf_model, prompt, out.output_ids, out.output_logprobs)


def test_bad_input_is_rejected_and_the_engine_keeps_serving(scrambled_dir):
    engine = make_engine(scrambled_dir, page_size=4, max_total_tokens=16)  # prompts up to 15 tokens
    with pytest.raises(ValueError, match="exceeds the maximum allowed length"):
        engine.validate(greedy([2] * 20))
    for bad in ([], [2] * 64, [16], [-1]):
        with pytest.raises(ValueError):
            engine.validate(greedy(bad))
    running = engine.add(greedy([2, 3], 40))  # max_new_tokens past the KV budget: capped to it
    while engine.has_work():
        engine.step()
    assert running.status is SequenceStatus.FINISHED and running.finish_reason == {
        "type": "length",
        "length": 14,
    }
