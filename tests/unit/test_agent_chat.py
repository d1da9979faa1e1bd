"""`rlx.agent.chat`: a tool or user message appended after a model turn in the chat template's own
form: the ids hand-written for a ChatML-like template, and a conversation built turn by turn equal,
token for token, to the template's rendering of the whole."""

from __future__ import annotations

import pytest
from helpers import chat_built_and_rendered
from transformers import PreTrainedTokenizerFast

from rlx.agent.chat import append_chat_message, chat_message_ids
from rlx.models.tiny import EOS, PAD, write_word_tokenizer
from rlx.rollout.config import RolloutConfig
from rlx.rollout.generate import GenerateContext
from rlx.sample import Sample, Status

START, END = "<|im_start|>", "<|im_end|>"
VOCAB = [
    PAD,
    EOS,
    *(str(d) for d in range(10)),
    "=",
    "+",
    "?",
    START,
    END,
    "system",
    "user",
    "assistant",
    "tool",
]
# ChatML with spaces for newlines (the word-level tokenizer splits on whitespace)
CHATML = (
    "{% for m in messages %}" + START + " {{ m['role'] }} {{ m['content'] }} " + END + " {% endfor %}"
    "{% if add_generation_prompt %}" + START + " assistant {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_tok")
    write_word_tokenizer(path, VOCAB)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.chat_template = CHATML
    return tok


def ids(tokenizer, *words: str) -> list[int]:
    return tokenizer.convert_tokens_to_ids(list(words))


def test_the_message_after_a_turn_ended_or_cut(tokenizer):
    ended = chat_message_ids(tokenizer, "tool", "4 2", last_token=ids(tokenizer, END)[0])
    assert ended == ids(tokenizer, START, "tool", "4", "2", END, START, "assistant")
    cut = chat_message_ids(tokenizer, "tool", "4 2", last_token=ids(tokenizer, "7")[0])  # no end of turn
    assert cut == ids(tokenizer, END, START, "tool", "4", "2", END, START, "assistant")
    user = chat_message_ids(tokenizer, "user", "1 + 1 =", last_token=ids(tokenizer, END)[0])
    assert user == ids(tokenizer, START, "user", "1", "+", "1", "=", END, START, "assistant")


@pytest.mark.parametrize("ends_turn", [True, False])
def test_a_conversation_built_turn_by_turn_is_the_templates_rendering(tokenizer, ends_turn):
    turns = [("?", "3"), ("3 ?", "4 5"), ("9", None)]
    built, whole = chat_built_and_rendered(tokenizer, "1 + 2 =", turns, ids(tokenizer, END)[0], ends_turn)
    assert built == (whole if ends_turn else whole[:-1])  # a cut last turn has no end of turn


class _Client:
    base_url = "http://unused"


def test_append_chat_message_keeps_the_message_out_of_the_loss_within_the_budget(tokenizer):
    ctx = GenerateContext(_Client(), tokenizer, RolloutConfig(), version=0)
    s = Sample(prompt="1 + 2 =", prompt_ids=ids(tokenizer, "1", "+", "2", "="))
    ctx.append_tokens(s, ids(tokenizer, "?", END))
    s.loss_mask = [1, 1]  # as a model turn leaves them
    assert append_chat_message(ctx, s, "3", {"max_new_tokens": 20})
    assert s.response_ids[2:] == ids(tokenizer, START, "tool", "3", END, START, "assistant")
    assert s.loss_mask == [1, 1] + [0] * 6 and s.rollout_logprobs[2:] == [0.0] * 6
    assert not append_chat_message(ctx, s, "4", {"max_new_tokens": 12})  # 4 of 6 fit
    assert s.status is Status.TRUNCATED and s.response_len == 12


def test_what_cannot_be_appended_is_refused_with_the_fix(tokenizer, tmp_path):
    strips = "{% for m in messages %}{% if loop.last or m['role'] != 'assistant' %}{{ m['content'] }} {% endif %}{% endfor %}"
    other = PreTrainedTokenizerFast.from_pretrained(str(_write(tmp_path)))
    other.chat_template = (
        strips  # drops an assistant message once another follows (as reasoning strippers do)
    )
    with pytest.raises(
        ValueError, match="renders a conversation's earlier messages differently.*append_tool_text"
    ):
        chat_message_ids(other, "tool", "3")
    other.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*append_tool_text"):
        chat_message_ids(other, "tool", "3")
    with pytest.raises(ValueError, match="follows a model turn"):
        ctx = GenerateContext(_Client(), tokenizer, RolloutConfig(), version=0)
        append_chat_message(ctx, Sample(prompt="1", prompt_ids=[2]), "3", {"max_new_tokens": 4})


def _write(tmp_path):
    write_word_tokenizer(tmp_path, VOCAB)
    return tmp_path
