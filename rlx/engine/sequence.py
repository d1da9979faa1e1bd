"""Requests, their sampling parameters, and the state one request carries through the engine.

Sampling and stopping follow SGLang's semantics (`sglang/srt/sampling/sampling_params.py`,
`sglang/srt/managers/schedule_batch.py::Req.check_finished`):

- temperature < 1e-6 is greedy; otherwise the logprob of a sampled token is
  log_softmax(logits / temperature) at that token, in fp32, before top-k/top-p/min-p truncation;
- a request finishes on max_new_tokens ("length", checked first, as SGLang does), then on the
  EOS or a stop token id ("stop", matched=<id>), then on a stop string; an abort is "abort".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

SAMPLING_EPS = 1e-6  # SGLang's _SAMPLING_EPS: temperatures below it mean greedy
PENDING = -1  # token id placeholder: sampled on the GPU, not read back yet (overlapped decode)


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
    sampling_seed: int | None = None  # this request's own random stream; None: the engine's
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
        # beyond SGLang's checks: a bad one would fail inside a step, beside every other request
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}.")

    @property
    def stop_window(self) -> int:
        """The output tokens a stop-string check decodes, the newest last: room for the longest stop
        string at one character a token, twice over, and a token before it (SGLang decodes the
        string's own token count plus one). Decoding the whole output instead took 0.22 ms a
        sequence at 1,024 tokens (SmolLM2's tokenizer): 57 ms of a step at 256 running; a window
        of 26 tokens (a 12-character string), 8 us. An earlier match would have ended the output."""
        return 2 * max(map(len, self.stop), default=0) + 2

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def truncates(self, vocab: int) -> bool:
        """Whether top-k, top-p or min-p cut a vocabulary of `vocab` words (the torch sampler's
        work: the fused one draws from the whole vocabulary)."""
        top_k = vocab if self.top_k < 0 else min(self.top_k, vocab)
        return not self.greedy and (top_k < vocab or self.top_p < 1.0 or self.min_p > 0.0)


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


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()  # queued, or preempted (its KV freed; it is recomputed on return)
    RUNNING = enum.auto()  # holds KV blocks; prefilling in chunks or decoding
    FINISHED = enum.auto()


class Sequence:
    """One request inside the engine: its tokens, KV blocks and outputs.

    `num_computed` counts the leading tokens whose K/V sit in the cache (shared prefix blocks
    included); the tokens after it are what the next forward pass must process.
    """

    __slots__ = (
        "seq_id", "request", "token_ids", "num_prompt", "max_new", "seed", "status",
        "block_table", "num_computed", "num_shared", "output_logprobs", "input_logprobs",
        "finish_reason", "aborted", "tag", "truncates",
    )  # fmt: skip

    def __init__(
        self, seq_id: int, request: GenerateRequest, max_new: int, seed: int, tag: Any = None, vocab: int = 0
    ):
        self.seq_id = seq_id
        self.request = request
        self.token_ids = list(request.input_ids)
        self.num_prompt = len(request.input_ids)
        self.max_new = max_new
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed = 0
        self.num_shared = 0  # leading tokens whose blocks came from another sequence's prefill
        self.output_logprobs: list[float] = []
        self.input_logprobs: list[float | None] = []
        self.finish_reason: dict[str, Any] | None = None
        self.aborted = False
        self.tag = tag  # the caller's handle (the server's pending request)
        # sampled with top-k / top-p / min-p at the engine's vocabulary (looked up every decode step)
        self.truncates = request.sampling.truncates(vocab) if vocab else False

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def wants_input_logprobs(self) -> bool:
        return self.request.logprob_start_len >= 0

    def output(self) -> GenerateOutput:
        return GenerateOutput(
            rid=self.request.rid,
            output_ids=self.output_ids,
            output_logprobs=self.output_logprobs,
            finish_reason=self.finish_reason or abort_reason(),
            input_logprobs=self.input_logprobs,
        )
