"""Decode steps captured in CUDA graphs, one graph per batch size in a ladder, sampler included.

An eager decode step of a 28-layer model launches hundreds of small kernels and is bound by
launch latency (about 15 us each on the H200); a graph replays them in one launch. Each graph
runs the forward, the LM head and the fused sampler (`triton_sample`), so a step costs the
host three copies in (ids/positions/sampling keys, 1/T, block tables, from pinned buffers
that `host_rows.HostRows` fills), one replay, and one copy out (tokens and logprobs). The
KV slots and context lengths are derived from positions and block tables inside the graph.

The graphs bake in the addresses of the weights and the KV cache: weights are loaded in
place, and a memory release keeps the addresses with the memory saver (`memory_saver`, on for
colocated engines), so the graphs stay; without it a release clears them. A batch size is
captured when a decode step first needs it, so a rollout captures only the sizes it runs. Once
the graphs have been cleared they live one rollout, and a step replays a captured graph of up to
twice its rows (`graph_size`) rather than capture a new one: as the rollout's sequences finish,
its batch shrinks through the ladder's sizes, and a capture (a warm-up step, the capture, an
instantiation) takes about 45 ms on the Qwen3-1.7B shape, where a padded row costs a step
almost nothing (the weights are read once whatever the rows; its attention reads one block).
An engine whose graphs are never cleared (split, or the memory saver) captures each ladder size.
Measured (docs/benchmarks.md, `bench/rollout_throughput.py --varlen`): 128 sequences of 16-512
tokens after a release, 12 captures and 2.51 s against 7 and 2.31 s; warm, 1.94 s exact against
1.98 s padded. Padded rows read and write the reserved block 0 only.
"""

from __future__ import annotations

import time

import torch

from rlx.engine.attention import AttentionMetadata
from rlx.engine.host_rows import GREEDY, IDS, POSITIONS, SEEDS, SOURCES, STEPS, HostRows
from rlx.engine.models.layers import small_gemms_in_graphs
from rlx.engine.sequence import Sequence


