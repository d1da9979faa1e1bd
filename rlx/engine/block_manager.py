"""Fixed-size KV blocks: allocation, reference counts, and prefix sharing by content hash.

The design is nano-vllm's (`engine/block_manager.py`): a sequence owns a block table, full
blocks are keyed by a hash chained over their tokens, and a new sequence whose prompt starts
with cached blocks takes them by reference instead of recomputing them. So the n samples of
one prompt run its prefill once. Freed blocks keep their hash until they are reused, so a
prompt seen a moment ago (or a preempted sequence coming back) can still hit.

Two rules keep shared blocks correct:
- only blocks that lie wholly before a prompt's last token are shared, so every sequence
  computes at least its last prompt token (its first logits) into a block of its own;
- a block becomes shareable when a forward pass that writes it is scheduled
  (`mark_computed`); a sharer running in that same pass reads it after it is written, because
  every layer writes the step's K/V before it attends.

Block 0 is never handed out: padded rows of a CUDA-graph batch write their K/V there.
"""

from __future__ import annotations

from collections import OrderedDict

from rlx.engine.sequence import Sequence


class BlockManager:
    """Accounting for `num_blocks` blocks of `block_size` tokens (block 0 reserved)."""

    def __init__(self, num_blocks: int, block_size: int, enable_sharing: bool = True):
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_sharing = enable_sharing
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # content hash -> block
        # the free blocks, least recently freed first (a freed block keeps its hash until reused):
        # an OrderedDict pops its first key in O(1), where a dict's next(iter()) walks over every
        # key deleted before it (a rollout of 1,024 prompts: 0.7 s of block bookkeeping)
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence can hold at most (every block but the reserved one)."""
        return (self.num_blocks - 1) * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- admission ------------------------------------------------------------------------

    def _shared_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that `seq`'s prompt starts with (none if sharing is off for it)."""
        if not self.enable_sharing or seq.wants_input_logprobs:
            return []
        hits, parent = [], 0
        for index in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
            parent = hash((parent, tokens))
            block = self.cached.get(parent)
            if block is None or self.block_tokens[block] != tokens:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether blocks for all of `seq`'s tokens (prompt, and outputs after preemption) fit."""
        hits = self._shared_prefix(seq)
        revived = sum(1 for b in hits if self.ref_count[b] == 0)  # a freed hit leaves the free set
        return self.blocks_for(seq.num_tokens) - len(hits) + revived <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, sharing its cached prefix; sets `num_computed`."""
        assert not seq.block_table
        hits = self._shared_prefix(seq)
        for block in hits:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1
        seq.block_table = hits
        seq.num_computed = seq.num_shared = len(hits) * self.block_size
        self._grow(seq, seq.num_tokens)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_for(num_tokens) - len(seq.block_table)):
            block, _ = self.free.popitem(last=False)
            if self.block_hash[block] is not None:  # reused: its old content is gone
                if self.cached.get(self.block_hash[block]) == block:
                    del self.cached[self.block_hash[block]]
                self.block_hash[block] = self.block_tokens[block] = None
            self.ref_count[block] = 1
            seq.block_table.append(block)

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Make `seq`'s full prompt blocks below `num_tokens` shareable (their K/V is being written)."""
        if not self.enable_sharing or seq.wants_input_logprobs:
            return
        parent = 0
        limit = min(num_tokens, seq.num_prompt - 1) // self.block_size
        for index in range(limit):
            block = seq.block_table[index]
            tokens = tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])
            parent = hash((parent, tokens))
            if self.block_hash[block] is None:
                self.block_hash[block], self.block_tokens[block] = parent, tokens
                self.cached.setdefault(parent, block)

    # ---- decode and release ----------------------------------------------------------------

    def can_append_pending(self, seq: Sequence) -> bool:
        """Whether every token of `seq` (the one just sampled included) has a slot or can get one."""
        return self.blocks_for(seq.num_tokens) - len(seq.block_table) <= self.num_free

    def grow_to(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks for `num_tokens` tokens of `seq` (check `can_append_pending` first)."""
        self._grow(seq, num_tokens)

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks no one holds return to the free set (hash kept)."""
        for block in reversed(seq.block_table):  # tail first: the prefix stays cached longest
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.num_computed = seq.num_shared = 0

    def forget_cached(self) -> None:
        """Drop every content hash: cached K/V is stale once the weights change or the cache
        memory was released. Blocks held by live sequences stay theirs."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks
