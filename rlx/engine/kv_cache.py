"""The paged KV cache tensors: one allocation for all layers, sized from the memory budget.

Layout [layer, k|v, block, kv_head, slot, head_dim]: one (block, kv head) is a contiguous
block_size x head_dim tile, which is what the decode kernel streams. One tensor (not one
per layer) so that release and resume are a single free and a single allocation. With
`keep_addresses` (the engine's memory saver) the tensor lives in a `memory_saver.Arena`: a
release unmaps its memory and a resume maps new memory at the same addresses, so the decode
CUDA graphs, which bake them in, stay valid.

`zeroed`: the memory is zeroed when allocated and at every resume, for the attention paths
that read a block's unwritten slots (gather + SDPA: a masked slot still meets V in a matmul,
and 0 x NaN is NaN). The GPU's bf16/fp16 paths read written slots only (the decode kernel
masks its loads; flash prefill gathers each row's own keys), so there the engine leaves the
memory as allocated: zeroing a cache of 100 GB took tens of milliseconds of every hand-over.
"""

from __future__ import annotations

import torch


class KVCache:
    """K and V for `num_blocks` blocks of `block_size` tokens in every layer."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        keep_addresses: bool = False,
        zeroed: bool = True,
    ):
        self.shape = (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)
        self.dtype, self.device = dtype, device
        self.num_blocks, self.block_size = num_blocks, block_size
        self.arena, self.data, self.zeroed = None, None, zeroed
        if keep_addresses:
            from rlx.engine.memory_saver import Arena

            self.arena, (self.data,) = Arena.holding([(self.shape, dtype)], device)
            if zeroed:
                self.data.zero_()
        else:
            self.resume()

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * block_size * dtype.itemsize

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert not self.released, "KV cache is released"
        return self.data[index, 0], self.data[index, 1]

    @property
    def released(self) -> bool:
        return self.data is None or (self.arena is not None and self.arena.released)

    def release(self) -> None:
        """Free the memory (the caller empties the allocator's cache to hand it back); an
        arena's tensor stays, to be valid again at `resume`."""
        if self.arena is not None:
            self.arena.release()
        else:
            self.data = None

    def resume(self) -> None:
        if not self.released:
            return
        if self.arena is None:
            allocate = torch.zeros if self.zeroed else torch.empty
            self.data = allocate(self.shape, dtype=self.dtype, device=self.device)
            return
        self.arena.resume()
        if self.zeroed:
            self.data.zero_()


def num_blocks_for_budget(
    budget_bytes: int, bytes_per_block: int, block_size: int, max_total_tokens: int | None, most_useful: int
) -> int:
    """Blocks the budget holds, capped by `max_total_tokens` and by what could ever be used."""
    num_blocks = budget_bytes // bytes_per_block
    if max_total_tokens is not None:
        num_blocks = min(num_blocks, -(-max_total_tokens // block_size))
    return max(min(num_blocks, most_useful) + 1, 2)  # + the reserved padding block
