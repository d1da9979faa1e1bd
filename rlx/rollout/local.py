"""rlx's own rollout engine: a transformers causal LM generating in batches with a KV cache.

It is what `rollout=local` runs (on CPU, in the embedded default and the tests), always behind
`rlx.rollout.http_server`, which serves SGLang's native HTTP API, so the client, the router and
the weight-sync code are the same for it as for real SGLang engines. Sampling and stopping
follow SGLang's semantics (`sglang/srt/sampling/sampling_params.py`,
`sglang/srt/managers/schedule_batch.py::Req.check_finished`, `sglang/srt/layers/sampler.py`):

- temperature < 1e-6 is greedy; otherwise the logprob of a sampled token is
  log_softmax(logits / temperature) at that token, in fp32, before top-k/top-p/min-p truncation;
- a request finishes on max_new_tokens ("length", checked first, as SGLang does), then on the
  tokenizer/model EOS or a stop token id ("stop", matched=<id>), then on a stop string.

Legend: B batch rows, L padded prompt length, V vocabulary size.
(Over 400 lines: the engine and its per-wave batch bookkeeping are one unit.)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SAMPLING_EPS = 1e-6  # SGLang's _SAMPLING_EPS: temperatures below it mean greedy
# SGLang's --dtype names; "auto" is fp32 here: CPU rollouts must match the fp32 trainer's logprobs.
DTYPES = {name: torch.float32 for name in ("float32", "float", "auto")}
DTYPES |= {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
# Engine args that LocalEngine uses; any other (SGLang) server argument is accepted and ignored.
_USED_ENGINE_ARGS = {
    "context_length",
    "attn_implementation",
    "tokenizer_path",
    "served_model_name",
    "weight_version",
}


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling, with SGLang's field names and defaults."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, checked on the decoded output
    ignore_eos: bool = False
    sampling_seed: int | None = None  # own generator for this request; None: the engine's
    skip_special_tokens: bool = True  # used by the server when it decodes `text`
    no_stop_trim: bool = False  # used by the server when it decodes `text`

    def verify(self) -> None:
        """SGLang's `SamplingParams.verify` checks."""
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


@dataclass(slots=True)
class GenerateRequest:
    """One prompt to complete. `logprob_start_len` >= 0 also asks for prompt-token logprobs."""

    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = ""
    logprob_start_len: int = -1


@dataclass(slots=True)
class GenerateOutput:
    """What one request produced; `finish_reason` is SGLang's dict (`{"type": ..., ...}`)."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any]
    input_logprobs: list[float | None] = field(default_factory=list)  # from logprob_start_len on


def abort_reason(message: str = "Aborted") -> dict[str, Any]:
    """SGLang's FINISH_ABORT.to_json()."""
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


