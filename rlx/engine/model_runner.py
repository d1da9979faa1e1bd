"""Runs one scheduled batch: the forward pass (eager, or a decode CUDA graph), sampling, and
prompt logprobs; returns plain Python lists after a single device-to-host copy per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlx.engine.attention import flash_prefill
from rlx.engine.config import EngineArgs
from rlx.engine.cuda_graph import DecodeGraphs
from rlx.engine.kv_cache import KVCache
from rlx.engine.models import FAMILIES
from rlx.engine.models.weights import load_weights
from rlx.engine.sampler import Sampler, SamplingBatch
from rlx.engine.scheduler import ScheduledBatch
from rlx.engine.sequence import Sequence
from rlx.engine.step_inputs import StepInputs, build_step_inputs


@dataclass
class EagerStep:
    """An eager step queued on the device: whom its values belong to, the values (on the host
    once `ready` has passed; on CUDA a pinned buffer being filled), and the event."""

    sample_seqs: list[Sequence]
    prompt_owners: list[Sequence]
    values: torch.Tensor | None
    ready: torch.cuda.Event | None = None


@dataclass
class StepResult:
    """What the host needs after a step: a token and logprob per sampled sequence, and the
    prompt logprobs (owner, value) that rows of this step predicted."""

    sampled: list[tuple[Sequence, int, float]]
    prompt_logprobs: list[tuple[Sequence, float]]


def build_model(
    hf_config,
    args: EngineArgs,
    max_positions: int,
    device: torch.device,
    dtype: torch.dtype,
    arena: bool = False,
):
    """The family's module with the checkpoint's weights, allocated once on `device`; with
    `arena`, its parameters in one `memory_saver.Arena` (`model.weight_arena`), which a memory
    release gives back and a resume maps again at the same addresses."""
    family = FAMILIES[hf_config.model_type]
    with torch.device("meta"):
        model = family(hf_config, max_positions)
        if device.type == "cuda":
            model.merge_projections()

    def dtype_of(t: torch.Tensor) -> torch.dtype:
        return dtype if t.is_floating_point() else t.dtype

    model.weight_arena, taken = None, {}
    if arena:
        from rlx.engine.memory_saver import Arena

        params = list({id(p): p for p in model.parameters()}.values())  # a tied weight once
        model.weight_arena, views = Arena.holding([(p.shape, dtype_of(p)) for p in params], device)
        taken = {id(p): view for p, view in zip(params, views, strict=True)}
    # `to_empty` without `empty_like`: on meta tensors that runs torch's Python reference, whose
    # first call imports sympy and torch's symbolic shapes (0.7 s of CPU per engine process)
    model = model._apply(
        lambda t: taken[id(t)] if id(t) in taken else torch.empty(t.shape, dtype=dtype_of(t), device=device)
    )
    model.tie_weights()  # each module has its own tensor now
    model.build_rotary(device)
    load_weights(model.weight_views(), args.model_path, require_all=True)
    if device.type == "cuda" and not args.disable_cuda_graph:
        # only where the decode runs in graphs, and there only inside them (`small_gemms_in_graphs`):
        # eager, launching Triton's kernel with its TMA descriptors costs the host more than it
        # saves (Qwen3-0.6B at 64 rows, 1xH200: 3,881-3,987 decode tokens/s against cuBLAS's
        # 4,303-4,975)
        model.enable_small_gemms()
    return model.eval()


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, args: EngineArgs, device: torch.device, max_blocks: int):
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.block_size = kv_cache.block_size
        self.vocab_size = int(model.config.vocab_size)
        self.sampler = Sampler(args.random_seed, device)
        self.use_decode_kernel = device.type == "cuda"
        self.flash_prefill = flash_prefill(device, next(model.parameters()).dtype)
        self.graphs: DecodeGraphs | None = None
        if device.type == "cuda" and not args.disable_cuda_graph and model.supports_cuda_graph:
            self.graphs = DecodeGraphs(model, kv_cache, args.cuda_graph_max_bs, max_blocks, device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        decode_only = batch.num_decode == len(batch.seqs)
        if decode_only and self.graphs is not None and self.graphs.can_run(batch.num_decode):
            return self._run_graph(batch.seqs)
        return self.collect_eager(self.launch_eager(batch))

    @torch.inference_mode()
    def launch_eager(self, batch: ScheduledBatch) -> EagerStep:
        """Queue an eager step (prefill chunks, decode rows beside them) and the copy of its
        sampled tokens and prompt logprobs to the host; `collect_eager` reads them."""
        inputs = build_step_inputs(
            batch, self.block_size, self.device, self.use_decode_kernel, self.flash_prefill
        )
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta)
        sample_logits = self.model.logits(hidden[inputs.sample_rows])
        values = self._step_values(sample_logits, hidden, inputs)
        step = EagerStep(inputs.sample_seqs, inputs.prompt_owners, values)
        if values is not None and values.is_cuda:
            step.values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            step.values.copy_(values, non_blocking=True)
            step.ready = torch.cuda.Event()
            step.ready.record()
        return step

    def collect_eager(self, step: EagerStep) -> StepResult:
        """The step's results: its one sync."""
        if step.ready is not None:
            step.ready.synchronize()
        values = step.values.tolist() if step.values is not None else []
        num = len(step.sample_seqs)
        sampled = [(seq, int(values[i]), values[num + i]) for i, seq in enumerate(step.sample_seqs)]
        prompt = list(zip(step.prompt_owners, values[2 * num :], strict=True))
        return StepResult(sampled, prompt)

    def can_launch(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` runs as one decode graph (the steps that may overlap the host)."""
        decode_only = batch.num_decode == len(batch.seqs)
        return decode_only and self.graphs is not None and self.graphs.can_run(batch.num_decode)

    def launch(self, seqs: list[Sequence], sources: list[int]) -> tuple[int, int]:
        """Queue a decode step in a CUDA graph that samples too (rows with top-k / top-p / min-p
        are sampled again by the torch path) and the copy of its results; `collect` reads them."""
        graphs, rows = self.graphs, len(seqs)
        logits = graphs.run(seqs, sources)
        if any(s.truncates for s in seqs):
            params = SamplingBatch.build(seqs, self.vocab_size, self.device)
            self.sampler.resample_truncated(logits[:rows], params, graphs.out[0, :rows], graphs.out[1, :rows])
        return graphs.read_async(rows)

    def collect(self, handle: tuple[int, int]) -> tuple[list[float], list[float]]:
        tokens, logprobs = self.graphs.collect(handle)
        return tokens, logprobs

    def _run_graph(self, seqs: list[Sequence]) -> StepResult:
        tokens, logprobs = self.collect(self.launch(seqs, [-1] * len(seqs)))
        return StepResult([(s, int(t), p) for s, t, p in zip(seqs, tokens, logprobs, strict=True)], [])

    def _step_values(
        self, sample_logits: torch.Tensor, hidden: torch.Tensor, inputs: StepInputs
    ) -> torch.Tensor | None:
        """[sampled tokens, their logprobs, prompt logprobs] in one fp32 tensor on the device."""
        parts = []
        if inputs.sample_seqs:
            tokens, logprobs = self.sampler(
                sample_logits, SamplingBatch.build(inputs.sample_seqs, self.vocab_size, self.device)
            )
            parts += [tokens.float(), logprobs]
        if inputs.prompt_rows is not None:
            logp = self._prompt_logits(hidden, inputs.prompt_rows).float().log_softmax(-1)
            parts.append(logp.gather(-1, inputs.prompt_targets[:, None])[:, 0])
        return torch.cat(parts) if parts else None

    def _prompt_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden[rows])

    def load_weights(self, path: str, require_all: bool = False) -> int:
        return load_weights(self.model.weight_views(), path, require_all=require_all)
