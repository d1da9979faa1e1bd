"""Where rollout prompts come from: the DataSource contract, the row logic every built-in source
shares (keys, filter, metadata, chat messages, system prompt, tokenisation, epochs, deterministic
shuffle, exact resume), and FileSource (JSON lines, JSON arrays, Parquet)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlx.config.build import locate, verdict
from rlx.data.checks import eval_set_errors, format_errors, json_problem, prompt_problem
from rlx.data.config import ON_BAD_SAMPLE, DataConfig, key_name
from rlx.data.readers import BadRow, columns, path_errors, read_rows
from rlx.errors import ConfigError, DataError
from rlx.sample import Sample

log = logging.getLogger(__name__)

_TOKENIZE_CHUNK = 1024  # prompts per tokenizer call: batched for speed, bounded for memory
RESERVED_METADATA = ("prompt_index", "eval_set")  # sample.metadata keys rlx sets itself

RowFilter = Callable[[dict[str, Any]], bool]
Messages = list[dict[str, Any]]


class DataSource(Protocol):
    """An endless, resumable stream of prompts; `data._target_` names the class.

    Built as `Cls(cfg.data, tokenizer, seed=cfg.run.seed, max_prompt_len=...)`
    (`rlx.config.build(cfg.data, tokenizer, seed=..., max_prompt_len=...)`), where `tokenizer` is
    the model's HF tokenizer and `max_prompt_len` is `data.max_prompt_len` or, when that is None,
    `model.max_position_embeddings - rollout.max_response_len - 1` (SGLang refuses a request whose
    input and max_new_tokens reach the context length). A custom class receives the whole
    `DataConfig` and reads the keys it needs (it cannot add keys: the schema is typed).

    The constructor should check its data before returning, so bad data fails before any model
    is built; the built-in sources raise `rlx.errors.DataError` naming the file, line (or row
    index) and key, or, with `data.on_bad_sample=skip`, drop bad rows and count them.

    - `take(num_prompts)` returns `num_prompts` fresh Samples (`prompt`, `prompt_ids` and `label`
      set, `metadata` a dict the sample owns; one per prompt, not yet repeated per group). It never
      runs dry: the built-in sources wrap around into the next epoch, reshuffled by seed and epoch
      when `data.shuffle` is set.
    - `state_dict()` returns a JSON-serialisable dict; `load_state_dict(state)` on a source built
      from the same config and seed restores the position, so that a resumed run takes exactly
      the prompts the original run would have taken next. A source that cannot resume with the
      data it now has raises DataError saying why.

    A class may also define `config_errors(cfg: DataConfig) -> list[str]` (a classmethod), which
    `rlx.config.validate` calls to report its own config mistakes before anything starts, and a
    `longest_prompt` attribute (the tokens of the longest prompt it will give), by which the run
    sizes its engines' KV caches on GPUs (without it: by `max_prompt_len`).
    """

    def take(self, num_prompts: int) -> list[Sample]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True, slots=True)
class Prompt:
    """One validated dataset row."""

    prompt: str | Messages  # as in the data (text or chat messages; no system prompt added)
    prompt_ids: tuple[int, ...]  # the rendered prompt (chat template, system prompt) as tokens
    label: Any
    metadata: dict[str, Any] = field(default_factory=dict)  # the row's data.metadata_key object


class PromptSource:
    """The DataSource behaviour shared by the built-in sources.

    A subclass's constructor calls `super().__init__`, then `_add_row` for every row read from a
    file (or `_add` for a prompt it made itself, `_reject` for a row it cannot parse), then
    `_finish`, which tokenises and checks them all. `eval_set` names the `data.eval` set being
    read, so that messages name that set's keys.
    """

    def __init__(
        self, cfg: DataConfig, tokenizer: Any, *, seed: int, max_prompt_len: int, eval_set: str | None = None
    ):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.seed = seed
        self.max_prompt_len = max_prompt_len
        self.eval_set = eval_set
        self.prompts: list[Prompt] = []
        self.skipped: list[str] = []  # one message per dropped row (on_bad_sample=skip)
        self.skip_reasons: Counter[str] = Counter()  # dropped rows per kind of problem
        self.num_filtered = 0  # rows the row filter (data.filter) left out
        self._pending: list[tuple[str, str | Messages, str, Any, dict[str, Any]]] = []
        self._epoch = 0
        self._position = 0  # index into this epoch's order of the next prompt to take
        self._order: list[int] = []
        self._fingerprint = ""
        if cfg.on_bad_sample not in ON_BAD_SAMPLE:
            raise DataError(
                f"{self._key('on_bad_sample')}={cfg.on_bad_sample!r} is not one of {list(ON_BAD_SAMPLE)}"
            )
        if cfg.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{self._key('apply_chat_template')}=true but the tokenizer has no chat template; "
                f"set {self._key('apply_chat_template')}=false, or use a model whose tokenizer has one"
            )
        errors = format_errors(cfg, eval_set)
        if errors:
            raise ConfigError("\n".join(errors))
        self._filter: RowFilter | None = locate(cfg.filter) if cfg.filter else None

    @classmethod
    def config_errors(cls, cfg: DataConfig) -> list[str]:
        """Mistakes in the keys every built-in source reads, and in every `data.eval` set."""
        return format_errors(cfg) + eval_set_errors(cfg)

    def _key(self, name: str) -> str:
        return key_name(name, self.eval_set)

    # ---- the DataSource contract -------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The number of completed passes over the prompts."""
        return self._epoch

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def longest_prompt(self) -> int:
        """Tokens of the longest prompt kept (what the engines' KV caches are sized by)."""
        return max((len(p.prompt_ids) for p in self.prompts), default=0)

    def take(self, num_prompts: int) -> list[Sample]:
        samples: list[Sample] = []
        while len(samples) < num_prompts:
            end = min(len(self._order), self._position + num_prompts - len(samples))
            samples += [self._sample(i) for i in self._order[self._position : end]]
            self._position = end
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._permutation(self._epoch)
        return samples

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "num_prompts": len(self.prompts),
            "fingerprint": self._fingerprint,
            "seed": self.seed,
            "shuffle": self.cfg.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The order is recomputed from (seed, shuffle, epoch), so it must be the same data and
        # settings, or "resume" would silently take different prompts.
        mine = self.state_dict()
        for key, setting in (
            ("num_prompts", "data"),
            ("fingerprint", "data"),
            ("seed", "run.seed"),
            ("shuffle", "data.shuffle"),
        ):
            if state.get(key) != mine[key]:
                raise DataError(
                    f"cannot resume the data position: {key} is {state.get(key)!r} in the checkpoint but "
                    f"{mine[key]!r} now; resume with the same {setting} as the original run"
                )
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self._epoch)

    # ---- loading, for subclasses -------------------------------------------------------------

    def _add_row(self, where: str, row: dict[str, Any]) -> None:
        """Queue one row read from a file: filter, keys, label and metadata, then `_add`."""
        if self._filter is not None and not self._keeps(where, row):
            self.num_filtered += 1
            return
        keys = [("input", self.cfg.input_key), ("label", self.cfg.label_key)]
        for kind, key in (*keys, ("metadata", self.cfg.metadata_key)):
            if key is not None and key not in row:
                setting = self._key(f"{kind}_key")
                fix = f"set {setting} to the key that holds the {'prompt' if kind == 'input' else kind}"
                if kind != "input":
                    fix += f" (or {setting}=null)"
                return self._reject(
                    where,
                    f"missing {kind} key",
                    f"no key {key!r} ({setting}); the row has keys {sorted(row)}",
                    f"{fix}, or set {self._key('on_bad_sample')}=skip",
                )
        label = row[self.cfg.label_key] if self.cfg.label_key is not None else None
        if self.cfg.label_key is not None and label is None:
            return self._reject(
                where, "null label", f"the label ({self._key('label_key')}={self.cfg.label_key!r}) is null"
            )
        metadata = row[self.cfg.metadata_key] if self.cfg.metadata_key is not None else {}
        if not isinstance(metadata, dict):
            return self._reject(
                where,
                "bad metadata",
                f"the metadata ({self._key('metadata_key')}={self.cfg.metadata_key!r}) must be an object "
                f"(a dict), got {type(metadata).__name__}",
            )
        if clash := sorted(set(metadata) & set(RESERVED_METADATA)):
            return self._reject(
                where, "bad metadata", f"metadata keys {clash} are set by rlx itself; rename them in the data"
            )
        self._add(where, row[self.cfg.input_key], label, metadata)

    def _keeps(self, where: str, row: dict[str, Any]) -> bool:
        what = f"{where}: the row filter {self._key('filter')}={self.cfg.filter!r}"
        fix = "\nfix: make the filter return True (keep the row) or False (leave it out) for every row"
        return verdict(self._filter, row, what, DataError, fix)

    def _add(self, where: str, prompt: Any, label: Any, metadata: dict[str, Any] | None = None) -> None:
        """Queue one prompt (text or chat messages) after checking its shape and its label's."""
        if problem := prompt_problem(prompt, self._key("input_key"), self.cfg.input_key):
            return self._reject(where, *problem)
        if isinstance(prompt, list) and not self.cfg.apply_chat_template:
            setting = self._key("apply_chat_template")
            return self._reject(
                where,
                "chat messages without template",
                f"the prompt is a list of chat messages but {setting}=false",
                f"set {setting}=true: chat prompts are rendered by the tokenizer's chat template",
            )
        if problem := json_problem(label):
            return self._reject(
                where,
                "bad label type",
                f"the label ({self._key('label_key')}) {problem}; labels are JSON values",
            )
        if self.cfg.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if self.cfg.system_prompt and messages[0]["role"] != "system":  # a row's own system message wins
                messages = [{"role": "system", "content": self.cfg.system_prompt}, *messages]
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            except Exception as e:  # a user's template can raise anything
                return self._reject(
                    where, "chat template failed", f"the chat template failed: {type(e).__name__}: {e}"
                )
        else:
            text = prompt
        self._pending.append((where, prompt, text, label, metadata or {}))

    def _reject(self, where: str, reason: str, detail: str, fix: str = "") -> None:
        """A bad row: raise (on_bad_sample=error) or drop and count it (skip)."""
        message = f"{where}: {detail}"
        if self.cfg.on_bad_sample == "skip":
            self.skipped.append(message)
            self.skip_reasons[reason] += 1
            return
        fix = fix or f"fix the row, or set {self._key('on_bad_sample')}=skip to drop bad rows"
        raise DataError(f"{message}\nfix: {fix}")

    def _finish(self, name: str) -> None:
        """Tokenise the queued prompts, check their lengths, and start epoch 0."""
        # Chat templates already contain the special tokens (BOS) they need.
        add_special_tokens = not self.cfg.apply_chat_template
        for start in range(0, len(self._pending), _TOKENIZE_CHUNK):
            chunk = self._pending[start : start + _TOKENIZE_CHUNK]
            texts = [text for _, _, text, _, _ in chunk]
            ids = self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
            for (where, prompt, _, label, metadata), prompt_ids in zip(chunk, ids, strict=True):
                self._check_and_keep(where, Prompt(prompt, tuple(prompt_ids), label, metadata))
        self._pending = []
        if self.num_filtered:
            log.info("%s: the row filter %s left out %d rows", name, self.cfg.filter, self.num_filtered)
        if self.skipped:
            log.warning(
                "%s: skipped %d bad rows (%s); first: %s",
                name,
                self.num_skipped,
                dict(self.skip_reasons),
                self.skipped[0],
            )
        if not self.prompts:
            raise DataError(
                f"{name}: no usable prompts ({self.num_skipped} rows skipped: {dict(self.skip_reasons)}; "
                f"{self.num_filtered} left out by the row filter)"
            )
        digest = hashlib.sha1()
        for p in self.prompts:
            digest.update(json.dumps([p.prompt_ids, p.label], default=str).encode())
        self._fingerprint = digest.hexdigest()[:16]
        self._order = self._permutation(0)

    def _check_and_keep(self, where: str, prompt: Prompt) -> None:
        if not prompt.prompt_ids:
            return self._reject(where, "empty prompt", "the prompt tokenises to no tokens")
        if len(prompt.prompt_ids) > self.max_prompt_len:
            setting = "data.max_prompt_len"  # eval sets share it
            room = (  # the limit the user set, or what the response leaves of the context
                f"raise {setting} (within the model's context)"
                if self.cfg.max_prompt_len
                else "lower rollout.max_response_len (the prompt gets the context it leaves)"
            )
            return self._reject(
                where,
                "prompt too long",
                f"the prompt is {len(prompt.prompt_ids)} tokens, longer than the limit of "
                f"{self.max_prompt_len} ({setting}, default model.max_position_embeddings - "
                "rollout.max_response_len - 1)",
                f"shorten the prompt, {room}, "
                f"or set {self._key('on_bad_sample')}=skip to drop prompts that are too long",
            )
        self.prompts.append(prompt)

    # ---- order -------------------------------------------------------------------------------

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.cfg.shuffle:
            # String seeds hash with SHA-512 in `random`, independent of PYTHONHASHSEED.
            random.Random(f"rlx.data:{self.seed}:{epoch}").shuffle(order)
        return order

    def _sample(self, index: int) -> Sample:
        p = self.prompts[index]
        metadata = {**copy.deepcopy(p.metadata), "prompt_index": index}  # each sample owns its dicts
        return Sample(
            prompt=copy.deepcopy(p.prompt), prompt_ids=list(p.prompt_ids), label=p.label, metadata=metadata
        )


