"""The host's share of an overlapped decode step, without a GPU: the engine's own bookkeeping on
real Sequences (256-token prompts), one step's worth each, a JSON line per batch size.

With CUDA graphs and the overlap schedule (rlx/engine/engine.py) the host prepares step k+1 while
the GPU runs step k, so the host's work is free while it is shorter than the GPU's step: 2.4-4.6 ms
for Qwen3-0.6B / 1.7B at 64-256 rows on an H200, but well under a millisecond for a model of a
few hundred million parameters, where the host sets the pace. Timed here: the scheduler's
`continue_decode`, the pending-token bookkeeping of `Engine._launch` (`_advance`), `HostRows.fill`
(the pinned input buffers), the truncation check of `ModelRunner.launch`, and the per-row part
of `Engine._resolve` (the tokens read back); `--finish`: with that many sequences ending before
each step, as an RL rollout's answers end on EOS. Not timed: the copies, the replay, the read-back wait.
Then a whole rollout's KV-block traffic (`block_churn_ms`): admission, growth, release; and a
prefill chunk's step inputs (`prefill_inputs_ms`), which the host builds while the chunk before
runs on the GPU.

    python bench/decode_host.py [--rows 64,256] [--steps 200] [--finish 0,1,4] [--churn-rows 256,1024] [--prefill 32x256,8x1024]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from rlx.engine.block_manager import BlockManager
from rlx.engine.engine import Engine
from rlx.engine.host_rows import HostRows
from rlx.engine.scheduler import ScheduledBatch, Scheduler
from rlx.engine.sequence import GenerateRequest, SamplingParams, Sequence, SequenceStatus
from rlx.engine.step_inputs import build_step_inputs

PROMPT, VOCAB = 256, 151_936


class ReadBack:
    """`Engine._resolve`'s runner: every row's token and logprob, already on the host."""

    def __init__(self, rows: int):
        self.rows = rows

    def collect(self, handle) -> list[list[float]]:
        return [[5.0] * self.rows, [-1.0] * self.rows]


def running(rows: int) -> tuple[Engine, list[Sequence]]:
    """An engine's scheduler with `rows` sequences prefilled and decoding (no model, no device)."""
    blocks = BlockManager(num_blocks=rows * 80, block_size=16)
    scheduler = Scheduler(blocks, max_running=rows, max_step_tokens=8192)
    seqs = []
    for i in range(rows):
        request = GenerateRequest(list(range(2, 2 + PROMPT)), SamplingParams(max_new_tokens=1 << 20))
        seq = Sequence(i, request, 1 << 20, seed=i, vocab=VOCAB)
        blocks.allocate(seq)
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
        blocks.mark_computed(seq, seq.num_tokens)
        seq.num_computed = seq.num_tokens - 1  # its last prompt token is the first decode input
        seqs.append(seq)
    engine = Engine.__new__(Engine)  # the bookkeeping methods only
    engine.scheduler, engine.runner, engine.eos_token_ids = scheduler, ReadBack(rows), set()
    return engine, seqs


