"""transformers' GGUF loader, made to read a file once: the one place rlx changes the `gguf` package.

transformers (5.x) loads a GGUF through `gguf.GGUFReader`, and on its legacy path (Llama among
others) it parses the whole file three times: for the config the tokenizer looks up, for the
model's config, and for its tensors; each parse walks every metadata string (a 49k-token
vocabulary and its 49k merges) through `numpy.memmap` slicing, whose subclass bookkeeping is most
of the cost. Mapping tensor names then builds gguf's `TensorNameMap` once per module of the model
(397 times for a 30-layer Llama, about 6 s on 2 cores).

Inside `read_once()`:
- `gguf.GGUFReader(path)` returns one reader per file, built by `FastGGUFReader`, which slices a
  plain `ndarray` view of the same memory map (same bytes, same dtypes; 4.4 s -> 1.6 s a parse);
- `gguf.get_tensor_name_map` is memoised (its map is only read).

transformers imports both names inside its functions (`from gguf import GGUFReader`), so they are
picked up while the context is open; both are restored on exit. Written against gguf 0.19.0
(the version `rlx[example]` pins); `GGUFReader._get` has had this signature since gguf 0.6.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import gguf
import numpy as np


class FastGGUFReader(gguf.GGUFReader):
    """gguf's reader with `_get` on a plain ndarray view of the file's memory map.

    Every field and tensor it returns holds the bytes and dtype gguf's own reader returns; they
    are plain arrays instead of `numpy.memmap` views, still backed by the mapped file.
    """

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:  # `self.data` is the first thing __init__ sets, before any _get
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


@contextlib.contextmanager
def read_once() -> Iterator[None]:
    """While open, each GGUF file is parsed once (by `FastGGUFReader`) however often it is opened."""
    stock_reader, stock_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], FastGGUFReader] = {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = FastGGUFReader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(stock_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = stock_reader, stock_name_map
