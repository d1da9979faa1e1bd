"""The `data` config group's schema: training prompts and the evaluation sets (`data.eval`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

from rlx.config.rules import AT_LEAST_1, NON_NEGATIVE, Rule, one_of

ON_BAD_SAMPLE = ("error", "skip")  # what a source does with a bad row (rlx.data.source)
FILE_SOURCE = "rlx.data.source.FileSource"  # reads data.prompt_path and every data.eval set


@dataclass
class EvalSetConfig:
    """One evaluation set, `data.eval.NAME`: a file read like `data.prompt_path`, all of its
    prompts in file order (`rlx.eval.build_eval_sets`).

    A field left null takes the value of the same `data.*` key, so eval prompts are keyed and
    formatted like the training prompts; set `system_prompt` or `metadata_key` to "" for none.
    """

    path: str | None = None  # required: a .jsonl, .json or .parquet file
    input_key: str | None = None  # null: data.input_key
    label_key: str | None = None  # null: data.label_key
    metadata_key: str | None = None  # null: data.metadata_key
    system_prompt: str | None = None  # null: data.system_prompt
    apply_chat_template: bool | None = None  # null: data.apply_chat_template
    on_bad_sample: str | None = None  # null: data.on_bad_sample
    filter: str | None = None  # this set's row filter; data.filter (a training filter) is not applied
    # how this set is sampled (rlx.eval.runner), so one file can be read greedily and with k samples:
    n_samples_per_prompt: int | None = None  # responses per prompt; null: rollout.n_samples_per_eval_prompt
    temperature: float | None = None  # 0: greedy; null: rollout.eval_temperature, else rollout.temperature

    RULES: ClassVar[dict[str, Rule]] = {
        "on_bad_sample": one_of(ON_BAD_SAMPLE),
        "n_samples_per_prompt": AT_LEAST_1,
        "temperature": NON_NEGATIVE,
    }


@dataclass
class DataConfig:
    """Where prompts come from and how they become token ids."""

    _target_: str = "rlx.data.toy.ToySource"  # the DataSource class (rlx.data.source.DataSource)
    prompt_path: str | None = None  # FileSource: a .jsonl, .json or .parquet file (by extension)
    input_key: str = "prompt"  # key of the prompt (text, or a list of chat messages)
    label_key: str | None = "label"  # key of the label given to the reward function; null: no label
    metadata_key: str | None = None  # key of a per-row object copied into sample.metadata
    system_prompt: str | None = None  # prepended as a system message (needs apply_chat_template)
    apply_chat_template: bool = False  # render prompts with the tokenizer's chat template
    filter: str | None = None  # dotted path of a row filter, (row: dict) -> bool, applied when reading
    shuffle: bool = True  # reshuffle every epoch (seeded by run.seed and the epoch)
    max_prompt_len: int | None = None  # None: model context - rollout.max_response_len - 1 (SGLang's limit)
    on_bad_sample: str = "error"  # error: stop naming file/line/key; skip: drop and count
    toy_task: str = "reverse"  # ToySource: one of rlx.data.toy.TASKS
    toy_num_digits: int = 3
    toy_num_rows: int = 4096
    # name -> evaluation set; null: none (data.eval=null drops an experiment's sets)
    eval: dict[str, EvalSetConfig] | None = field(default_factory=dict)

    RULES: ClassVar[dict[str, Rule]] = {"max_prompt_len": AT_LEAST_1, "on_bad_sample": one_of(ON_BAD_SAMPLE)}

    def __post_init__(self):
        if self.eval is None:  # Hydra merges `data.eval={}` into the sets there; null replaces them
            self.eval = {}


def eval_set_config(data: DataConfig, name: str) -> DataConfig:
    """`data.eval[name]` as the DataConfig a FileSource reads: null fields inherited from `data`,
    file order (no shuffle), no training filter, no nested eval sets."""
    s = data.eval[name]

    def pick(value, inherited):
        return inherited if value is None else value

    return replace(
        data,
        _target_=FILE_SOURCE,
        prompt_path=s.path,
        input_key=pick(s.input_key, data.input_key),
        label_key=pick(s.label_key, data.label_key),
        metadata_key=pick(s.metadata_key, data.metadata_key) or None,
        system_prompt=pick(s.system_prompt, data.system_prompt) or None,
        apply_chat_template=pick(s.apply_chat_template, data.apply_chat_template),
        on_bad_sample=pick(s.on_bad_sample, data.on_bad_sample),
        filter=s.filter,
        shuffle=False,
        eval={},
    )


def key_name(name: str, eval_set: str | None = None) -> str:
    """The full config key of DataConfig field `name`, or of that field in `data.eval.<eval_set>`
    (where `prompt_path` is called `path`), for messages that tell the user what to set."""
    if eval_set is None:
        return f"data.{name}"
    return f"data.eval.{eval_set}.{'path' if name == 'prompt_path' else name}"
