"""A user's own DataSource by `data._target_` (slime's custom data source): composed, validated
through its own `config_errors`, built like the built-in sources, and resumed exactly. CPU."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from transformers import AutoTokenizer

from rlx.config import build
from rlx.config.compose import compose, to_object
from rlx.data.config import DataConfig
from rlx.errors import ConfigError
from rlx.models.tiny import write_word_tokenizer
from rlx.sample import Sample


class SumSource:
    """An endless stream of "a + b =" prompts labelled with (a + b) mod 10; prompt k is drawn
    from (seed, k) alone, so the position is the whole state."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, *, seed: int, max_prompt_len: int):
        self.tokenizer, self.seed, self.next = tokenizer, seed, 0

    @classmethod
    def config_errors(cls, cfg: DataConfig) -> list[str]:
        if cfg.prompt_path:
            return ["SumSource makes its prompts; drop data.prompt_path"]
        return []

    def take(self, num_prompts: int) -> list[Sample]:
        samples = []
        for k in range(self.next, self.next + num_prompts):
            a, b = random.Random(f"{self.seed}:{k}").choices(range(10), k=2)
            prompt = f"{a} + {b} ="
            samples.append(
                Sample(prompt=prompt, prompt_ids=self.tokenizer.encode(prompt), label=str((a + b) % 10))
            )
        self.next += num_prompts
        return samples

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next = state["next"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    write_word_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def built(rc, tokenizer):
    return build(rc.data, tokenizer, seed=rc.run.seed, max_prompt_len=16)


def test_custom_source_composes_builds_and_resumes_exactly(tokenizer):
    rc = to_object(compose([f"data._target_={__name__}.SumSource", "run.seed=5"]))
    source = built(rc, tokenizer)
    assert isinstance(source, SumSource)
    first = source.take(3)
    for s in first:
        a, plus, b, equals = s.prompt.split()
        assert (plus, equals) == ("+", "=") and s.label == str((int(a) + int(b)) % 10)
        # "0".."9" are ids 2..11, "+" 13, "=" 12
        assert s.prompt_ids == [int(a) + 2, 13, int(b) + 2, 12]
    state = json.loads(json.dumps(source.state_dict()))
    expected = [(s.prompt, s.label) for s in source.take(4)]

    resumed = built(rc, tokenizer)
    resumed.load_state_dict(state)
    assert [(s.prompt, s.label) for s in resumed.take(4)] == expected
    assert [(s.prompt, s.label) for s in built(rc, tokenizer).take(3)] == [(s.prompt, s.label) for s in first]


def test_custom_source_reports_its_own_config_mistakes(tmp_path):
    with pytest.raises(ConfigError, match=r"SumSource makes its prompts; drop data\.prompt_path"):
        compose([f"data._target_={__name__}.SumSource", f"data.prompt_path={tmp_path}/p.jsonl"])
