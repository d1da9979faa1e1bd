"""The engine: requests in, one continuous-batching step at a time, outputs out.

Single-threaded by design: whoever owns the engine (the HTTP server's scheduler thread, or
`generate` in-process) calls `add`, `abort`, `step` and the weight and memory methods from
one thread, between steps, so no step ever sees half-loaded weights or a released cache.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch

from rlx.engine.attention import flash_prefill
from rlx.engine.block_manager import BlockManager
from rlx.engine.checkpoint import eos_ids, read_checkpoint
from rlx.engine.config import EngineArgs
from rlx.engine.host_rows import rows_in
from rlx.engine.kv_cache import KVCache, num_blocks_for_budget
from rlx.engine.memory_saver import supported as saver_supported
from rlx.engine.model_runner import EagerStep
from rlx.engine.models import FAMILIES
from rlx.engine.models.weights import unwritten
from rlx.engine.scheduler import ScheduledBatch, Scheduler
from rlx.engine.sequence import (
    PENDING,
    GenerateOutput,
    GenerateRequest,
    Sequence,
    SequenceStatus,
    abort_reason,
)
from rlx.sglang_api import MEMORY_TAGS

logger = logging.getLogger(__name__)


class Engine:
    """Generation over a paged KV cache with continuous batching, on CUDA or CPU."""

    def __init__(self, args: EngineArgs):
        self.args = args
        self.device = args.resolved_device()
        if self.device.type == "cpu" and args.num_threads > 0:
            torch.set_num_threads(args.num_threads)
        self.model_path = args.model_path
        self.tokenizer_path = args.tokenizer_path or args.model_path
        self.served_model_name = args.served_model_name or args.model_path
        self.weight_version = str(args.weight_version)
        self.hf_config, self.tokenizer = read_checkpoint(args.model_path, self.tokenizer_path)
        self.torch_dtype = args.torch_dtype(getattr(self.hf_config, "dtype", None), self.device)
        self.context_length = int(args.context_length or self.hf_config.max_position_embeddings)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.eos_token_ids = eos_ids(self.hf_config, args.model_path, self.tokenizer)
        self.generic = self.hf_config.model_type not in FAMILIES
        self._build_runner()
        graphs = getattr(self.runner, "graphs", None) is not None
        group = args.admission_group or (args.max_running_requests // 8 if graphs else 1)
        self.scheduler = Scheduler(self.blocks, args.max_running_requests, args.chunked_prefill_size, group)
        self._ids = itertools.count()
        self._request_seed = torch.Generator().manual_seed(args.random_seed)
        self._released: set[str] = set()
        self._cpu_weights: dict[str, torch.Tensor] = {}  # enable_weights_cpu_backup: pinned copies
        self._weight_shapes: dict[str, torch.Size] = {}  # of the released weights
        # names of weights resumed without a CPU backup and not loaded since (uninitialized memory)
        self._unwritten: list[str] = []
        self._views: dict[str, torch.Tensor] | None = None  # `weight_views()`, until the weights move
        # a decode step launched on the GPU and not read back yet (overlap), with its handle
        self._inflight: tuple[ScheduledBatch, Any] | None = None
        self.overlap = not args.disable_overlap_schedule and graphs

    def _build_runner(self) -> None:
        args, cfg = self.args, self.hf_config
        if self.generic:  # DeepSeek-V3 (MLA) and other families: transformers' model, slower
            from rlx.engine.models.hf_generic import HFRunner

            if args.kv_cache_dtype != "auto":
                raise ValueError(
                    f"kv_cache_dtype={args.kv_cache_dtype} is for the engine's own model families "
                    f"({', '.join(FAMILIES)}); {cfg.model_type} runs in transformers' model, whose cache "
                    "holds the model's dtype: leave kv_cache_dtype=auto"
                )
            self.runner = HFRunner(args, self.device, self.torch_dtype, self.context_length)
            self.kv_cache = None
            self.blocks = BlockManager(self._cpu_budget_blocks(1 << 16), args.page_size, False)
            return
        from rlx.engine.model_runner import ModelRunner, build_model

        keep = args.enable_memory_saver and saver_supported(self.device)
        model = build_model(cfg, args, self.context_length, self.device, self.torch_dtype, arena=keep)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)
        kv_dtype = args.kv_torch_dtype(self.torch_dtype)
        per_block = KVCache.bytes_per_block(*shape, args.page_size, kv_dtype)
        num_blocks = num_blocks_for_budget(
            self._kv_budget_bytes(),
            per_block,
            args.page_size,
            args.max_total_tokens,
            self._cpu_budget_blocks(0),
        )
        # zeroed only where an attention path reads unwritten slots (kv_cache.py)
        zeroed = not flash_prefill(self.device, self.torch_dtype)
        self.kv_cache = KVCache(*shape, args.page_size, num_blocks, kv_dtype, self.device, keep, zeroed)
        self.blocks = BlockManager(num_blocks, args.page_size, not args.disable_prefix_sharing)
        max_blocks = -(-self.context_length // args.page_size)
        self.runner = ModelRunner(model, self.kv_cache, args, self.device, max_blocks)
        logger.info("KV cache: %d blocks of %d tokens on %s", num_blocks, args.page_size, self.device)

    def _cpu_budget_blocks(self, at_least: int) -> int:
        """Blocks enough for every running request at full context (more is never used)."""
        per_seq = -(-self.context_length // self.args.page_size)
        return max(self.args.max_running_requests * per_seq, at_least)

    def _kv_budget_bytes(self) -> int:
        if self.device.type != "cuda":
            return self.args.cpu_kv_cache_bytes
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free - total * (1.0 - self.args.mem_fraction_static))

    @property
    def model(self):
        return self.runner.model

    # ---- requests -------------------------------------------------------------------------

    def validate(self, request: GenerateRequest) -> None:
        """Raise ValueError for what SGLang rejects (empty or too long prompt, bad ids, params)."""
        num_input = len(request.input_ids)
        if num_input == 0:
            raise ValueError("input_ids cannot be empty.")
        if num_input >= self.context_length:
            raise ValueError(
                f"The input ({num_input} tokens) is longer than the model's context "
                f"length ({self.context_length} tokens)."
            )
        max_input = self.blocks.capacity_tokens - 1  # SGLang's max_req_input_len, from the KV pool
        if num_input > max_input:
            raise ValueError(
                f"Input length ({num_input} tokens) exceeds the maximum allowed length ({max_input} "
                "tokens). Either reduce the input length or increase the KV cache (mem_fraction_static)."
            )
        if min(request.input_ids) < 0 or max(request.input_ids) >= self.vocab_size:
            raise ValueError(f"input_ids must be in [0, {self.vocab_size}).")
        if request.logprob_start_len >= num_input:
            raise ValueError(
                f"logprob_start_len={request.logprob_start_len} is not less than the "
                f"number of input tokens ({num_input})."
            )
        request.sampling.verify()

    def add(self, request: GenerateRequest, tag: Any = None) -> Sequence:
        """Queue a validated request; it joins the running batch at the next step."""
        if self._released:
            raise RuntimeError(
                f"the engine's {' and '.join(sorted(self._released))} memory is released: "
                "resume_memory_occupation first"
            )
        if self._unwritten:
            raise RuntimeError(
                f"the weights were released without a CPU backup and {len(self._unwritten)} tensors "
                f"(first: {self._unwritten[0]}) have not been loaded since: update the weights "
                "first, or start the engine with enable_weights_cpu_backup=true"
            )
        num_input = len(request.input_ids)
        room = min(self.context_length, self.blocks.capacity_tokens) - num_input
        max_new = max(min(request.sampling.max_new_tokens, room), 0)
        seed = int(torch.randint(0, 1 << 62, (1,), generator=self._request_seed))
        seq = Sequence(next(self._ids), request, max_new, seed, tag, self.vocab_size)
        if seq.wants_input_logprobs:
            seq.input_logprobs = [None]
        if max_new == 0 and not seq.wants_input_logprobs:
            seq.finish_reason = {"type": "length", "length": 0}
            seq.status = SequenceStatus.FINISHED
        else:
            self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence, message: str = "Aborted") -> None:
        if seq.status is not SequenceStatus.FINISHED:
            seq.finish_reason = abort_reason(message)
            self.scheduler.finish(seq)
            while seq.token_ids[-1] == PENDING:  # sampled on the GPU, never read back
                seq.token_ids.pop()

    def has_work(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[Sequence]:
        """One forward pass over the scheduled batch; the sequences that finished in it.

        Overlap (CUDA graphs, SGLang's overlap schedule): a step is read back one call later,
        after the next one was launched behind it, so the host works while the GPU does. Behind
        a decode graph runs the same sequences' next decode, its inputs the pending tokens on
        the device (a sequence found finished wastes its row); else (behind an eager step, or
        requests wait) prefill chunks with the decodes that need no token in flight
        (`Scheduler.schedule(behind=True)`), never decodes alone: they would split the batch
        into halves that take turns, each reading every weight (whole runs 16-19% slower)."""
        if self._inflight is not None:
            return self._step_behind()
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        if self.overlap:
            self._inflight = self._launch(batch, None)
            return []
        result = self.runner.run(batch)
        self._advance(batch)
        return self._finish(result.sampled, result.prompt_logprobs)

    def _launch(self, batch: ScheduledBatch, behind: ScheduledBatch | None) -> tuple[ScheduledBatch, Any]:
        """Queue `batch`, as a decode graph if it is one, else eagerly; each sequence it samples
        gets a PENDING token, and the rows of `behind` (a decode graph still in flight) feed
        pending inputs from the device."""
        if self.runner.can_launch(batch):
            sources = rows_in(batch.seqs, behind.seqs if behind is not None else [])
            handle = self.runner.launch(batch.seqs, sources)
        else:
            handle = self.runner.launch_eager(batch)
        self._advance(batch)
        return batch, handle

    @staticmethod
    def _advance(batch: ScheduledBatch) -> None:
        """Count the step's tokens computed; a PENDING place for each token it samples."""
        for seq, num_new in zip(batch.seqs, batch.num_new, strict=True):
            seq.num_computed += num_new
            if seq.num_computed == len(seq.token_ids) and seq.max_new > 0:  # len: a hot loop
                seq.token_ids.append(PENDING)

    def _step_behind(self) -> list[Sequence]:
        """Launch the next step behind the one in flight if one can go; read the one in flight."""
        batch, handle = self._inflight
        self._inflight = None
        following = None if isinstance(handle, EagerStep) else self.scheduler.continue_decode(batch.seqs)
        if following is None:
            following = self.scheduler.schedule(behind=True)
        if following is not None:
            self._inflight = self._launch(following, batch)
        return self._resolve(batch, handle)

    def _resolve(self, batch: ScheduledBatch, handle: Any) -> list[Sequence]:
        """Write a launched step's tokens over their PENDING places; the sequences it finished."""
        if isinstance(handle, EagerStep):
            result = self.runner.collect_eager(handle)
            return self._finish(result.sampled, result.prompt_logprobs)
        tokens, logprobs = self.runner.collect(handle)
        return self._finish(zip(batch.seqs, tokens, logprobs, strict=True), [])

    def _finish(self, sampled, prompt_logprobs) -> list[Sequence]:
        """A step's results into its sequences (prompt logprobs, sampled tokens over their
        PENDING places); the sequences that finished."""
        for owner, value in prompt_logprobs:
            owner.input_logprobs.append(value)
        finished, eos, stopped = [], self.eos_token_ids, SequenceStatus.FINISHED
        for seq, token, logprob in sampled:  # a hot loop: a decode step's every row
            if seq.status is stopped:  # aborted, or finished by the step before
                continue
            token, num_output = int(token), None
            if seq.max_new > 0:
                outputs = seq.output_logprobs
                seq.token_ids[seq.num_prompt + len(outputs)] = token  # this step's PENDING place
                outputs.append(logprob)
                num_output = len(outputs)
                sampling = seq.request.sampling
                if (  # `_check_finished`'s answer None, without its call: short of the length, no stop
                    num_output < seq.max_new
                    and not sampling.stop
                    and (sampling.ignore_eos or (token not in eos and token not in sampling.stop_token_ids))
                ):
                    continue
            seq.finish_reason = self._check_finished(seq, token, num_output)
            if seq.finish_reason is not None:
                del seq.token_ids[seq.num_prompt + len(seq.output_logprobs) :]  # a step behind's
                self.scheduler.finish(seq)
                finished.append(seq)
        return finished

    def _drain(self) -> None:
        """Read back the step in flight without launching another (before weights or memory move)."""
        if self._inflight is not None:
            batch, handle = self._inflight
            self._inflight = None
            self._resolve(batch, handle)

    def _check_finished(
        self, seq: Sequence, token: int, num_output: int | None = None
    ) -> dict[str, Any] | None:
        """SGLang's Req.check_finished order: length, then stop/EOS token, then stop string.
        `num_output`: outputs up to this token (default: all of `seq`'s)."""
        sampling = seq.sampling
        num_output = seq.num_output if num_output is None else num_output
        if num_output >= seq.max_new:
            return {"type": "length", "length": seq.max_new}
        if not sampling.ignore_eos and (token in sampling.stop_token_ids or token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        if sampling.stop:  # the newest tokens' text (`stop_window`), special tokens in it, as SGLang's
            end = seq.num_prompt + num_output
            newest = seq.token_ids[max(seq.num_prompt, end - sampling.stop_window) : end]
            text = self.decode(newest, skip_special_tokens=False)
            for stop in sampling.stop:
                if stop in text:
                    return {"type": "stop", "matched": stop}
        return None

    def generate(
        self, requests: list[GenerateRequest], is_aborted: Callable[[int], bool] | None = None
    ) -> list[GenerateOutput]:
        """Complete `requests` (continuous batching); `is_aborted(i)` is polled before each step."""
        for request in requests:
            self.validate(request)
        seqs = [self.add(r) for r in requests]
        while any(s.status is not SequenceStatus.FINISHED for s in seqs):
            for i, seq in enumerate(seqs):
                if is_aborted is not None and seq.status is not SequenceStatus.FINISHED and is_aborted(i):
                    self.abort(seq)
            self.step()
        return [s.output() for s in seqs]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text with the served tokenizer."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    # ---- weights and memory ---------------------------------------------------------------

    def load_weights_from_disk(self, path: str, weight_version: str | None = None) -> int:
        """Load an HF directory's safetensors (one file, or shards with an index) in place."""
        if "weights" in self._released:
            raise RuntimeError("weights are released; resume_memory_occupation first")
        self._drain()
        # weights resumed uninitialized: the checkpoint must hold every tensor
        num_loaded = self.runner.load_weights(str(path), require_all=bool(self._unwritten))
        self._unwritten = []
        self.blocks.forget_cached()  # cached prefixes were computed with the old weights
        self.model_path = str(path)
        if weight_version is not None:
            self.weight_version = str(weight_version)
        return num_loaded

    def load_named_weights(
        self, named: list[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> int:
        """Copy HF-named tensors (the trainer's, from any device) into the live weights, in place;
        every name and shape is checked before anything is copied. Returns tensors loaded."""
        if "weights" in self._released:
            raise RuntimeError("weights are released; resume_memory_occupation first")
        self._drain()
        views = self.weight_views()
        for name, tensor in named:
            if name not in views:
                raise ValueError(f"{name}: not a tensor of this model")
            if tuple(views[name].shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != model's {tuple(views[name].shape)}")
        for name, tensor in named:
            views[name].copy_(tensor, non_blocking=True)
        if self._unwritten:
            self._unwritten = unwritten(views, [name for name, _ in named], among=self._unwritten)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the sender may free its tensors once this returns
        self.blocks.forget_cached()  # cached prefixes were computed with the old weights
        if weight_version is not None:
            self.weight_version = str(weight_version)
        return len(named)

    def weight_views(self) -> dict[str, torch.Tensor]:
        """The live weights by HF name, built once per allocation of them (a MoE model has thousands
        of per-expert views, and a weight sync asks once per bucket). rlx's own families expose
        per-name views, fused projections included; transformers' models their parameters."""
        if self._views is None:
            model = self.runner.model
            self._views = (
                model.weight_views()
                if hasattr(model, "weight_views")
                else {n: p.data for n, p in model.named_parameters()}
            )
        return self._views

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Free device memory (SGLang's release_memory_occupation); the engine must be idle."""
        tags = set(tags or MEMORY_TAGS) - self._released
        if self.generic or not tags:
            return
        self._drain()
        if self.has_work():
            raise RuntimeError("release_memory_occupation needs an idle engine")
        arena = self.model.weight_arena  # with the memory saver: the addresses stay, so do the graphs
        if self.runner.graphs is not None and arena is None:
            self.runner.graphs.clear()  # their pool holds memory, and they point at what moves
        if "kv_cache" in tags:
            self.kv_cache.release()
            self.blocks.forget_cached()
        if "weights" in tags:
            self._views = None
            backup = self.args.enable_weights_cpu_backup
            for name, param in self.model.named_parameters():
                if backup:  # pinned host copies, allocated once and reused at every release
                    host = self._cpu_weights.get(name)
                    if host is None:
                        host = torch.empty(
                            param.shape, dtype=param.dtype, pin_memory=self.device.type == "cuda"
                        )
                        self._cpu_weights[name] = host
                    host.copy_(param.data, non_blocking=True)
                if arena is None:
                    self._weight_shapes[name] = param.shape
                    param.data = torch.empty(0, dtype=param.dtype, device=self.device)
            if arena is not None:
                arena.release()  # after the copies to the host (it synchronizes first)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self._released |= tags & set(MEMORY_TAGS)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Restore what `release_memory` freed: the weights with their values when the engine keeps
        a CPU backup, else uninitialized, to be loaded before the next request."""
        tags = set(tags or MEMORY_TAGS) & self._released
        if "weights" in tags:
            backup, arena = self.args.enable_weights_cpu_backup, self.model.weight_arena
            if arena is not None:
                arena.resume()
            for name, param in self.model.named_parameters():
                if arena is None:
                    param.data = torch.empty(self._weight_shapes[name], dtype=param.dtype, device=self.device)
                if backup:
                    param.data.copy_(self._cpu_weights[name], non_blocking=True)
            self.model.tie_weights()
            self._views = None
            if not backup:
                self._unwritten = sorted(self.weight_views())
        if "kv_cache" in tags:
            self.kv_cache.resume()
        if tags and self.device.type == "cuda":
            torch.cuda.synchronize()
        self._released -= tags