def host_step_us(rows: int, steps: int, finish: int = 0) -> dict:
    """`rows` decoding; with `finish`, that many sequences end before each step at random rows
    of the first half (an RL rollout's answers ending on EOS), shifting the rows after them, and
    as many join at the end (admitted in their place), so that every step has `rows` rows."""
    rng = random.Random(0)
    engine, seqs = running(rows + finish * steps)
    seqs, joining = seqs[:rows], seqs[rows:]
    engine.scheduler.running = list(seqs)
    sets = [HostRows(len(seqs), 256, pin=False) for _ in range(2)]  # taken in turn, as DecodeGraphs does
    parts = dict.fromkeys(("continue_decode", "launch", "fill_host", "truncation_check", "resolve"), 0.0)
    behind = None
    for step in range(steps):
        for _ in range(finish):
            seq = seqs.pop(rng.randrange(len(seqs) // 2))
            engine.scheduler.running.remove(seq)
            seq.status = SequenceStatus.FINISHED
            seqs.append(joining.pop())
            engine.scheduler.running.append(seqs[-1])
        marks = [time.perf_counter()]
        batch = engine.scheduler.continue_decode(seqs)
        marks.append(time.perf_counter())
        Engine._advance(batch)  # Engine._launch's bookkeeping: a PENDING token a row
        marks.append(time.perf_counter())
        sets[step % 2].fill(batch.seqs, list(range(len(batch.seqs))), len(batch.seqs))
        marks.append(time.perf_counter())
        any(seq.truncates for seq in batch.seqs)
        marks.append(time.perf_counter())
        if behind is not None:
            engine.runner.rows = len(behind.seqs)
            engine._resolve(behind, None)
        marks.append(time.perf_counter())
        behind = batch
        for name, start, end in zip(parts, marks[:-1], marks[1:], strict=True):
            parts[name] += end - start
    per_step = {name: round(seconds / steps * 1e6, 1) for name, seconds in parts.items()}
    return {
        "rows": rows,
        "finish": finish,
        "us_per_step": per_step,
        "total_us": round(sum(per_step.values()), 1),
    }


def block_churn_ms(rows: int, new: int = 512, num_blocks: int = 60_000) -> dict:
    """A rollout's block traffic in a KV cache of an H200's size (60,000 blocks of 16 tokens: a
    1.7B model's cache at 0.8 of the memory): `rows` distinct prompts admitted, grown by `new`
    tokens a block at a time, released; milliseconds for each phase."""
    blocks = BlockManager(num_blocks=num_blocks, block_size=16)
    seqs = []
    for i in range(rows):
        prompt = [2 + (i * PROMPT + j) % (VOCAB - 2) for j in range(PROMPT)]  # no shared prefix
        seqs.append(Sequence(i, GenerateRequest(prompt, SamplingParams(max_new_tokens=new)), new, seed=i))
    start = time.perf_counter()
    for seq in seqs:
        blocks.allocate(seq)
    admitted = time.perf_counter()
    for tokens in range(PROMPT + 16, PROMPT + new + 1, 16):
        for seq in seqs:
            blocks.grow_to(seq, tokens)
    grown = time.perf_counter()
    for seq in seqs:
        blocks.release(seq)
    end = time.perf_counter()
    ms = lambda a, b: round((b - a) * 1e3, 2)  # noqa: E731
    return {
        "rows": rows,
        "allocate_ms": ms(start, admitted),
        "grow_ms": ms(admitted, grown),
        "release_ms": ms(grown, end),
    }


def prefill_inputs_ms(rows: int, length: int, repeats: int = 20) -> dict:
    """A prefill chunk's step inputs (`build_step_inputs`): `rows` fresh prompts of `length`
    tokens, the flash path's (what a GPU builds; its copies to the device not timed) and the CPU's
    padded path's; milliseconds a chunk."""
    blocks = BlockManager(num_blocks=rows * (length // 16 + 2), block_size=16)
    batch = ScheduledBatch()
    for i in range(rows):
        seq = Sequence(
            i, GenerateRequest([2 + (i + j) % 97 for j in range(length)], SamplingParams()), 8, seed=i
        )
        blocks.allocate(seq)
        batch.add(seq, length)
    out = {"rows": rows, "length": length}
    for name, flash in (("flash_ms", True), ("padded_ms", False)):
        build_step_inputs(batch, 16, torch.device("cpu"), False, flash)
        start = time.perf_counter()
        for _ in range(repeats):
            build_step_inputs(batch, 16, torch.device("cpu"), False, flash)
        out[name] = round((time.perf_counter() - start) / repeats * 1e3, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="64,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--finish", default="0,1,4", help="sequences ending before each step")
    parser.add_argument("--churn-rows", default="256,1024", help="block_churn_ms's prompts")
    parser.add_argument("--prefill", default="32x256,256x32,8x1024", help="prefill chunks: rows x tokens")
    args = parser.parse_args()
    for rows in (int(r) for r in args.rows.split(",")):
        for finish in (int(f) for f in args.finish.split(",")):
            host_step_us(rows, 10, finish)  # warm
            print(json.dumps({"bench": "decode_host", **host_step_us(rows, args.steps, finish)}), flush=True)
    for rows in (int(r) for r in args.churn_rows.split(",")):
        print(json.dumps({"bench": "decode_host", "blocks": block_churn_ms(rows)}), flush=True)
    for shape in args.prefill.split(","):
        rows, length = (int(x) for x in shape.split("x"))
        print(
            json.dumps({"bench": "decode_host", "prefill_inputs": prefill_inputs_ms(rows, length)}),
            flush=True,
        )


if __name__ == "__main__":
    main()