def batch_size_ladder(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    return sorted(set(sizes + [max_bs]))


PAD_FACTOR = 2.0  # a step replays a captured graph of at most this many times its rows


def graph_size(rows: int, ladder: list[int], captured, pad_factor: float = PAD_FACTOR) -> int:
    """The graph a decode step of `rows` rows replays: the smallest captured size from `rows` up
    to `pad_factor` × `rows`, else the smallest ladder size that holds them (to be captured)."""
    reusable = [size for size in captured if rows <= size <= pad_factor * rows]
    return min(reusable) if reusable else next(s for s in ladder if s >= rows)


class DecodeGraphs:
    def __init__(self, model, kv_cache, max_bs: int, max_blocks: int, device: torch.device):
        self.model, self.kv_cache, self.block_size = model, kv_cache, kv_cache.block_size
        self.sizes = batch_size_ladder(max_bs)
        self.max_bs = self.sizes[-1]
        # host side, two sets: with overlap, step k+1 is filled while step k's copies may still
        # be queued; step k-1's, which used the other set, have completed (read back)
        self.host = [HostRows(self.max_bs, max_blocks), HostRows(self.max_bs, max_blocks)]
        self.host_out = torch.zeros(2, 2, self.max_bs, dtype=torch.float32, pin_memory=True)
        self.ready = [torch.cuda.Event(), torch.cuda.Event()]
        self.turn = 0
        self.ints = torch.zeros_like(self.host[0].ints, device=device)
        self.inv_t = torch.ones_like(self.host[0].inv_t, device=device)
        self.tables = torch.zeros_like(self.host[0].tables, device=device)
        self.out = torch.zeros_like(self.host_out[0], device=device)  # [token, logprob] per row
        # every graph's logits, in one buffer (a graph's own output would outlive its capture, and
        # the ladder's add up: 10.1 GB to 1,024 rows at Qwen3's vocabulary, against 0.31 here)
        head = model.lm_head.weight
        self.logits = torch.empty(self.max_bs, head.shape[0], dtype=head.dtype, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None  # the memory pool every graph shares (one replays at a time)
        # the captures' warm-ups, on one stream: cuBLAS keeps a workspace (32 MiB on Hopper) for
        # each stream it has run on, for the process's life, and a new torch Stream each capture
        # cycled through torch's pool of 32, 1 GiB of workspaces (1xH200)
        self.warm_up_stream = torch.cuda.Stream(device)
        self.capture_s, self.num_captured = 0.0, 0  # seconds spent capturing, graphs captured
        self.pad_factor = 1.0  # exact ladder sizes until a release clears the graphs (`clear`)

    def _forward(self, bs: int) -> torch.Tensor:
        from rlx.engine.triton_sample import fused_sample

        positions, tables = self.ints[POSITIONS, :bs], self.tables[:bs]
        meta = AttentionMetadata(
            slot_block=tables.gather(1, (positions // self.block_size)[:, None].int())[:, 0].long(),
            slot_offset=positions % self.block_size,
            num_decode=bs,
            decode_block_tables=tables,
            decode_context_lens=(positions + 1).int(),
            use_decode_kernel=True,
        )
        ints = self.ints[:, :bs]
        sources = ints[SOURCES]
        from_device = self.out[0, sources.clamp(min=0)].long()  # the previous replay's tokens
        input_ids = torch.where(sources >= 0, from_device, ints[IDS])
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        logits = self.model.logits(hidden, out=self.logits[:bs])
        fused_sample(
            logits,
            self.inv_t[:bs],
            ints[GREEDY],
            ints[SEEDS],
            ints[STEPS],
            self.out[0, :bs],
            self.out[1, :bs],
        )
        return logits

    @torch.inference_mode()
    def capture(self, sizes: list[int] | None = None) -> None:
        """Capture the graphs of `sizes` (default: the whole ladder) into the shared pool. Decode
        captures each size the first time a step needs it, so a rollout after a memory release
        (which clears the graphs) pays for the sizes it uses, not for the ladder."""
        start = time.perf_counter()
        torch.cuda.synchronize()
        # each warm-up really runs: point it at block 0 and keep the last step's sampled tokens,
        # which the next step reads its inputs from
        last_out = self.out.clone()
        self.ints.zero_()
        self.tables.zero_()
        self.inv_t.fill_(1.0)
        sizes = sorted(set(sizes or self.sizes) - set(self.graphs), reverse=True)
        stream = self.warm_up_stream
        for bs in sizes:  # largest first within a call: smaller graphs fit in its pool
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), small_gemms_in_graphs():
                self._forward(bs)  # warm-up: compiles kernels, settles allocations
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool), small_gemms_in_graphs():
                logits = self._forward(bs)
            self.pool = graph.pool()
            self.graphs[bs] = (graph, logits)  # a view of self.logits
        self.out.copy_(last_out)
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - start
        self.num_captured += len(sizes)

    def clear(self) -> None:
        """Drop every graph (a memory release): from now on graphs last one rollout, so steps pad
        to a captured graph of up to `PAD_FACTOR` times their rows rather than capture (module)."""
        self.graphs.clear()
        self.pool = None
        self.pad_factor = PAD_FACTOR

    def can_run(self, num_rows: int) -> bool:
        return num_rows <= self.max_bs

    def run(self, seqs: list[Sequence], sources: list[int]) -> torch.Tensor:
        """Launch a decode step of `seqs` (one pending token each; `sources[i]` the row of the
        previous step that samples row i's input when that token is PENDING); returns the
        logits [size, V]. The sampled tokens and logprobs land in `self.out`."""
        rows = len(seqs)
        size = graph_size(rows, self.sizes, self.graphs, self.pad_factor)
        if size not in self.graphs:
            self.capture([size])
        self.turn ^= 1
        host = self.host[self.turn]
        host.fill(seqs, sources, size)
        self.ints[:, :size].copy_(host.ints[:, :size], non_blocking=True)
        self.inv_t[:size].copy_(host.inv_t[:size], non_blocking=True)
        self.tables[:size].copy_(host.tables[:size], non_blocking=True)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits

    def read_async(self, rows: int) -> tuple[int, int]:
        """Queue the copy of the last step's [tokens, logprobs] to the host; `collect` waits."""
        self.host_out[self.turn].copy_(self.out, non_blocking=True)  # 2 KB: cheaper whole than sliced
        self.ready[self.turn].record()
        return self.turn, rows

    def collect(self, handle: tuple[int, int]) -> list[list[float]]:
        """[tokens, logprobs] of the step `handle` names: the step's one sync."""
        turn, rows = handle
        self.ready[turn].synchronize()
        return self.host_out[turn, :, :rows].tolist()
