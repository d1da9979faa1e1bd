"""Decode steps replayed from CUDA graphs, one graph per batch size in a ladder up to
`cuda_graph_max_bs`; a batch is padded up to the next captured size.

An eager decode step of a 28-layer model launches hundreds of small kernels and is bound by
launch latency (about 15 us each on the H200); a graph replays them in one launch. The graphs
bake in the addresses of the weights and the KV cache: weights are loaded in place, and after
a memory release/resume moved either, the graphs are captured again before the next replay.
Padded rows read and write the reserved block 0 only.
"""

from __future__ import annotations

import torch

from rlx.engine.attention import AttentionMetadata


def batch_size_ladder(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    return sorted(set(sizes + [max_bs]))


class DecodeGraphs:
    def __init__(self, model, kv_cache, max_bs: int, max_blocks: int, device: torch.device):
        self.model, self.kv_cache = model, kv_cache
        self.sizes = batch_size_ladder(max_bs)
        self.max_bs = self.sizes[-1]
        long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(self.max_bs, **long)
        self.positions = torch.zeros(self.max_bs, **long)
        self.slot_block = torch.zeros(self.max_bs, **long)
        self.slot_offset = torch.zeros(self.max_bs, **long)
        self.tables = torch.zeros(self.max_bs, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(self.max_bs, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pointers: list[int] = []

    def _forward(self, bs: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_block=self.slot_block[:bs],
            slot_offset=self.slot_offset[:bs],
            num_decode=bs,
            decode_block_tables=self.tables[:bs],
            decode_context_lens=self.context_lens[:bs],
            use_decode_kernel=True,
        )
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_cache, meta)
        return self.model.logits(hidden)

    def _current_pointers(self) -> list[int]:
        return [self.kv_cache.data.data_ptr(), *(p.data_ptr() for p in self.model.parameters())]

    @torch.inference_mode()
    def capture(self) -> None:
        self.graphs.clear()
        torch.cuda.synchronize()
        pool = None
        for bs in reversed(self.sizes):  # largest first: smaller graphs fit in its pool
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(bs)  # warm-up: compiles kernels, settles allocations
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = (graph, logits)
        torch.cuda.synchronize()
        self.pointers = self._current_pointers()

    def clear(self) -> None:
        self.graphs.clear()
        self.pointers = []

    def can_run(self, num_rows: int) -> bool:
        return num_rows <= self.max_bs

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [rows, V] of a decode-only step."""
        if not self.graphs or self._current_pointers() != self.pointers:
            self.capture()
        rows = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= rows)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slot_block[:rows].copy_(meta.slot_block)
        self.slot_offset[:rows].copy_(meta.slot_offset)
        self.tables[:rows, :width].copy_(meta.decode_block_tables)
        self.context_lens[:rows].copy_(meta.decode_context_lens)
        if size > rows:  # padded rows: token 0 at position 0 in block 0
            for buffer in (self.input_ids, self.positions, self.slot_block, self.slot_offset):
                buffer[rows:size].zero_()
            self.tables[rows:size, 0].zero_()
            self.context_lens[rows:size].fill_(1)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:rows]
