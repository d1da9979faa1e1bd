"""HF-named weights written as bounded safetensors shards: the weight-sync and export format.

A shard is a bucket: at most `bucket_bytes` of tensors, so neither side holds more than one
bucket beyond the model itself. The index file is HF's, so any HF loader (transformers,
SGLang's `/update_weights_from_disk`, rlx's local engine) reads the directory as-is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"


def write_weight_shards(named: Iterable[tuple[str, torch.Tensor]], out_dir: Path, bucket_bytes: int) -> int:
    """Write (name, tensor) pairs into `out_dir`; return the number of shards."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    bucket: dict[str, torch.Tensor] = {}
    size = total = num_shards = 0

    def flush() -> None:
        nonlocal bucket, size, num_shards
        if bucket:
            name = f"model-{num_shards + 1:05d}.safetensors"
            save_file(bucket, str(out_dir / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(bucket, name))
            num_shards += 1
            bucket, size = {}, 0

    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            flush()
        bucket[name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    tmp = out_dir / f".{INDEX_NAME}.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, out_dir / INDEX_NAME)  # the index appears last: its presence means complete
    return num_shards
