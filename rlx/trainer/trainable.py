"""What the policy and PPO's critic share: `Trainable`, a built megatron model wrapped in DDP with
its own optimizer and learning-rate schedule, whose forward-only passes and optimizer steps run
micro-batches through megatron's schedule; distributed checkpoints of model + optimizer; sums
over data-parallel ranks.

Each model gets its own `TransformerConfig` from `build_model`, so the schedule hooks set here
(grad sync, loss scaling) are per model: two trainable models live side by side in one rank.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlx.compat import megatron_distrib_optimizer
from rlx.errors import ConfigError
from rlx.sample import Sample
from rlx.trainer.adam import choose_adam_kernel
from rlx.trainer.batch import (
    MicroBatch,
    make_micro_batch,
    make_packed_micro_batch,
    num_loss_tokens,
    num_tokens,
    pack,
    split,
    widen,
)
from rlx.trainer.config import TrainConfig
from rlx.trainer.offload import Offloader, sub_optimizers
from rlx.trainer.pipeline import broadcast_metrics, broadcast_rows, is_last_stage
from rlx.trainer.schedule import lr_factor

_NUM_UPDATES = "num_updates"  # kept in the checkpoint: the LR schedule continues after a resume
_LORA = "lora"  # the LoRA settings a checkpoint's adapters were made with (None: a full model)


class Trainable:
    """One trainable model on this rank: forward-only passes and optimizer steps over the whole
    rollout batch, each data-parallel rank taking its shard of every global batch.

    The model is this rank's list of chunks: one, or one per virtual pipeline stage (megatron's
    interleaved schedule), each in its own megatron DDP, under one optimizer.

    `forward_step(mode, num_microbatches, data_iterator, model)` is the owner's megatron forward
    step; its loss function reads each micro-batch's global counts, `MicroBatch.num_global_*`.
    The learning rate follows `rlx.trainer.schedule` from `peak_lr` over `total_steps` updates.
    `lora`: the settings the chunks' adapters were made with (`rlx.lora.apply`), or None.
    """

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        cfg: TrainConfig,
        *,
        peak_lr: float,
        total_steps: int,
        params_dtype: torch.dtype,
        forward_step: Callable,
        device: torch.device,
        pad_multiple: int,
        fuse_wgrad: bool = False,
        lora: dict | None = None,
    ):
        from megatron.core import parallel_state

        self.chunks, self.optimizer = wrap_for_training(chunks, cfg, peak_lr, params_dtype, fuse_wgrad)
        self.cfg, self.peak_lr, self.total_steps = cfg, peak_lr, total_steps
        self.forward_step, self.device, self.pad_multiple = forward_step, device, pad_multiple
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.num_updates = 0
        # the chunks' LoRA settings (rlx.lora): checkpoints then hold the adapters only; None: all
        self.lora = lora
        # colocated GPUs: yield to the engines (the optimizer state goes with the first chunk)
        self.offloaders = [
            Offloader(c, self.optimizer if i == 0 else None) for i, c in enumerate(self.chunks)
        ]

    @property
    def model(self) -> torch.nn.Module:
        """The first model chunk (the whole model without virtual pipeline stages), megatron DDP."""
        return self.chunks[0]

    def local_indices(self, num_samples: int) -> list[int]:
        """This DP rank's samples of a rollout batch of `num_samples`, global batch by global batch."""
        return [i for step in self.global_batches(num_samples) for i in step[self.dp_rank :: self.dp_size]]

    def global_batches(self, num_samples: int) -> list[list[int]]:
        """The indices of a rollout batch of `num_samples`, one list per optimizer step."""
        return split(list(range(num_samples)), self.cfg.global_batch_size)

    @torch.no_grad()
    def forward_only(
        self, samples: list[Sample], mode: str, key: str, chunks: list[torch.nn.Module] | None = None
    ) -> list[torch.Tensor]:
        """Per-sample [response_len] rows of the loss function's `key` output in `mode`, under
        the model `chunks` (default: this one's; the policy's frozen reference runs through the
        same steps).

        All micro-batches go through one schedule call (pipelined under PP); the last stage's
        outputs are broadcast, so every pipeline stage returns them."""
        chunks = chunks if chunks is not None else self.chunks
        for chunk in chunks:
            chunk.eval()
        # sample indices per micro-batch
        members = self.micro_batches(samples, range(len(samples)), forward_only=True)
        mbs = self.same_shape(
            [self.make_micro_batch([samples[i] for i in indices], {}) for indices in members]
        )
        results = run_schedule(chunks, partial(self.forward_step, mode), mbs, forward_only=True)
        shapes = [tuple(mb.mask_BT.shape) for mb in mbs]
        rows = broadcast_rows([r[key] for r in results] if is_last_stage() else None, shapes, self.device)
        out: list[torch.Tensor | None] = [None] * len(samples)
        for indices, rows_BT in zip(members, rows, strict=True):  # packing reorders: back to batch order
            rows_BT = rows_BT.cpu()  # one copy a micro-batch: a copy a row would wait on the GPU each
            for i, row in zip(indices, rows_BT, strict=True):
                out[i] = row[: samples[i].response_len]
        return out

    def micro_batches(self, samples: list[Sample], indices, forward_only: bool = False) -> list[list[int]]:
        """`indices` (into `samples`) in micro-batches: packed by the token budget
        `train.max_tokens_per_micro_batch`, else consecutive runs of `train.micro_batch_size`
        (`forward_only`: `train.logprob_*` where set)."""
        indices, cfg = list(indices), self.cfg
        size, budget_key = cfg.micro_batch_size, "max_tokens_per_micro_batch"
        if forward_only:
            size = cfg.logprob_micro_batch_size or size
            if cfg.logprob_max_tokens_per_micro_batch is not None:
                budget_key = "logprob_max_tokens_per_micro_batch"
        budget = getattr(cfg, budget_key)
        if budget is None:
            return split(indices, size)
        try:
            bins = pack([num_tokens(samples[i]) for i in indices], budget)
        except ValueError:
            longest = max(indices, key=lambda i: num_tokens(samples[i]))
            s = samples[longest]
            raise ConfigError(
                f"train.{budget_key}={budget}: sample {longest} of the batch (group {s.group}, "
                f"index {s.index}) has {num_tokens(s)} tokens ({len(s.prompt_ids)} prompt + {s.response_len} "
                f"response) and fits in no micro-batch; set train.{budget_key} >= {num_tokens(s)}"
            ) from None
        return [[indices[j] for j in bin_] for bin_ in bins]

    def same_shape(self, mbs: list[MicroBatch]) -> list[MicroBatch]:
        """`mbs` as they are, or, with several model chunks (the interleaved schedule, which
        exchanges activations of one fixed shape), each widened to the widest."""
        if len(self.chunks) == 1:
            return mbs
        width_L = max(mb.tokens_BL.shape[1] for mb in mbs)
        return [widen(mb, width_L) for mb in mbs]

    def make_micro_batch(self, samples: list[Sample], extras: dict[str, list], **counts) -> MicroBatch:
        """`samples` as one micro-batch on this rank's device: packed into one row when
        `train.max_tokens_per_micro_batch` is set, else padded rows."""
        make = make_packed_micro_batch if self.cfg.max_tokens_per_micro_batch else make_micro_batch
        return make(samples, extras, self.pad_multiple, **counts).to(self.device)

    def train(self, samples: list[Sample], extras: dict[str, list[torch.Tensor]]) -> dict[str, float]:
        """One optimizer step per global batch of the rollout batch (`train.num_steps_per_rollout`),
        forward step in mode "train"; `extras` are per-sample per-token inputs of the loss, in
        batch order. Returns the loss metrics averaged over steps, "grad_norm" and "lr"."""
        for chunk in self.chunks:
            chunk.train()
        steps = self.global_batches(len(samples))
        sums: dict[str, float] = {}
        grad_norms = []
        for step in steps:
            counts = {
                "num_global_tokens": sum(num_loss_tokens(samples[i]) for i in step),
                "num_global_samples": len(step),
            }
            mbs = [
                self.make_micro_batch(
                    [samples[i] for i in chunk],
                    {key: [values[i] for i in chunk] for key, values in extras.items()},
                    **counts,
                )
                for chunk in self.micro_batches(samples, step[self.dp_rank :: self.dp_size])
            ]
            mbs = self.same_shape(mbs)
            lr = self.peak_lr * lr_factor(self.num_updates, self.cfg, self.total_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            forward_step = partial(self.forward_step, "train")
            grad_norms.append(optimizer_step(self.chunks, self.optimizer, forward_step, mbs, sums))
            self.num_updates += 1
        # the loss runs on the last pipeline stage: its sums, reduced over DP, go to every stage
        metrics = broadcast_metrics({k: v / len(steps) for k, v in dp_sum(sums, self.device).items()})
        # the rate the optimizer stepped with, read back from it
        return metrics | {
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": self.optimizer.param_groups[0]["lr"],
        }

    def save(self, ckpt_dir: str | Path, common: dict[str, Any] | None = None) -> None:
        """Megatron distributed checkpoint of model, optimizer, the update count and `common`."""
        save_checkpoint(
            self.chunks,
            self.optimizer,
            ckpt_dir,
            {_NUM_UPDATES: self.num_updates, _LORA: self.lora, **(common or {})},
            adapters_only=self.lora is not None,
        )

    def load(self, ckpt_dir: str | Path, common_keys: tuple[str, ...] = ()) -> dict[str, Any]:
        """Restore what `save` wrote, whatever TP/PP/DP wrote it; the saved values of `common_keys`."""
        from megatron.core import dist_checkpointing

        saved = dist_checkpointing.load_common_state_dict(str(ckpt_dir)).get(_LORA)
        if saved != self.lora:
            raise ValueError(
                f"{ckpt_dir} was written with LoRA {_lora_text(saved)}, this run trains with "
                f"{_lora_text(self.lora)}: resume with the train.lora settings it was written with"
            )
        common = load_checkpoint(
            self.chunks,
            self.optimizer,
            ckpt_dir,
            (_NUM_UPDATES, *common_keys),
            adapters_only=self.lora is not None,
        )
        self.num_updates = int(common.pop(_NUM_UPDATES) or 0)  # checkpoints before the schedule: 0
        choose_adam_kernel(self.optimizer, self.cfg)  # the saved param groups carried the writer's
        return common


def _lora_text(lora: dict | None) -> str:
    return "off (every weight trained)" if lora is None else ", ".join(f"{k}={v}" for k, v in lora.items())


def wrap_for_training(
    chunks: list[torch.nn.Module], train_cfg, lr: float, params_dtype: torch.dtype, fuse_wgrad: bool = False
):
    """`(ddp_chunks, optimizer)`: megatron DDP over each model chunk and one Adam over all, with
    `train_cfg`'s settings at `lr`, wired up as Megatron-LM's training loop does. `fuse_wgrad`
    (the kernel set's `wgrad_accumulation`): weight gradients accumulated into the fp32 grad
    buffer by their GEMMs (`rlx.models.kernels.fuse_weight_gradients`; half precision on CUDA)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from rlx.compat import megatron_multi_tensor
    from rlx.models.precision import half_precision

    megatron_multi_tensor.apply()  # the gradient norm and master-weight copies as foreach ops
    megatron_distrib_optimizer.apply()  # its checkpoints load with torch's Adam
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=train_cfg.distributed_optimizer
    )
    ddp_chunks = [
        DistributedDataParallel(
            config=chunk.config,
            ddp_config=ddp_config,
            module=half_precision(chunk),  # bf16/fp16: Float16Module (fp32 outputs), as Megatron-LM wraps
            disable_bucketing=i > 0,  # as Megatron-LM: only the first chunk's grads are bucketed
        )
        for i, chunk in enumerate(chunks)
    ]
    if fuse_wgrad:
        from rlx.models.kernels import fuse_weight_gradients

        fuse_weight_gradients(ddp_chunks)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            min_lr=train_cfg.min_lr,
            weight_decay=train_cfg.weight_decay,
            adam_beta1=train_cfg.adam_beta1,
            adam_beta2=train_cfg.adam_beta2,
            adam_eps=train_cfg.adam_eps,
            clip_grad=train_cfg.clip_grad,
            bf16=train_cfg.precision == "bf16",
            fp16=train_cfg.precision == "fp16",
            params_dtype=params_dtype,
            use_distributed_optimizer=train_cfg.distributed_optimizer,
        ),
        ddp_chunks,
    )
    choose_adam_kernel(optimizer, train_cfg)
    # Grad sync at the end of the last micro-batch; the schedule reads the first chunk's config.
    tf_config = chunks[0].config
    tf_config.finalize_model_grads_func = finalize_model_grads
    no_sync = [chunk.no_sync for chunk in ddp_chunks]
    tf_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    tf_config.grad_scale_func = optimizer.scale_loss
    return ddp_chunks, optimizer


def run_schedule(chunks, forward_step: Callable, mbs: list[MicroBatch], forward_only: bool) -> list[dict]:
    """Run `mbs` through megatron's forward-backward schedule (1F1B under pipeline parallelism,
    interleaved over several model `chunks`); the loss functions' metric dicts, one per
    micro-batch, on the last pipeline stage (none on the others).

    `forward_step(num_microbatches, data_iterator, model)` is megatron's forward step with the
    number of micro-batches bound first (losses undo megatron's division by it). Micro-batches
    may differ in shape: under PP the models' configs set `variable_seq_lengths`, so stages
    exchange each activation's shape before it.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=partial(forward_step, len(mbs)),
        data_iterator=[iter(mbs) for _ in chunks] if len(chunks) > 1 else iter(mbs),
        model=chunks,
        num_microbatches=len(mbs),
        seq_length=max(mb.tokens_BL.shape[1] for mb in mbs),
        micro_batch_size=max(mb.tokens_BL.shape[0] for mb in mbs),
        forward_only=forward_only,
    )


