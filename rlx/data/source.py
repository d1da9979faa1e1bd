"""Where rollout prompts come from: the DataSource contract, the machinery every built-in source
shares (validation, tokenisation, epochs, deterministic shuffle, exact resume), and JSONL files."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hydra.utils import to_absolute_path

from rlx.data.config import ON_BAD_SAMPLE, DataConfig
from rlx.errors import DataError
from rlx.sample import Sample

log = logging.getLogger(__name__)

_TOKENIZE_CHUNK = 1024  # prompts per tokenizer call: batched for speed, bounded for memory


class DataSource(Protocol):
    """An endless, resumable stream of prompts.

    Built as `Cls(cfg.data, tokenizer, seed=cfg.run.seed, max_prompt_len=...)` with the class
    named by `data._target_` (`rlx.config.build(cfg.data, tokenizer, seed=..., max_prompt_len=...)`),
    where `tokenizer` is the model's HF tokenizer and `max_prompt_len` is `data.max_prompt_len` or,
    when that is None, `model.max_position_embeddings - rollout.max_response_len - 1` (SGLang refuses
    a request whose input and max_new_tokens reach the context length).

    The constructor reads, tokenises and checks every prompt, so bad data fails before any model
    is built; it raises `rlx.errors.DataError` naming the file, line and key, or, with
    `data.on_bad_sample=skip`, drops the bad rows and counts them in `num_skipped`.

    - `take(num_prompts)` returns `num_prompts` fresh Samples (`prompt`, `prompt_ids`, `label`
      set; one per prompt, not yet repeated per group), wrapping around into the next epoch as
      often as needed. With `data.shuffle` each epoch's order is a permutation that depends only
      on the seed and the epoch number.
    - `epoch` is the number of completed passes over the prompts.
    - `state_dict()` / `load_state_dict(state)` save and restore the position, so a resumed run
      takes exactly the prompts the original run would have taken next.

    A class may also define `config_errors(cfg: DataConfig) -> list[str]` (a classmethod), which
    `rlx.config.validate` calls to report its own config mistakes before anything starts.
    """

    @property
    def epoch(self) -> int: ...

    def take(self, num_prompts: int) -> list[Sample]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True, slots=True)
class Prompt:
    """One validated dataset row."""

    prompt: str | list[dict[str, str]]  # as in the data (text or chat messages)
    prompt_ids: tuple[int, ...]
    label: Any


class PromptSource:
    """The DataSource behaviour shared by the built-in sources.

    A subclass's constructor calls `super().__init__`, then `_add` for every row (or `_reject`
    for a row it cannot parse), then `_finish`, which tokenises and checks them all.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any, *, seed: int, max_prompt_len: int):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.seed = seed
        self.max_prompt_len = max_prompt_len
        self.prompts: list[Prompt] = []
        self.skipped: list[str] = []  # one message per dropped row (on_bad_sample=skip)
        self.skip_reasons: Counter[str] = Counter()  # dropped rows per kind of problem
        self._pending: list[tuple[str, str | list[dict[str, str]], str, Any]] = []
        self._epoch = 0
        self._position = 0  # index into this epoch's order of the next prompt to take
        self._order: list[int] = []
        self._fingerprint = ""
        if cfg.on_bad_sample not in ON_BAD_SAMPLE:
            raise DataError(f"data.on_bad_sample={cfg.on_bad_sample!r} is not one of {list(ON_BAD_SAMPLE)}")
        if cfg.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "data.apply_chat_template=true but the tokenizer has no chat template; "
                "set data.apply_chat_template=false, or use a model whose tokenizer has one"
            )

    # ---- the DataSource contract -------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def __len__(self) -> int:
        return len(self.prompts)

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

    def _add(self, where: str, prompt: Any, label: Any) -> None:
        """Queue one row's prompt (text or chat messages) after checking its shape."""
        if isinstance(prompt, list):
            if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
                return self._reject(
                    where, "bad prompt type", "chat messages must be {'role': ..., 'content': ...} objects"
                )
            if not self.cfg.apply_chat_template:
                return self._reject(
                    where,
                    "chat messages without template",
                    "the prompt is a list of chat messages but data.apply_chat_template=false; "
                    "set data.apply_chat_template=true",
                )
        elif not isinstance(prompt, str):
            return self._reject(
                where,
                "bad prompt type",
                f"the prompt must be a string or a list of chat messages, got {type(prompt).__name__}",
            )
        if not prompt or (isinstance(prompt, str) and not prompt.strip()):
            return self._reject(
                where, "empty prompt", f"empty prompt (data.input_key={self.cfg.input_key!r})"
            )
        if self.cfg.apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
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
        self._pending.append((where, prompt, text, label))

    def _reject(self, where: str, reason: str, detail: str, fix: str = "") -> None:
        """A bad row: raise (on_bad_sample=error) or drop and count it (skip)."""
        message = f"{where}: {detail}"
        if self.cfg.on_bad_sample == "skip":
            self.skipped.append(message)
            self.skip_reasons[reason] += 1
            return
        fix = fix or "fix the row, or set data.on_bad_sample=skip to drop bad rows"
        raise DataError(f"{message}\nfix: {fix}")

    def _finish(self, name: str) -> None:
        """Tokenise the queued prompts, check their lengths, and start epoch 0."""
        # Chat templates already contain the special tokens (BOS) they need.
        add_special_tokens = not self.cfg.apply_chat_template
        for start in range(0, len(self._pending), _TOKENIZE_CHUNK):
            chunk = self._pending[start : start + _TOKENIZE_CHUNK]
            ids = self.tokenizer([text for _, _, text, _ in chunk], add_special_tokens=add_special_tokens)[
                "input_ids"
            ]
            for (where, prompt, _, label), prompt_ids in zip(chunk, ids, strict=True):
                self._check_and_keep(where, prompt, prompt_ids, label)
        self._pending = []
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
                f"{name}: no usable prompts ({self.num_skipped} rows skipped: {dict(self.skip_reasons)})"
            )
        digest = hashlib.sha1()
        for p in self.prompts:
            digest.update(json.dumps([p.prompt_ids, p.label], default=str).encode())
        self._fingerprint = digest.hexdigest()[:16]
        self._order = self._permutation(0)

    def _check_and_keep(self, where: str, prompt: Any, prompt_ids: list[int], label: Any) -> None:
        if not prompt_ids:
            return self._reject(where, "empty prompt", "the prompt tokenises to no tokens")
        if len(prompt_ids) > self.max_prompt_len:
            return self._reject(
                where,
                "prompt too long",
                f"the prompt is {len(prompt_ids)} tokens, longer than the limit of {self.max_prompt_len} "
                "(data.max_prompt_len, default model.max_position_embeddings - rollout.max_response_len)",
                "shorten the prompt, raise data.max_prompt_len (within the model's context), "
                "or set data.on_bad_sample=skip to drop prompts that are too long",
            )
        self.prompts.append(Prompt(prompt, tuple(prompt_ids), label))

    # ---- order -------------------------------------------------------------------------------

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.cfg.shuffle:
            # String seeds hash with SHA-512 in `random`, independent of PYTHONHASHSEED.
            random.Random(f"rlx.data:{self.seed}:{epoch}").shuffle(order)
        return order

    def _sample(self, index: int) -> Sample:
        p = self.prompts[index]
        return Sample(
            prompt=p.prompt, prompt_ids=list(p.prompt_ids), label=p.label, metadata={"prompt_index": index}
        )


