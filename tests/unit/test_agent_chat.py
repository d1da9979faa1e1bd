"""`rlx.agent.chat`: a tool or user message appended after a model turn in the chat template's own
form: the ids hand-written for a ChatML-like template, and a conversation built turn by turn equal,
token for token, to the template's rendering of it, on ChatML and on a Qwen3-like template (whose
last assistant message alone is wrapped in a think block)."""

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
TAGS = ["<think>", "</think>", "<tool_response>", "</tool_response>"]
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
    *TAGS,
]
# ChatML with spaces for newlines (the word-level tokenizer splits on whitespace)
CHATML = (
    "{% for m in messages %}" + START + " {{ m['role'] }} {{ m['content'] }} " + END + " {% endfor %}"
    "{% if add_generation_prompt %}" + START + " assistant {% endif %}"
)
# Qwen3's shape: tool results in a user turn, the last assistant message in an (empty) think block
QWEN3_LIKE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}" + START + " assistant {% if loop.last %}<think> </think> {% endif %}"
    "{{ m['content'] }} " + END + " "
    "{% elif m['role'] == 'tool' %}" + START + " user <tool_response> {{ m['content'] }} </tool_response> " + END + " "
    "{% else %}" + START + " {{ m['role'] }} {{ m['content'] }} " + END + " {% endif %}"
    "{% endfor %}{% if add_generation_prompt %}" + START + " assistant {% endif %}"
)  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return _tokenizer(tmp_path_factory.mktemp("chat_tok"), CHATML)


def _tokenizer(path, template):
    write_word_tokenizer(path, VOCAB)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.chat_template = template
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


@pytest.mark.parametrize("template", ["chatml", "qwen3_like"])
@pytest.mark.parametrize("ends_turn", [True, False])
def test_a_conversation_built_turn_by_turn_is_the_templates_rendering(tmp_path, template, ends_turn):
    tok = _tokenizer(tmp_path, {"chatml": CHATML, "qwen3_like": QWEN3_LIKE}[template])
    turns = [("?", "3"), ("3 ?", "4 5")]
    built, rendered = chat_built_and_rendered(tok, "1 + 2 =", turns, ids(tok, END)[0], ends_turn)
    assert built == rendered


def test_a_qwen3_like_tool_turn_is_the_users_with_the_response_tags(tmp_path):
    tok = _tokenizer(tmp_path, QWEN3_LIKE)
    got = chat_message_ids(tok, "tool", "4 2", last_token=ids(tok, END)[0])
    assert got == ids(
        tok, START, "user", "<tool_response>", "4", "2", "</tool_response>", END, START, "assistant"
    )


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
    # a template that drops an assistant message once another message follows
    drops = "{% for m in messages %}{% if loop.last or m['role'] != 'assistant' %}{{ m['content'] }} {% endif %}{% endfor %}"
    other = _tokenizer(tmp_path, drops)
    with pytest.raises(
        ValueError, match="does not write an assistant message followed by a 'tool'.*append_tool_text"
    ):
        chat_message_ids(other, "tool", "3")
    other.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*append_tool_text"):
        chat_message_ids(other, "tool", "3")
    with pytest.raises(ValueError, match="follows a model turn"):
        ctx = GenerateContext(_Client(), tokenizer, RolloutConfig(), version=0)
        append_chat_message(ctx, Sample(prompt="1", prompt_ids=[2]), "3", {"max_new_tokens": 4})