def optimizer_step(
    chunks, optimizer, forward_step: Callable, mbs: list[MicroBatch], sums: dict[str, float]
) -> float:
    """One optimizer step over `mbs` (this rank's share of a global batch); adds the loss
    metrics into `sums` (last pipeline stage) and returns the gradient norm, reduced over the
    model-parallel ranks by megatron (NaN when the optimizer gives none)."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    for result in run_schedule(chunks, forward_step, mbs, forward_only=False):
        for k, v in result.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    _, grad_norm, _ = optimizer.step()
    return float(grad_norm) if grad_norm is not None else float("nan")


# Written into a checkpoint's common state only when False (older checkpoints lack it).
_OPTIMIZER_STEPPED = "optimizer_stepped"


def _has_stepped(optimizer) -> bool:
    return any(sub.optimizer.state for sub in sub_optimizers(optimizer))


def _model_keys(chunks) -> list[str]:
    # Megatron-LM's names; the tensors inside carry global keys, so any PP/VP layout loads them
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _sharded_state(
    chunks, optimizer, is_loading: bool, with_optimizer: bool, common: dict[str, Any], adapters_only: bool
) -> dict:
    model_state = {
        key: _model_state(chunk, adapters_only)
        for key, chunk in zip(_model_keys(chunks), chunks, strict=True)
    }
    state = {**model_state, **common}
    if with_optimizer:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=megatron_distrib_optimizer.METADATA
        )
    return state


def _model_state(chunk, adapters_only: bool) -> dict:
    """A chunk's sharded state dict: all of it, or (LoRA) its adapters' factors only."""
    from rlx.lora.adapter import is_adapter_key

    state = chunk.module.sharded_state_dict()
    return {k: v for k, v in state.items() if is_adapter_key(k)} if adapters_only else state


def save_checkpoint(
    chunks, optimizer, ckpt_dir: str | Path, common: dict[str, Any] | None = None, adapters_only: bool = False
) -> None:
    """Megatron distributed checkpoint of model and optimizer (a collective over all ranks);
    `common` holds small picklable values stored once (global rank 0 writes them).

    An optimizer that has not stepped yet (the policy while the critic warms up) has no Adam
    state, which megatron can save but not load back; it is left out, and `load_checkpoint`
    then leaves the loading optimizer as built, which is the same thing. `adapters_only` (LoRA):
    the model's adapters alone, the frozen base weights being the HF checkpoint's.
    """
    from megatron.core import dist_checkpointing

    from rlx.compat import megatron_checkpoint

    stepped = _has_stepped(optimizer)
    common = (common or {}) | ({} if stepped else {_OPTIMIZER_STEPPED: False})
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    with megatron_checkpoint.in_process_results():  # no manager process per rank (seconds of CPU)
        dist_checkpointing.save(
            _sharded_state(chunks, optimizer, False, stepped, common, adapters_only), str(ckpt_dir)
        )


def load_checkpoint(
    chunks, optimizer, ckpt_dir: str | Path, common_keys: tuple[str, ...] = (), adapters_only: bool = False
) -> dict:
    """Restore model and optimizer from `save_checkpoint`'s directory, whatever TP/PP/DP wrote it,
    into a freshly built model and optimizer; returns the saved `common` values named by
    `common_keys`."""
    from megatron.core import dist_checkpointing

    stepped = dist_checkpointing.load_common_state_dict(str(ckpt_dir)).get(_OPTIMIZER_STEPPED, True)
    if stepped:
        for sub in sub_optimizers(optimizer):
            megatron_distrib_optimizer.allocate_state(sub)  # state to load into
    placeholders = dict.fromkeys(common_keys)
    state = dist_checkpointing.load(
        _sharded_state(chunks, optimizer, True, stepped, placeholders, adapters_only), str(ckpt_dir)
    )
    for key, chunk in zip(_model_keys(chunks), chunks, strict=True):
        # LoRA: the adapters only (dist_checkpointing raises for any it lacks); the base stays
        chunk.module.load_state_dict(state[key], strict=not adapters_only)
    if stepped:
        optimizer.load_state_dict(state["optimizer"])
    return {key: state[key] for key in common_keys}


def dp_sum(values: dict[str, float | torch.Tensor], device: torch.device) -> dict[str, float]:
    """Sum scalars over data-parallel ranks."""
    from megatron.core import parallel_state

    if not values:
        return {}
    keys = sorted(values)
    flat = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    if parallel_state.get_data_parallel_world_size() > 1:
        # on the model's device: NCCL reduces GPU tensors only
        torch.distributed.all_reduce(flat, group=parallel_state.get_data_parallel_group())
    return dict(zip(keys, flat.tolist(), strict=True))
