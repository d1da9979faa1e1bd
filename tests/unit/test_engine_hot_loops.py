"""The engine's per-step loops over a decode step's rows, by hand: the read-back's finish checks
(`Engine._finish`, with its inlined common case), the overlap's source rows (`rows_in`) and the
scheduler's next decode step (`Scheduler.continue_decode`)."""

from __future__ import annotations

from rlx.engine.block_manager import BlockManager
from rlx.engine.engine import Engine
from rlx.engine.host_rows import rows_in
from rlx.engine.scheduler import Scheduler
from rlx.engine.sequence import PENDING, GenerateRequest, SamplingParams, Sequence, SequenceStatus

EOS = 2


def _running(
    scheduler: Scheduler, prompt: list[int], outputs: list[int], max_new: int, **sampling
) -> Sequence:
    """A running sequence with `outputs` sampled and a PENDING place for this step's token."""
    seq = Sequence(
        len(scheduler.running), GenerateRequest(prompt, SamplingParams(**sampling)), max_new, seed=0
    )
    seq.token_ids += [*outputs, PENDING]
    seq.output_logprobs += [-0.5] * len(outputs)
    scheduler.blocks.allocate(seq)
    seq.status = SequenceStatus.RUNNING
    scheduler.running.append(seq)
    return seq


def test_a_steps_tokens_land_and_each_row_finishes_as_sglang_orders_it():
    """Per row: the token over its PENDING place and its logprob; then length, then a stop or EOS
    token (unless ignore_eos), then a stop string in the decoded newest tokens."""
    scheduler = Scheduler(BlockManager(num_blocks=64, block_size=4), max_running=8, max_step_tokens=64)
    engine = Engine.__new__(Engine)
    engine.scheduler, engine.eos_token_ids = scheduler, {EOS}
    engine.decode = lambda ids, skip_special_tokens: "".join(chr(ord("a") + t % 26) for t in ids)
    rows = [  # (sequence, the token sampled for it)
        (_running(scheduler, [5, 6], [7], max_new=4), 9),  # goes on
        (_running(scheduler, [5, 6], [7], max_new=4), EOS),  # EOS
        (_running(scheduler, [5, 6], [7], max_new=4, ignore_eos=True), EOS),  # goes on
        (_running(scheduler, [5, 6], [7], max_new=4, stop_token_ids=[11]), 11),  # a stop token
        (_running(scheduler, [5, 6], [7, 8], max_new=3), EOS),  # length before EOS
        (_running(scheduler, [5, 6], [7], max_new=4, stop=["hb"]), 1),  # outputs 7, 1: "hb", the stop string
        (_running(scheduler, [5, 6], [7], max_new=4, stop=["zz"]), 1),  # goes on
    ]
    done = _running(scheduler, [5], [], max_new=4)
    scheduler.finish(done)  # finished by the step before: skipped
    sampled = [(seq, float(token), -0.25) for seq, token in rows] + [(done, 3.0, -0.25)]
    finished = engine._finish(sampled, [])
    reasons = [seq.finish_reason for seq, _ in rows]
    assert reasons == [
        None,
        {"type": "stop", "matched": EOS},
        None,
        {"type": "stop", "matched": 11},
        {"type": "length", "length": 3},
        {"type": "stop", "matched": "hb"},
        None,
    ]
    assert finished == [rows[i][0] for i in (1, 3, 4, 5)]
    assert [seq.token_ids[2:] for seq, _ in rows] == [
        [7, 9],
        [7, EOS],
        [7, EOS],
        [7, 11],
        [7, 8, EOS],
        [7, 1],
        [7, 1],
    ]
    assert all(seq.output_logprobs[-1] == -0.25 for seq, _ in rows)
    assert done.token_ids == [5, PENDING] and done.output_logprobs == []
    assert scheduler.running == [rows[i][0] for i in (0, 2, 6)]


def test_rows_in_the_step_behind():
    a, b, c, d = (Sequence(i, GenerateRequest([1], SamplingParams()), 4, seed=0) for i in range(4))
    assert rows_in([a, b, c], [a, b, c]) == [0, 1, 2]
    assert rows_in([a, c], [a, b, c]) == [0, 2]  # b finished: c moved up
    assert rows_in([a, c, d], [a, b, c]) == [0, 2, -1]  # d joined: its token is the host's
    assert rows_in([a, b], []) == [-1, -1]


def test_continue_decode_takes_the_rows_short_of_their_length_and_grows_their_tables():
    """Rows short of max_new continue, a finished one is left out, a table one block short gets
    it; a sequence running outside the rows, or a request that could join, stops the chain."""
    scheduler = Scheduler(BlockManager(num_blocks=64, block_size=4), max_running=8, max_step_tokens=64)
    going = _running(scheduler, [5, 6], [7], max_new=4)  # 4 tokens: its one block holds them
    full = _running(scheduler, [5], [7, 8], max_new=3)  # 3 outputs with the pending one: done
    grows = _running(scheduler, [5, 6], [7], max_new=4)
    grows.token_ids.insert(-1, 8)  # sampled since its block was given: 5 tokens, one block
    grows.output_logprobs.append(-0.5)
    assert [len(s.block_table) for s in (going, full, grows)] == [1, 1, 1]
    batch = scheduler.continue_decode([going, full, grows])
    assert batch.seqs == [going, grows] and batch.num_new == [1, 1]
    assert [len(s.block_table) for s in (going, full, grows)] == [1, 1, 2]
    assert scheduler.continue_decode([going, grows]) is None  # `full` runs outside the rows
    scheduler.finish(full)
    assert scheduler.continue_decode([going, grows]).seqs == [going, grows]
    scheduler.add(Sequence(9, GenerateRequest([5], SamplingParams()), 4, seed=0))
    assert scheduler.continue_decode([going, grows]) is None  # a request can join
