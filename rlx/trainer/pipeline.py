"""What pipeline parallelism adds to the trainer: model chunks per virtual stage, and results
made on the last stage, shared with all.

Virtual pipeline stages (megatron's interleaved schedule) are set as Megatron-LM sets them, by
TransformerConfig's `virtual_pipeline_model_parallel_size`, here
`model.megatron_overrides.virtual_pipeline_model_parallel_size`: each rank then holds that many
model chunks (chunk c of stage s holds the layers of virtual stage c * PP + s).

Megatron's schedules run the loss function on the last pipeline stage only, so per-token
outputs (log-probs, entropies, values) and loss metrics exist there alone. These helpers
broadcast them over the pipeline group (one rank per stage, same TP and DP rank), so every rank
(and the driver, which reads global rank 0: the first stage) gets them. With one stage they
return their input unchanged and communicate nothing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlx.trainer.logits_layout import batch_first_logits

VIRTUAL_STAGES_KEY = "virtual_pipeline_model_parallel_size"  # in model.megatron_overrides


def virtual_stages(megatron_overrides: dict) -> int | None:
    """Model chunks per rank the config asks for (None: one, the plain 1F1B schedule)."""
    return megatron_overrides.get(VIRTUAL_STAGES_KEY)


def build_chunks(family, hf_dir: str | Path, params_dtype: torch.dtype, device: torch.device) -> list:
    """This rank's model chunks (one per virtual stage, else one), built on `device` and loaded
    from the HF checkpoint `hf_dir`."""
    from megatron.core import parallel_state

    num_chunks = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for vp_stage in range(num_chunks) if num_chunks else [None]:
        # Megatron builds linear layers on the current device but torch norms on the CPU;
        # Megatron-LM's get_model moves the whole model afterwards, and so do we.
        chunk = family.build_model(params_dtype=params_dtype, vp_stage=vp_stage).to(device)
        family.load_hf_weights(chunk, hf_dir)
        batch_first_logits(chunk)  # logits never copied to batch-first (rlx.trainer.logits_layout)
        chunks.append(chunk)
    return chunks


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
