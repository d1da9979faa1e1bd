"""LocalEngine against transformers itself: logprobs, greedy tokens, stopping, weight loading (CPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_SHAPE
from transformers import AutoModelForCausalLM

from rlx.engine import GenerateRequest, SamplingParams
from rlx.engine.local import LocalEngine
from rlx.engine.serve.protocol import parse_sampling_params

PROMPTS = [[5], [2, 3, 4], [9, 8, 7, 6, 5, 4, 12], [3, 13, 2, 14, 6, 11, 10, 4, 7, 12, 15, 2]]
EOS = 1


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir) -> LocalEngine:
    return LocalEngine(str(tiny_qwen3_dir), seed=0)


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32).eval()


@torch.no_grad()
def reference_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each output token, from one full forward pass in transformers."""
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def requests(sampling: dict, prompts=PROMPTS) -> list[GenerateRequest]:
    return [GenerateRequest(list(p), SamplingParams(**sampling), rid=f"r{i}") for i, p in enumerate(prompts)]


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.8, "top_k": 6},
        {"temperature": 1.3, "min_p": 0.05},
        {"temperature": 0.0},
    ],
)
def test_logprobs_match_transformers_in_mixed_length_batch(engine, hf_model, sampling):
    outputs = engine.generate(requests({"max_new_tokens": 10, "ignore_eos": True, **sampling}))
    temperature = sampling["temperature"] or 1.0  # greedy: raw logits
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert len(out.output_ids) == len(out.output_logprobs) == 10
        ref = reference_logprobs(hf_model, prompt, out.output_ids, temperature)
        assert (torch.tensor(out.output_logprobs) - ref).abs().max().item() <= 1e-4


def test_batch_equals_each_alone(engine):
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 8}):
        batch = requests({"max_new_tokens": 12, "ignore_eos": True, **sampling})
        for i, r in enumerate(batch):
            r.sampling.sampling_seed = 100 + i  # per-request streams: independent of batch-mates
        together = engine.generate(batch)
        for request, out in zip(batch, together, strict=True):
            (alone,) = engine.generate([request])
            assert alone.output_ids == out.output_ids
            assert (
                max(abs(a - b) for a, b in zip(alone.output_logprobs, out.output_logprobs, strict=True))
                <= 1e-5
            )


def test_greedy_matches_transformers_generate(scrambled_dir):
    engine = LocalEngine(str(scrambled_dir))
    model = AutoModelForCausalLM.from_pretrained(str(scrambled_dir), dtype=torch.float32).eval()
    prompts = [*PROMPTS, [7, 7], [10, 11, 12]]
    outputs = engine.generate(requests({"max_new_tokens": 16, "temperature": 0.0}, prompts))
    for prompt, out in zip(prompts, outputs, strict=True):
        expected = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=16,
            eos_token_id=EOS,
            pad_token_id=0,
        )
        assert out.output_ids == expected[0, len(prompt) :].tolist()
        ref = reference_logprobs(model, prompt, out.output_ids)
        assert (torch.tensor(out.output_logprobs) - ref).abs().max().item() <= 1e-4
    assert any(len(set(o.output_ids)) > 3 for o in outputs)  # not a repeated token
    stopped = [o for o in outputs if o.finish_reason["type"] == "stop"]
    assert stopped and all(o.output_ids[-1] == EOS and o.finish_reason["matched"] == EOS for o in stopped)


