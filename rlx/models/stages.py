"""HF-named weights from every pipeline stage on every rank.

A bridge's export yields what this rank's stage holds (its layers; the embedding on the first
stage, the final norm and output layer on the last), already gathered over TP and EP inside the
stage. `gather_stages` makes the export whole: stage by stage, in pipeline order (so the names
come in the one-rank order), each stage streams its tensors to the others over the pipeline
group, one tensor at a time: every rank holds at most one tensor beyond its model.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

_END = None  # the header that closes a stage's stream


def as_chunks(model: torch.nn.Module | list[torch.nn.Module]) -> list[torch.nn.Module]:
    """A model, or a rank's list of virtual-stage chunks, as a list."""
    return list(model) if isinstance(model, list | tuple) else [model]


def gather_stages(
    chunks: list[Iterable[tuple[str, torch.Tensor]]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's (HF name, tensor) pairs, in pipeline order, on every pipeline rank.

    `chunks`: this rank's export per model chunk (one, or one per virtual stage: chunk c of
    stage s holds virtual stage c * PP + s, so the order is chunk by chunk, stage by stage).
    A collective over the pipeline group (and, through the exports, whatever groups a stage's
    export uses): every rank must consume the iterator to the end, in step. With one stage it
    yields the chunks' pairs as they come.
    """
    from megatron.core import parallel_state as ps

    num_stages = ps.get_pipeline_model_parallel_world_size()
    if num_stages == 1:
        for named in chunks:
            yield from named
        return
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    own = ps.get_pipeline_model_parallel_rank()
    device = _device()
    for named in chunks:
        for stage in range(num_stages):
            if stage == own:
                for name, tensor in named:
                    _send_header((name, tuple(tensor.shape), tensor.dtype), ranks[stage], group)
                    dist.broadcast(tensor.to(device).contiguous(), src=ranks[stage], group=group)
                    yield name, tensor
                _send_header(_END, ranks[stage], group)
                continue
            while (header := _send_header(None, ranks[stage], group)) is not _END:
                name, shape, dtype = header
                tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(tensor, src=ranks[stage], group=group)
                yield name, tensor


def _send_header(header, src: int, group) -> tuple | None:
    """Broadcast a small picklable header from global rank `src`; every rank returns it."""
    box = [header]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _device() -> torch.device:
    """Where collectives over the default backend take tensors: the GPU under NCCL."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
