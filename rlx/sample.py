"""The one record that flows through rollout, reward, advantage and training."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Status(enum.StrEnum):
    """How a sample's generation ended."""

    PENDING = "pending"
    COMPLETED = "completed"  # stopped on EOS, a stop token or a stop string (even on the last token allowed)
    TRUNCATED = "truncated"  # cut by max_new_tokens / the response length limit
    ABORTED = "aborted"  # cancelled (abort_request, weight update, shutdown)
    FAILED = "failed"  # the engine or the reward function raised; see `status_reason`


@dataclass(slots=True)
class Sample:
    """One prompt and (after rollout) one response with everything training needs.

    Token-level lists (`response_ids`, `rollout_logprobs`, `loss_mask`, `token_versions`) all
    have length `response_len`; `loss_mask[t] == 0` excludes token t from the loss (tool output,
    say). A sample whose generation was aborted (partial rollout) keeps what it has and continues
    from there: its prompt for the engine is `tokens`.
    """

    prompt: str | list[dict[str, str]]
    prompt_ids: list[int]
    label: Any = None
    group: int = 0  # index of the prompt group within the rollout batch
    index: int = 0  # index of the sample within its group
    response_ids: list[int] = field(default_factory=list)
    response_text: str = ""
    rollout_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    reward: float | None = None
    status: Status = Status.PENDING
    status_reason: str = ""
    # policy version of the weights that generated the response: the oldest of `token_versions`
    # when a partial rollout continued it under newer weights
    version: int = -1
    token_versions: list[int] = field(default_factory=list)  # per response token (partial rollouts)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def to_json(self) -> dict[str, Any]:
        """The row written to `rollouts/step_NNNNNN.jsonl`; `from_json` rebuilds the sample."""
        return {
            "prompt": self.prompt,
            "group": self.group,
            "index": self.index,
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "response_text": self.response_text,
            "rollout_logprobs": self.rollout_logprobs,
            "reward": self.reward,
            "status": self.status.value,
            "status_reason": self.status_reason,
            "version": self.version,
            "token_versions": self.token_versions,
            "loss_mask": self.loss_mask,
            "label": self.label,
            "metadata": self.metadata,
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> Sample:
        """The sample `to_json` wrote (a rollout dump row, a buffer checkpoint entry)."""
        fields = dict(row)
        fields["status"] = Status(fields["status"])
        return cls(**fields)