def test_top_k_one_samples_the_argmax(engine):
    greedy = engine.generate(requests({"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}))
    top1 = engine.generate(
        requests({"max_new_tokens": 8, "temperature": 0.5, "top_k": 1, "ignore_eos": True})
    )
    assert [o.output_ids for o in top1] == [o.output_ids for o in greedy]


def test_a_sequence_knows_whether_its_sampling_truncates(engine):
    """What sends a decode-graph row through the torch sampler as well: top-k below the
    vocabulary, top-p under 1 or min-p over 0, unless greedy."""
    vocab = engine.vocab_size
    cases = [
        (dict(top_k=5), True), (dict(top_k=vocab), False), (dict(top_k=vocab + 7), False),
        (dict(top_p=0.9), True), (dict(min_p=0.1), True), (dict(), False),
        (dict(top_k=5, top_p=0.5, temperature=0.0), False),
    ]  # fmt: skip
    for params, expected in cases:
        seq = engine.add(GenerateRequest([1, 2], SamplingParams(max_new_tokens=1, **params)))
        assert seq.truncates is expected, params
        engine.abort(seq)


def test_max_new_tokens_finishes_with_length(engine):
    (out,) = engine.generate(requests({"max_new_tokens": 5, "ignore_eos": True}, [[2, 3]]))
    assert len(out.output_ids) == 5
    assert out.finish_reason == {"type": "length", "length": 5}
    (empty,) = engine.generate(requests({"max_new_tokens": 0}, [[2, 3]]))
    assert empty.output_ids == [] and empty.finish_reason == {"type": "length", "length": 0}


def test_context_length_caps_max_new_tokens(engine):
    prompt = [2] * 60  # context length 64
    (out,) = engine.generate(requests({"max_new_tokens": 100, "ignore_eos": True}, [prompt]))
    assert len(out.output_ids) == 4 and out.finish_reason == {"type": "length", "length": 4}


def test_stop_token_id_finishes_with_stop_and_matched(engine):
    (free,) = engine.generate(
        requests({"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}, [[7, 8]])
    )
    stop = free.output_ids[3]
    first = free.output_ids.index(stop)
    (out,) = engine.generate(
        requests({"max_new_tokens": 12, "temperature": 0.0, "stop_token_ids": [stop]}, [[7, 8]])
    )
    assert out.output_ids == free.output_ids[: first + 1]
    assert out.finish_reason == {"type": "stop", "matched": stop}


def test_eos_stops_unless_ignore_eos(engine):
    prompts = [[2 + i % 12, 3] for i in range(48)]
    sampled = engine.generate(requests({"max_new_tokens": 20, "sampling_seed": 0}, prompts))
    hit_eos = [o for o in sampled if EOS in o.output_ids]
    assert hit_eos, "expected some of 48 sampled responses to reach EOS"
    for out in sampled:
        if EOS in out.output_ids:
            assert out.output_ids.index(EOS) == len(out.output_ids) - 1
            assert out.finish_reason == {"type": "stop", "matched": EOS}
        else:
            assert out.finish_reason["type"] == "length"
    ignoring = engine.generate(
        requests({"max_new_tokens": 20, "sampling_seed": 0, "ignore_eos": True}, prompts)
    )
    assert all(len(o.output_ids) == 20 and o.finish_reason["type"] == "length" for o in ignoring)
    assert any(EOS in o.output_ids[:-1] for o in ignoring)


def test_stop_string_finishes_with_matched_string(engine):
    (free,) = engine.generate(
        requests({"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}, [[4, 5]])
    )
    word = engine.decode(free.output_ids[2:3])
    (out,) = engine.generate(
        requests({"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True, "stop": [word]}, [[4, 5]])
    )
    assert out.finish_reason == {"type": "stop", "matched": word}
    assert out.output_ids == free.output_ids[: len(out.output_ids)] and len(out.output_ids) <= 3


def test_a_stop_string_late_in_a_long_output_ends_it_where_the_whole_text_first_holds_it(engine):
    """The check decodes the newest tokens only (`SamplingParams.stop_window`); it stops where the
    whole output's text first holds the string, for strings of two and three words met late."""
    sampling = {"max_new_tokens": 48, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}
    (free,) = engine.generate(requests(sampling, [[4, 5]]))  # seeded: a stop changes nothing before it
    ids = free.output_ids
    late = []
    for start, words in ((24, 2), (30, 2), (36, 2), (20, 3), (33, 3), (44, 3)):
        stop = engine.decode(ids[start : start + words])
        first = next(i for i in range(len(ids)) if stop in engine.decode(ids[: i + 1]))
        if first > SamplingParams(stop=[stop]).stop_window:  # out of the window's reach from the start
            late.append((stop, first))
    assert len(late) >= 3, late
    for stop, first in late:
        (out,) = engine.generate(requests(sampling | {"stop": [stop]}, [[4, 5]]))
        assert out.finish_reason == {"type": "stop", "matched": stop}, (stop, first)
        assert out.output_ids == ids[: first + 1]


def test_a_stop_string_matches_special_tokens_text_as_sglang_decodes_it(engine):
    """SGLang matches stop strings in the tail decoded with its special tokens: "<eos>" as a stop
    string ends a response that goes on past EOS (ignore_eos) at its first EOS."""
    sampling = {"max_new_tokens": 48, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}
    (free,) = engine.generate(requests(sampling, [[4, 5]]))
    text = engine.decode([EOS], skip_special_tokens=False)  # "<eos>"
    assert EOS in free.output_ids[:-1]  # the seed's output holds one before its end
    (out,) = engine.generate(requests(sampling | {"stop": [text]}, [[4, 5]]))
    assert out.finish_reason == {"type": "stop", "matched": text}
    assert out.output_ids == free.output_ids[: free.output_ids.index(EOS) + 1]


def test_abort_finishes_with_partial_output(engine):
    calls = {"n": 0}

    def is_aborted(i: int) -> bool:
        calls["n"] += 1
        return i == 1 and calls["n"] > 6  # request 1 is aborted after a few steps

    outputs = engine.generate(
        requests({"max_new_tokens": 30, "ignore_eos": True}, [[2, 3], [4, 5]]), is_aborted
    )
    assert outputs[0].finish_reason["type"] == "length" and len(outputs[0].output_ids) == 30
    assert outputs[1].finish_reason["type"] == "abort" and 0 < len(outputs[1].output_ids) < 30


def test_prompt_logprobs_match_transformers(engine, hf_model):
    prompt = PROMPTS[3]
    request = GenerateRequest(prompt, SamplingParams(max_new_tokens=1), logprob_start_len=2)
    (out,) = engine.generate([request])
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    expected = logits[2:-1].gather(-1, torch.tensor(prompt[3:])[:, None])[:, 0]
    assert out.input_logprobs[0] is None and len(out.input_logprobs) == len(prompt) - 2
    assert (torch.tensor(out.input_logprobs[1:]) - expected).abs().max().item() <= 1e-4


def test_sampling_params_from_sglang_dict():
    sp = parse_sampling_params(
        {
            "max_new_tokens": 3,
            "stop": "x",
            "n": 1,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": True,
            "top_k": None,
        }
    )
    assert sp.max_new_tokens == 3 and sp.stop == ["x"] and sp.top_k == -1 and not sp.skip_special_tokens
    for bad in (
        {"n": 2}, {"no_such_param": 1}, {"top_k": 0}, {"temperature": -1.0}, {"top_p": 0.0},
        {"stop": ["</a>", 1]}, {"stop": {"x": 1}}, {"stop_token_ids": [2, "3"]}, {"stop_token_ids": 2},
    ):  # fmt: skip
        with pytest.raises(ValueError):
            parse_sampling_params(bad)


def test_validate_rejects_what_sglang_rejects(engine):
    for prompt in ([], [2] * 64, [16]):
        with pytest.raises(ValueError):
            engine.generate([GenerateRequest(prompt)])


def test_load_weights_from_sharded_checkpoint(tiny_qwen3_dir, tiny_qwen3_factory, tmp_path):
    other = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_factory(1)), dtype=torch.float32).eval()
    sharded = tmp_path / "sharded"
    other.save_pretrained(str(sharded), max_shard_size="40KB")  # how the trainer writes weight buckets
    assert (sharded / "model.safetensors.index.json").exists() and len(
        list(sharded.glob("*.safetensors"))
    ) > 1
    engine = LocalEngine(str(tiny_qwen3_dir), seed=0)
    live_params = {name: p.data_ptr() for name, p in engine.model.named_parameters()}
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    before = engine.generate(requests(greedy))
    assert engine.weight_version == "default"

    assert engine.load_weights_from_disk(str(sharded), weight_version="v1") > 0
    after = engine.generate(requests(greedy))
    assert engine.weight_version == "v1" and engine.model_path == str(sharded)
    assert {name: p.data_ptr() for name, p in engine.model.named_parameters()} == live_params  # in place
    assert any(a.output_logprobs != b.output_logprobs for a, b in zip(after, before, strict=True))
    for prompt, out in zip(PROMPTS, after, strict=True):
        ref = reference_logprobs(other, prompt, out.output_ids)
        assert (torch.tensor(out.output_logprobs) - ref).abs().max().item() <= 1e-4


def test_load_weights_rejects_mismatched_checkpoint_without_changing_weights(tiny_qwen3_dir, tmp_path):
    from safetensors.torch import save_file

    engine = LocalEngine(str(tiny_qwen3_dir), seed=0)
    snapshot = {k: v.clone() for k, v in engine.model.state_dict().items()}
    save_file(
        {"model.norm.weight": torch.zeros(64), "model.embed_tokens.weight": torch.zeros(3, 64)},
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights_from_disk(str(tmp_path), weight_version="bad")
    assert engine.weight_version == "default"
    assert all(torch.equal(v, snapshot[k]) for k, v in engine.model.state_dict().items())


def test_load_weights_converts_per_expert_moe_checkpoint(tmp_path):
    """transformers fuses MoE experts in the module, HF checkpoints keep them per expert."""
    from transformers import DeepseekV3Config

    from rlx.models.tiny import write_tiny_checkpoint

    shape = {k: v for k, v in TINY_SHAPE.items() if k != "head_dim"}  # MLA: its own head dims
    config = DeepseekV3Config(
        **{**shape, "num_key_value_heads": shape["num_attention_heads"]},
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        pad_token_id=0,
        eos_token_id=1,
    )
    first, second = (write_tiny_checkpoint(config, tmp_path / f"s{seed}", seed=seed) for seed in (0, 1))
    engine = LocalEngine(str(first))
    engine.load_weights_from_disk(str(second), weight_version="2")
    model = AutoModelForCausalLM.from_pretrained(str(second), dtype=torch.float32).eval()
    for prompt, out in zip(
        PROMPTS, engine.generate(requests({"max_new_tokens": 5, "ignore_eos": True})), strict=True
    ):
        ref = reference_logprobs(model, prompt, out.output_ids)
        assert (torch.tensor(out.output_logprobs) - ref).abs().max().item() <= 1e-4
