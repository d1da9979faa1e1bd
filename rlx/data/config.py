"""The `data` config group's schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlx.config.rules import AT_LEAST_1, Rule, one_of

ON_BAD_SAMPLE = ("error", "skip")  # what a source does with a bad row (rlx.data.source)


@dataclass
class DataConfig:
    """Where prompts come from and how they become token ids."""

    _target_: str = "rlx.data.toy.ToySource"  # the DataSource class
    prompt_path: str | None = None  # JSONL file (JsonlSource)
    input_key: str = "prompt"  # key of the prompt (text, or chat messages)
    label_key: str | None = "label"  # key of the label given to the reward function
    apply_chat_template: bool = False  # render prompts with the tokenizer's chat template
    shuffle: bool = True  # reshuffle every epoch (seeded by run.seed and the epoch)
    max_prompt_len: int | None = None  # None: model context - rollout.max_response_len - 1 (SGLang's limit)
    on_bad_sample: str = "error"  # error: stop naming file/line/key; skip: drop and count
    toy_task: str = "reverse"  # ToySource: reverse | copy
    toy_num_digits: int = 3
    toy_num_rows: int = 4096

    RULES: ClassVar[dict[str, Rule]] = {"max_prompt_len": AT_LEAST_1, "on_bad_sample": one_of(ON_BAD_SAMPLE)}