class JsonlSource(PromptSource):
    """Prompts from a JSONL file: one JSON object per line (blank lines are ignored).

    The prompt is `row[data.input_key]`, a string or a list of chat messages; the label is
    `row[data.label_key]` (any JSON value; None when `data.label_key` is null).
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any, *, seed: int, max_prompt_len: int):
        super().__init__(cfg, tokenizer, seed=seed, max_prompt_len=max_prompt_len)
        errors = self.config_errors(cfg)
        if errors:
            raise DataError("\n".join(errors))
        self.path = Path(to_absolute_path(str(Path(cfg.prompt_path).expanduser())))
        self._read()
        self._finish(str(cfg.prompt_path))

    @classmethod
    def config_errors(cls, cfg: DataConfig) -> list[str]:
        if not cfg.prompt_path:
            return ["data.prompt_path is not set; set data.prompt_path=/path/to/prompts.jsonl"]
        path = Path(to_absolute_path(str(Path(cfg.prompt_path).expanduser())))
        if not path.is_file():
            return [
                f"data.prompt_path={cfg.prompt_path!r}: no such file ({path}); point data.prompt_path at a JSONL file"
            ]
        return []

    def _read(self) -> None:
        with open(self.path, "rb") as f:  # decoded per line, so a bad byte is reported with its line
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"{self.cfg.prompt_path}:{lineno}"
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    self._reject(where, "not UTF-8", f"not UTF-8 text: {e}")
                    continue
                except json.JSONDecodeError as e:
                    self._reject(where, "malformed JSON", f"malformed JSON: {e}")
                    continue
                if not isinstance(row, dict):
                    self._reject(where, "not an object", f"expected a JSON object, got {type(row).__name__}")
                    continue
                self._add_row(where, row)

    def _add_row(self, where: str, row: dict[str, Any]) -> None:
        cfg = self.cfg
        if cfg.input_key not in row:
            return self._reject(
                where,
                "missing input key",
                f"no key {cfg.input_key!r} (data.input_key); the row has keys {sorted(row)}",
                "set data.input_key to the key that holds the prompt, or set data.on_bad_sample=skip",
            )
        if cfg.label_key is not None and cfg.label_key not in row:
            return self._reject(
                where,
                "missing label key",
                f"no key {cfg.label_key!r} (data.label_key); the row has keys {sorted(row)}",
                "set data.label_key to the key that holds the label (or data.label_key=null for "
                "unlabelled prompts), or set data.on_bad_sample=skip",
            )
        self._add(where, row[cfg.input_key], row[cfg.label_key] if cfg.label_key is not None else None)