class FileSource(PromptSource):
    """Prompts from `data.prompt_path`: a `.jsonl`, `.json` or `.parquet` file (rlx.data.readers).

    The prompt is `row[data.input_key]`, a string or a list of chat messages; the label is
    `row[data.label_key]` (any JSON value but null; None when `data.label_key` is null); the
    object `row[data.metadata_key]` is copied into `sample.metadata`.
    """

    def __init__(
        self, cfg: DataConfig, tokenizer: Any, *, seed: int, max_prompt_len: int, eval_set: str | None = None
    ):
        super().__init__(cfg, tokenizer, seed=seed, max_prompt_len=max_prompt_len, eval_set=eval_set)
        errors = path_errors(self._key("prompt_path"), cfg.prompt_path)
        if errors:
            raise DataError("\n".join(errors))
        self._check_columns()
        for where, row in read_rows(cfg.prompt_path):
            if isinstance(row, BadRow):
                self._reject(where, row.reason, row.detail)
            else:
                self._add_row(where, row)
        self._finish(str(cfg.prompt_path))

    @classmethod
    def config_errors(cls, cfg: DataConfig) -> list[str]:
        return path_errors("data.prompt_path", cfg.prompt_path) + super().config_errors(cfg)

    def _check_columns(self) -> None:
        """A key missing from a Parquet file's schema is missing from every row: say so once."""
        names = columns(self.cfg.prompt_path)
        if names is None:
            return
        for kind in ("input", "label", "metadata"):
            key = getattr(self.cfg, f"{kind}_key")
            if key is not None and key not in names:
                setting = self._key(f"{kind}_key")
                raise DataError(
                    f"{self.cfg.prompt_path}: no column {key!r} ({setting}); the file has columns {names}\n"
                    f"fix: set {setting} to the column that holds the {'prompt' if kind == 'input' else kind}"
                )
