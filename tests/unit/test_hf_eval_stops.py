"""`rlx.tools.hf_eval.generate_greedy` ends a response where the engines would: EOS, a stop token
(`rollout.stop_token_ids`) or a stop string (`rollout.stop`), on transformers' greedy decoding."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlx.sample import Sample, Status
from rlx.tools.hf_eval import generate_greedy


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_qwen3_dir):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir)).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))


def _samples(tokenizer) -> list[Sample]:
    prompts = ["1 2 3", "4 5 + 6", "7 = 8 9"]
    return [Sample(prompt=p, prompt_ids=tokenizer(p)["input_ids"]) for p in prompts]


def test_a_stop_string_or_token_ends_the_response_at_its_first_match(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    free = _samples(tokenizer)
    generate_greedy(model, tokenizer, free, max_new_tokens=8, batch_size=2)
    words = [tokenizer.decode([t], skip_special_tokens=True) for t in free[0].response_ids]
    stop = next(w for w in words[1:] if w)  # a word the first response writes after its first token
    assert words.index(stop) + 1 < len(words)  # so that its response is cut
    stopped = _samples(tokenizer)
    generate_greedy(model, tokenizer, stopped, max_new_tokens=8, batch_size=2, stop_strings=[stop])
    for before, after in zip(free, stopped, strict=True):  # each row cut at its own first match
        row = [tokenizer.decode([t], skip_special_tokens=True) for t in before.response_ids]
        end = row.index(stop) + 1 if stop in row else len(row)
        assert after.response_ids == before.response_ids[:end]
        assert after.status is (Status.COMPLETED if stop in row else before.status)
    token = free[1].response_ids[2]  # the same by a stop token
    by_id = _samples(tokenizer)
    generate_greedy(model, tokenizer, by_id, max_new_tokens=8, batch_size=2, stop_ids=[token])
    assert by_id[1].response_ids == free[1].response_ids[: free[1].response_ids.index(token) + 1]
    assert by_id[1].status is Status.COMPLETED


def test_only_the_given_ids_end_a_row_not_the_checkpoints_generation_config(model_and_tokenizer):
    """The recheck passes the ids the engines stop on (`rlx.rollout.generate.stop_ids`: EOS
    included); transformers' own generation_config EOS must not end a row besides them."""
    model, tokenizer = model_and_tokenizer
    free = _samples(tokenizer)
    generate_greedy(model, tokenizer, free, max_new_tokens=8, batch_size=2)
    assert {len(s.response_ids) for s in free} == {8} and {s.status for s in free} == {Status.TRUNCATED}
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = free[0].response_ids[1]
    try:
        again = _samples(tokenizer)
        generate_greedy(model, tokenizer, again, max_new_tokens=8, batch_size=2)
    finally:
        model.generation_config.eos_token_id = saved
    assert [s.response_ids for s in again] == [s.response_ids for s in free]
