"""What pipeline parallelism adds to the trainer: results made on the last stage, shared with all.

Megatron's schedules run the loss function on the last pipeline stage only, so per-token
outputs (log-probs, entropies, values) and loss metrics exist there alone. These helpers
broadcast them over the pipeline group (one rank per stage, same TP and DP rank), so every rank
(and the driver, which reads global rank 0: the first stage) gets them. With one stage they
return their input unchanged and communicate nothing.
"""

from __future__ import annotations

import torch


def num_stages() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_world_size()


def is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()


def broadcast_rows(
    rows: list[torch.Tensor] | None, shapes: list[tuple[int, ...]], device: torch.device
) -> list[torch.Tensor]:
    """The last stage's fp32 `rows` (one tensor per entry of `shapes`) on every stage.

    Other stages pass `rows=None` and know the shapes from the micro-batches they also built;
    everything travels as one flat tensor (one collective for a whole forward-only pass).
    """
    from megatron.core import parallel_state

    if num_stages() == 1:
        return rows
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    if is_last_stage():
        flat = torch.cat([r.reshape(-1).float() for r in rows]).to(device)
    else:
        flat = torch.empty(sum(sizes), dtype=torch.float32, device=device)
    torch.distributed.broadcast(
        flat,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]


def broadcast_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The last stage's metric dict on every stage (the others pass anything, e.g. {})."""
    from megatron.core import parallel_state

    if num_stages() == 1:
        return metrics
    box = [metrics if is_last_stage() else None]
    torch.distributed.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]