class LocalEngine:
    """Batched generation with a transformers model loaded from a local HF directory.

    Requests of different prompt lengths share one batch (left padding, attention mask and
    per-row position ids), and give the same tokens and logprobs as each run alone.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_batch_size: int = 256,
        num_threads: int = 1,
        **engine_args: Any,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        ignored = sorted(set(engine_args) - _USED_ENGINE_ARGS)
        if ignored:
            logger.info("LocalEngine ignores engine args %s", ignored)
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.model_path = str(model_path)
        self.tokenizer_path = str(engine_args.get("tokenizer_path") or model_path)
        self.served_model_name = str(engine_args.get("served_model_name") or model_path)
        self.dtype = dtype
        self.seed = seed
        self.max_batch_size = max_batch_size
        self.weight_version = str(engine_args.get("weight_version", "default"))  # SGLang's default
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path,
            dtype=DTYPES[dtype],
            local_files_only=True,
            attn_implementation=engine_args.get("attn_implementation", "sdpa"),
        ).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path, local_files_only=True)
        config = self.model.config
        self.context_length = int(engine_args.get("context_length") or config.max_position_embeddings)
        self.vocab_size = int(config.vocab_size)
        self.eos_token_ids = _eos_ids(config, self.model.generation_config, self.tokenizer)
        self.pad_token_id = next(
            x for x in (config.pad_token_id, self.tokenizer.pad_token_id, 0) if x is not None
        )
        self.generator = torch.Generator().manual_seed(seed)

    # ---- requests -------------------------------------------------------------------------

    def validate(self, request: GenerateRequest) -> None:
        """Raise ValueError for a request SGLang would reject (empty or too long prompt, bad ids)."""
        num_input = len(request.input_ids)
        if num_input == 0:
            raise ValueError("input_ids cannot be empty.")
        if num_input >= self.context_length:
            raise ValueError(
                f"The input ({num_input} tokens) is longer than the model's context "
                f"length ({self.context_length} tokens)."
            )
        if min(request.input_ids) < 0 or max(request.input_ids) >= self.vocab_size:
            raise ValueError(f"input_ids must be in [0, {self.vocab_size}).")
        if request.logprob_start_len >= num_input:
            raise ValueError(
                f"logprob_start_len={request.logprob_start_len} is not less than the "
                f"number of input tokens ({num_input})."
            )
        request.sampling.verify()

    def generate(
        self, requests: list[GenerateRequest], is_aborted: Callable[[int], bool] | None = None
    ) -> list[GenerateOutput]:
        """Complete `requests` in batches of at most `max_batch_size`; outputs keep their order.

        `is_aborted(i)` is polled before every decode step: request i then finishes with what it
        has and finish_reason abort.
        """
        for request in requests:
            self.validate(request)
        outputs: list[GenerateOutput] = []
        for start in range(0, len(requests), self.max_batch_size):
            chunk = requests[start : start + self.max_batch_size]
            offset_aborted = (lambda i, s=start: is_aborted(s + i)) if is_aborted else None
            outputs.extend(self._generate_batch(chunk, offset_aborted))
        return outputs

    @torch.no_grad()
    def _generate_batch(
        self, requests: list[GenerateRequest], is_aborted: Callable[[int], bool] | None
    ) -> list[GenerateOutput]:
        from transformers import DynamicCache

        batch = _Batch(requests, self)
        cache = DynamicCache(config=self.model.config)
        need_prompt_logits = any(r.logprob_start_len >= 0 for r in requests)
        out = self.model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=0 if need_prompt_logits else 1,
        )
        if need_prompt_logits:
            batch.record_prompt_logprobs(out.logits)
        logits_BV = out.logits[:, -1, :]
        while True:
            batch.drop_finished(is_aborted)
            if not batch.active:
                break
            keep = batch.compact()
            if keep is not None:  # rows finished since the last step leave the cache
                cache.batch_select_indices(keep)
                logits_BV = logits_BV[keep]
            tokens_B, logprobs_B = self._sample(logits_BV, batch)
            batch.append(tokens_B, logprobs_B, self)
            if all(batch.finish[i] is not None for i in batch.active):
                break
            batch.grow()
            out = self.model(
                input_ids=tokens_B[:, None],
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids[:, -1:],
                past_key_values=cache,
                use_cache=True,
            )
            logits_BV = out.logits[:, -1, :]
        return batch.outputs()

    def _sample(self, logits_BV: torch.Tensor, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Next token and its temperature-scaled fp32 logprob for every active row."""
        params = [batch.requests[i].sampling for i in batch.active]
        logits_BV = logits_BV.float()
        greedy_B = torch.tensor([p.greedy for p in params])
        temp_B = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
        logp_BV = torch.log_softmax(logits_BV / temp_B[:, None], dim=-1)
        probs_BV = _truncate(logp_BV.exp(), params)
        noise_BV = torch.empty_like(probs_BV).exponential_(generator=self.generator)
        for row, i in enumerate(batch.active):
            if batch.generators[i] is not None:  # a seeded request draws from its own stream
                noise_BV[row].exponential_(generator=batch.generators[i])
        # Exponential race: argmax(p / Exp(1)) is a draw from p (what vLLM and SGLang use).
        sampled_B = (probs_BV / noise_BV.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(-1)
        tokens_B = torch.where(greedy_B, logits_BV.argmax(-1), sampled_B)
        return tokens_B, logp_BV.gather(-1, tokens_B[:, None])[:, 0]

    # ---- weights --------------------------------------------------------------------------

    def load_weights_from_disk(self, path: str, weight_version: str | None = None) -> int:
        """Load an HF directory's safetensors into the live model, in place; returns tensors loaded.

        A single `model.safetensors` or shards listed by `model.safetensors.index.json` (how the
        trainer writes weight buckets); a subset of the model's tensors is allowed. Names and
        shapes are all checked before any tensor is copied, so a bad checkpoint changes nothing.
        Checkpoints whose names differ from the module's (transformers fusing MoE experts, say)
        are loaded through `from_pretrained` into a scratch model and copied from there.
        """
        from safetensors import safe_open

        files = _safetensors_files(Path(path))
        live = self.model.state_dict()
        names: set[str] = set()
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    shape = tuple(f.get_slice(name).get_shape())
                    if name in live and tuple(live[name].shape) != shape:
                        raise ValueError(f"{name}: shape {shape} != model's {tuple(live[name].shape)}")
                    names.add(name)
        if any(name not in live for name in names):
            num_loaded = self._load_converted(path, live)
        else:
            for file in files:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        live[name].copy_(f.get_tensor(name))
            num_loaded = len(names)
        self.model_path = str(path)
        if weight_version is not None:
            self.weight_version = str(weight_version)
        return num_loaded

    def _load_converted(self, path: str, live: dict[str, torch.Tensor]) -> int:
        from transformers import AutoModelForCausalLM

        scratch, info = AutoModelForCausalLM.from_pretrained(
            path,
            config=self.model.config,
            # Weight buckets carry no generation_config.json, which transformers would otherwise read.
            generation_config=self.model.generation_config,
            dtype=self.model.dtype,
            local_files_only=True,
            output_loading_info=True,
        )
        if info.get("missing_keys") or info.get("unexpected_keys"):
            raise ValueError(
                f"checkpoint at {path} does not match the model: missing "
                f"{sorted(info['missing_keys'])[:5]}, unexpected {sorted(info['unexpected_keys'])[:5]}"
            )
        loaded = scratch.state_dict()
        for name, tensor in live.items():
            tensor.copy_(loaded[name])
        return len(loaded)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text with the served tokenizer."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


class _Batch:
    """Per-wave bookkeeping: padded tensors of the rows still running and every row's output."""

    def __init__(self, requests: list[GenerateRequest], engine: LocalEngine):
        self.requests = requests
        self.active = list(range(len(requests)))  # request index of each row still in the cache
        self.output_ids: list[list[int]] = [[] for _ in requests]
        self.output_logprobs: list[list[float]] = [[] for _ in requests]
        self.input_logprobs: list[list[float | None]] = [[] for _ in requests]
        self.finish: list[dict[str, Any] | None] = [None] * len(requests)
        self.max_new = [
            min(r.sampling.max_new_tokens, engine.context_length - len(r.input_ids)) for r in requests
        ]
        self.generators = [
            None
            if r.sampling.sampling_seed is None
            else torch.Generator().manual_seed(r.sampling.sampling_seed)
            for r in requests
        ]
        self.cache_rows = list(range(len(requests)))  # row of each request in the cache tensors
        length = max(len(r.input_ids) for r in requests)
        ids = [[engine.pad_token_id] * (length - len(r.input_ids)) + r.input_ids for r in requests]
        mask = [[0] * (length - len(r.input_ids)) + [1] * len(r.input_ids) for r in requests]
        self.input_ids = torch.tensor(ids)
        self.attention_mask = torch.tensor(mask)
        # Left padding shifts prompts right; positions count real tokens only.
        self.position_ids = (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def record_prompt_logprobs(self, logits_BLV: torch.Tensor) -> None:
        """SGLang's input_token_logprobs: None for the first listed token, then logp(t_p | t_<p)."""
        length = logits_BLV.shape[1]
        for i, request in enumerate(self.requests):
            if request.logprob_start_len < 0:
                continue
            num_input, start = len(request.input_ids), request.logprob_start_len
            row = logits_BLV[i, length - num_input :].float().log_softmax(-1)  # row p predicts p+1
            targets = torch.tensor(request.input_ids[start + 1 :])
            values = row[start : num_input - 1].gather(-1, targets[:, None])[:, 0].tolist()
            self.input_logprobs[i] = [None, *values]

    def append(self, tokens_B: torch.Tensor, logprobs_B: torch.Tensor, engine: LocalEngine) -> None:
        for i, token, logprob in zip(self.active, tokens_B.tolist(), logprobs_B.tolist(), strict=True):
            self.output_ids[i].append(token)
            self.output_logprobs[i].append(logprob)
            self.finish[i] = self._check_finished(i, token, engine)

    def _check_finished(self, i: int, token: int, engine: LocalEngine) -> dict[str, Any] | None:
        """SGLang's Req.check_finished order: length, then stop/EOS token, then stop string."""
        sampling = self.requests[i].sampling
        if len(self.output_ids[i]) >= self.max_new[i]:
            return {"type": "length", "length": self.max_new[i]}
        if not sampling.ignore_eos and (token in sampling.stop_token_ids or token in engine.eos_token_ids):
            return {"type": "stop", "matched": token}
        if sampling.stop:
            text = engine.decode(self.output_ids[i], sampling.skip_special_tokens)
            for stop in sampling.stop:
                if stop in text:
                    return {"type": "stop", "matched": stop}
        return None

    def drop_finished(self, is_aborted: Callable[[int], bool] | None) -> None:
        """Drop rows that finished (or were aborted, or may not generate at all) from `active`."""
        for i in self.active:
            if self.finish[i] is None and self.max_new[i] <= len(self.output_ids[i]):
                self.finish[i] = {"type": "length", "length": self.max_new[i]}
            if self.finish[i] is None and is_aborted is not None and is_aborted(i):
                self.finish[i] = abort_reason()
        self.active = [i for i in self.active if self.finish[i] is None]

    def compact(self) -> torch.Tensor | None:
        """Keep only the active rows in the padded tensors; the cache rows to keep, or None if all."""
        if len(self.active) == self.attention_mask.shape[0]:
            return None
        keep = torch.tensor([self.cache_rows[i] for i in self.active])
        self.attention_mask = self.attention_mask[keep]
        self.position_ids = self.position_ids[keep]
        for row, i in enumerate(self.active):
            self.cache_rows[i] = row
        return keep

    def grow(self) -> None:
        """Make room for the token just appended to every active row."""
        num_rows = self.attention_mask.shape[0]
        self.attention_mask = torch.cat(
            [self.attention_mask, self.attention_mask.new_ones(num_rows, 1)], dim=1
        )
        self.position_ids = torch.cat([self.position_ids, self.position_ids[:, -1:] + 1], dim=1)

    def outputs(self) -> list[GenerateOutput]:
        return [
            GenerateOutput(
                rid=r.rid,
                output_ids=self.output_ids[i],
                output_logprobs=self.output_logprobs[i],
                finish_reason=self.finish[i] or abort_reason(),
                input_logprobs=self.input_logprobs[i],
            )
            for i, r in enumerate(self.requests)
        ]


def _truncate(probs_BV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities top-k, top-p and min-p cut (SGLang's top_k_top_p_min_p_sampling)."""
    vocab = probs_BV.shape[-1]
    top_k_B = torch.tensor([vocab if p.greedy or p.top_k < 0 else min(p.top_k, vocab) for p in params])
    top_p_B = torch.tensor([p.top_p for p in params])
    min_p_B = torch.tensor([p.min_p for p in params])
    if bool((top_k_B == vocab).all() and (top_p_B >= 1.0).all() and (min_p_B <= 0.0).all()):
        return probs_BV
    sorted_BV, index_BV = probs_BV.sort(dim=-1, descending=True)
    keep_BV = torch.arange(vocab)[None, :] < top_k_B[:, None]
    keep_BV &= (sorted_BV.cumsum(-1) - sorted_BV) <= top_p_B[:, None]
    keep_BV &= sorted_BV >= min_p_B[:, None] * sorted_BV[:, :1]
    return torch.zeros_like(probs_BV).scatter_(-1, index_BV, sorted_BV * keep_BV)


def _eos_ids(config, generation_config, tokenizer) -> set[int]:
    """EOS ids from the model config, its generation config and the tokenizer, as SGLang gathers them."""
    ids: set[int] = set()
    for value in (
        getattr(config, "eos_token_id", None),
        getattr(generation_config, "eos_token_id", None),
        tokenizer.eos_token_id,
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(x) for x in value)
    return ids


def _safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's files: the index's shards if there is an index, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    return files


__all__ = ["GenerateOutput", "GenerateRequest", "LocalEngine", "SamplingParams", "abort_reason"]
