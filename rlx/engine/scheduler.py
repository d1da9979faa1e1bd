"""Continuous batching: which sequences run in the next forward pass, and how many tokens each.

Every step, each running sequence with one token pending decodes it; sequences still in
prefill take the next chunk of their prompt; then waiting sequences are admitted in arrival
order while the token budget (`chunked_prefill_size`), the running cap
(`max_running_requests`) and the free KV blocks allow. Decodes and prefill chunks share one
forward pass. While sequences run, waiting requests join in groups (`admission_group`): a
step that admits one runs eagerly, its decodes out of their CUDA graph: a rollout queued past
the running cap, admitting a request per freed slot, ran a fifth of its steps eagerly (1×H200,
Qwen3-0.6B shape, 512 requests at 256 running: 18.6k -> 41.2k tokens/s with groups of 32,
`bench/rollout_queue.py`). When a decode needs a new block and none is free, the most recently
admitted sequence is preempted: its blocks are freed and it goes back to the front of the queue,
to be recomputed (prompt and outputs so far) when memory allows; nothing is dropped (SGLang's
retract, vLLM's recompute preemption).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from rlx.engine.block_manager import BlockManager
from rlx.engine.sequence import PENDING, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """Rows of one forward pass: decode rows (one token) first, then prefill chunks."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)  # tokens each row processes
    num_decode: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def add(self, seq: Sequence, num_new: int) -> None:
        self.seqs.append(seq)
        self.num_new.append(num_new)


class Scheduler:
    def __init__(
        self, blocks: BlockManager, max_running: int, max_step_tokens: int, admission_group: int = 1
    ):
        self.blocks = blocks
        self.max_running = max_running
        self.admission_group = max(1, min(admission_group, max_running))
        self.max_step_tokens = max(max_step_tokens, max_running)  # every decode fits in a step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preempted = 0  # total, for the logs

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, behind: bool = False) -> ScheduledBatch | None:
        """The next step. `behind`: a step to launch while another is still in flight (overlap):
        sequences whose last token is still being sampled sit it out, and so does a decode that
        would need a preemption (that waits for the normal schedule); None unless prefill work is
        due, as decodes alone would split the batch into halves taking turns."""
        decode, prefill, budget = ScheduledBatch(), ScheduledBatch(), self.max_step_tokens
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            remaining = seq.num_tokens - seq.num_computed
            if behind and (  # its last token still being sampled, or a prompt done (max_new 0)
                remaining == 0
                or remaining == 1
                and (seq.token_ids[-1] == PENDING or not self.blocks.can_append_pending(seq))
            ):
                index += 1
                continue
            if remaining == 1 and not self._make_room(seq):
                continue  # seq itself was preempted; the list shifted under index
            if remaining == 1:
                decode.add(seq, 1)
                budget -= 1
            elif budget > 0:
                chunk = min(remaining, budget)
                prefill.add(seq, chunk)
                self.blocks.mark_computed(seq, seq.num_computed + chunk)
                budget -= chunk
            index += 1
        self._admit(decode, prefill, budget)
        if behind and not prefill.seqs:
            return None  # decodes alone wait for the tokens in flight, to run as one batch after
        batch = ScheduledBatch(decode.seqs + prefill.seqs, decode.num_new + prefill.num_new, len(decode.seqs))
        return batch if batch.seqs else None

    def continue_decode(self, seqs: list[Sequence]) -> ScheduledBatch | None:
        """The next decode step of `seqs` while their last tokens are still being sampled on the
        GPU (overlap): each one still running and short of max_new continues, its pending token
        given a slot. None when something else must happen first (a waiting request can be
        admitted, sequences outside `seqs` run, or a block is short and preemption may be due):
        the caller reads the step back and calls `schedule`. Requests that cannot be admitted
        (the running cap reached, or too few free blocks) would get the same decode batch from
        `schedule`, so they do not stop the overlap."""
        size, running = self.blocks.block_size, SequenceStatus.RUNNING
        live, rows, short = 0, [], []  # one pass over the rows (a decode step's hot loop)
        for s in seqs:
            if s.status is running:
                live += 1
                tokens = len(s.token_ids)
                if tokens - s.num_prompt < s.max_new:
                    rows.append(s)
                    if len(s.block_table) * size < tokens:  # its table cannot hold its tokens
                        short.append(s)
        if live < len(self.running) or self._can_admit():
            return None  # running sequences are not in `seqs`, or a request can join
        needed = sum(self.blocks.blocks_for(len(s.token_ids)) - len(s.block_table) for s in short)
        if not rows or needed > self.blocks.num_free:
            return None
        for seq in short:
            self.blocks.grow_to(seq, len(seq.token_ids))
        return ScheduledBatch(rows, [1] * len(rows), len(rows))

    def _can_admit(self) -> bool:
        """Whether the first waiting request could join the running batch now."""
        return (
            bool(self.waiting)
            and len(self.running) < self.max_running
            and self.blocks.can_allocate(self.waiting[0])
            and self._admission_open()
        )

    def _admission_open(self) -> bool:
        """Whether waiting requests may join now: nothing runs, or the free running slots hold
        the next `admission_group` of them (all of them, if fewer wait) and the free blocks hold
        their tokens (without prefix sharing) or, where the KV cache holds them back, are as
        large a share of the cache as the group is of the running slots."""
        if self.admission_group == 1 or not self.running:
            return True
        size = min(self.admission_group, len(self.waiting))
        if self.max_running - len(self.running) < size:
            return False  # the common answer while the group forms: no list built for it
        free, usable = self.blocks.num_free, self.blocks.num_blocks - 1
        if free >= usable * self.admission_group // self.max_running:
            return True
        return sum(self.blocks.blocks_for(s.num_tokens) for s in itertools.islice(self.waiting, size)) <= free

    def _admit(self, decode: ScheduledBatch, prefill: ScheduledBatch, budget: int) -> None:
        if not self.waiting or not self._admission_open():
            return
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            remaining = seq.num_tokens - seq.num_computed
            chunk = min(remaining, budget)
            (decode if remaining == 1 else prefill).add(seq, chunk)
            self.blocks.mark_computed(seq, seq.num_computed + chunk)
            budget -= chunk

    def _make_room(self, seq: Sequence) -> bool:
        """A slot for `seq`'s pending token, preempting the newest sequences if need be;
        False if `seq` itself had to go."""
        while not self.blocks.can_append_pending(seq):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.blocks.grow_to(seq, seq.num_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preempted += 1

    def finish(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
