"""rlx.engine.memory_saver on CUDA: an arena's memory is given back at `release` and mapped again
at the same addresses at `resume`, a CUDA graph over its tensors replays correctly after that,
and the memory and addresses go back to the driver once the arena and its tensors are gone.
Skipped without a GPU."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MIB = 1 << 20


def free_bytes() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def test_release_gives_the_memory_back_and_resume_maps_it_at_the_same_addresses():
    from rlx.engine.memory_saver import Arena, supported

    device = torch.device("cuda", torch.cuda.current_device())
    assert supported(device)
    start = free_bytes()
    arena = Arena(256 * MIB, device)
    assert start - free_bytes() >= 256 * MIB
    weight = arena.take((1024, 1024), torch.float32)
    cache = arena.take((3, 1000), torch.bfloat16)
    assert weight.data_ptr() == arena.address and cache.data_ptr() % 256 == 0
    with pytest.raises(ValueError, match="the arena holds"):
        arena.take((arena.num_bytes,), torch.uint8)

    g = torch.Generator(device=device).manual_seed(0)
    weight_value = torch.randn(1024, 1024, device=device, generator=g)
    x = torch.randn(16, 1024, device=device, generator=g)
    weight.copy_(weight_value)
    cache.fill_(2.0)
    y = torch.empty(16, 1024, device=device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up off the capture
        torch.matmul(x, weight, out=y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.matmul(x, weight, out=y)
        y.add_(cache[0, :16, None].float())
    expected = x @ weight_value + 2.0

    pointers, before = (weight.data_ptr(), cache.data_ptr()), free_bytes()
    arena.release()
    assert arena.released and free_bytes() - before >= 256 * MIB
    taken = torch.full((256 * MIB,), 7, dtype=torch.uint8, device=device)  # the memory, used meanwhile
    del taken
    free_bytes()
    arena.resume()
    assert not arena.released and (weight.data_ptr(), cache.data_ptr()) == pointers
    weight.copy_(weight_value)  # uninitialized after a resume: the owner writes it again
    cache.fill_(2.0)
    graph.replay()
    torch.testing.assert_close(y, expected)


def test_the_memory_and_addresses_are_freed_with_the_last_tensor():
    from rlx.engine.memory_saver import Arena

    device = torch.device("cuda", torch.cuda.current_device())
    start = free_bytes()
    arena = Arena(512 * MIB, device)
    kept = arena.take((4, MIB), torch.float32)
    kept.fill_(3.0)
    del arena
    gc.collect()
    assert start - free_bytes() >= 512 * MIB  # a tensor still uses it
    assert kept.sum().item() == 4 * MIB * 3.0
    del kept
    gc.collect()
    assert abs(start - free_bytes()) <= 16 * MIB


def test_memory_the_gpu_lacks_is_refused_with_the_size_and_what_is_free():
    from rlx.engine.memory_saver import Arena

    device = torch.device("cuda", torch.cuda.current_device())
    start = free_bytes()
    too_much = 2 * torch.cuda.get_device_properties(device).total_memory
    with pytest.raises(
        RuntimeError,
        match=r"could not map .* GiB at the engine's reserved addresses .* GiB free\): cuMemCreate failed",
    ):
        Arena(too_much, device)
    gc.collect()
    assert abs(start - free_bytes()) <= 16 * MIB  # what was mapped before the failure, given back
