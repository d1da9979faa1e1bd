"""Device memory given back and taken again at the same addresses (CUDA virtual memory management).

A colocated engine releases its weights and KV cache for the trainer between rollouts. Freed
and allocated again through torch's allocator they come back elsewhere, and the decode CUDA
graphs, which bake in their addresses, must be captured again in every rollout (about 45 ms a
batch size on the Qwen3-1.7B shape). SGLang keeps the addresses with torch_memory_saver (an
allocator hook in C++); rlx does the same with the CUDA driver's virtual memory calls through
ctypes, nothing to build: an `Arena` reserves a range of addresses once, maps physical memory
into it, and `release` unmaps and frees the physical memory while the addresses stay reserved.
`resume` maps new memory (uninitialized) at the same addresses, and every tensor carved out of
the arena (`take`) is valid again. A tensor of a released arena must not be touched: the
engine refuses work until it resumes.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch

_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_ON_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_ALIGN = 256  # each tensor's offset in the arena (cudaMalloc's alignment)
# physical memory is created in pieces of at most this many bytes: a 60 GiB arena resumed in 8 ms
# in pieces of 1 GiB, 53 ms in 4 GiB, 175 ms in one piece (1xH200, fastest of 3, .device one-off)
_CHUNK = 1 << 30


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, call: str) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{call} failed: CUDA error {result} ({(text.value or b'?').decode()})")


def _prop(device: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type, prop.location.type, prop.location.id = _PINNED, _ON_DEVICE, device
    return prop


def supported(device: torch.device) -> bool:
    """Whether this process's driver maps virtual memory on CUDA device `device`."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _supported(index: int) -> bool:
    try:
        cuda = _driver()
    except OSError:
        return False
    torch.cuda.init()
    value = ctypes.c_int()
    attribute = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    return cuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, index) == 0 and value.value == 1


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _size(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    size = dtype.itemsize
    for dim in shape:
        size *= dim
    return size


class _Span:
    """A device address range as a CUDA array, which `torch.as_tensor` wraps without copying;
    the tensor's storage holds the span until the storage is freed."""

    def __init__(self, address: int, num_bytes: int):
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,
        }


def _unmap(address: int, chunk: int, num_bytes: int, handles: list[int], check: bool = True) -> None:
    """Unmap and free the pieces mapped at `address` (one handle a `chunk`), as they were mapped."""
    cuda = _driver()
    for index, handle in enumerate(handles):
        at = ctypes.c_uint64(address + index * chunk)
        size = ctypes.c_size_t(min(chunk, num_bytes - index * chunk))
        results = (cuda.cuMemUnmap(at, size), cuda.cuMemRelease(ctypes.c_uint64(handle)))
        if check:
            _check(results[0], "cuMemUnmap")
            _check(results[1], "cuMemRelease")
    handles.clear()


def _free(device: torch.device, address: int, chunk: int, num_bytes: int, handles: list[int]) -> None:
    """When the last tensor of an arena is gone: its memory and its addresses given back."""
    torch.cuda.synchronize(device)
    _unmap(address, chunk, num_bytes, handles, check=False)
    _driver().cuMemAddressFree(ctypes.c_uint64(address), ctypes.c_size_t(num_bytes))


class Arena:
    """`num_bytes` of device memory at fixed addresses on `device`, mapped from the start;
    tensors are carved out of it in order with `take`. The memory and the addresses are given
    back when the arena and every tensor taken from it are gone."""

    def __init__(self, num_bytes: int, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        torch.cuda.synchronize(self.device)  # the primary context is current on this thread
        cuda, granularity, prop = _driver(), ctypes.c_size_t(), _prop(index)
        _check(cuda.cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(prop), 0), "cuMemGetAllocationGranularity")  # fmt: skip
        step = granularity.value
        self.num_bytes = max(-(-num_bytes // step) * step, step)
        self._chunk = max(_CHUNK // step, 1) * step
        address = ctypes.c_uint64()
        _check(cuda.cuMemAddressReserve(ctypes.byref(address), ctypes.c_size_t(self.num_bytes), ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0)), "cuMemAddressReserve")  # fmt: skip
        self.address = address.value
        self._handles: list[int] = []  # one a mapped piece; emptied, never replaced (`_free` holds it)
        self._used = 0
        span = _Span(self.address, self.num_bytes)
        free = weakref.finalize(
            span, _free, self.device, self.address, self._chunk, self.num_bytes, self._handles
        )
        free.atexit = False  # at exit the driver frees everything, and may be gone already
        self._whole = torch.as_tensor(span, device=self.device)
        self.resume()

    @classmethod
    def holding(
        cls, specs: list[tuple[tuple[int, ...] | torch.Size, torch.dtype]], device: torch.device
    ) -> tuple[Arena, list[torch.Tensor]]:
        """An arena just large enough for tensors of these (shape, dtype), and the tensors."""
        num_bytes = 0
        for shape, dtype in specs:
            num_bytes = _aligned(num_bytes) + _size(shape, dtype)
        arena = cls(num_bytes, device)
        return arena, [arena.take(shape, dtype) for shape, dtype in specs]

    @property
    def released(self) -> bool:
        return not self._handles

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The next `shape` x `dtype` tensor of the arena (its contents: whatever was there)."""
        start, size = _aligned(self._used), _size(shape, dtype)
        if start + size > self.num_bytes:
            raise ValueError(f"the arena holds {self.num_bytes} bytes; {start + size} asked for")
        self._used = start + size
        return self._whole[start : start + size].view(dtype).view(shape)

    def release(self) -> None:
        """Give the physical memory back; the addresses stay reserved (their tensors dangle)."""
        if not self.released:
            torch.cuda.synchronize(self.device)
            _unmap(self.address, self._chunk, self.num_bytes, self._handles)

    def resume(self) -> None:
        """Map new physical memory (uninitialized) at the arena's addresses."""
        if not self.released:
            return
        cuda, prop = _driver(), _prop(self.device.index)
        try:
            for offset in range(0, self.num_bytes, self._chunk):
                size = ctypes.c_size_t(min(self._chunk, self.num_bytes - offset))
                handle = ctypes.c_uint64()
                _check(cuda.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), ctypes.c_uint64(0)), "cuMemCreate")  # fmt: skip
                self._handles.append(handle.value)
                at = ctypes.c_uint64(self.address + offset)
                _check(cuda.cuMemMap(at, size, ctypes.c_size_t(0), handle, ctypes.c_uint64(0)), "cuMemMap")
        except RuntimeError as e:  # out of memory: what was mapped, given back
            _unmap(self.address, self._chunk, self.num_bytes, self._handles, check=False)
            free = torch.cuda.mem_get_info(self.device)[0]
            raise RuntimeError(
                f"could not map {self.num_bytes / 2**30:.2f} GiB at the engine's reserved addresses on "
                f"{self.device} ({free / 2**30:.2f} GiB free): {e}"
            ) from e
        access = _AccessDesc()
        access.location.type, access.location.id, access.flags = _ON_DEVICE, self.device.index, _READ_WRITE
        address, size = ctypes.c_uint64(self.address), ctypes.c_size_t(self.num_bytes)
        _check(cuda.cuMemSetAccess(address, size, ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
