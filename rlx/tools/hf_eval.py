"""Re-check a run's evaluation outside rlx: plain transformers, greedy, on one of its eval sets.

    python -m rlx.tools.hf_eval RUN_DIR                        # RUN_DIR/hf (run.save_hf=true), every greedy set
    python -m rlx.tools.hf_eval RUN_DIR --model DIR --set test_greedy --batch-size 64
    python -m rlx.tools.hf_eval RUN_DIR --dtype float32        # the tighter check (below)

An independent check of the whole chain (trainer -> weight export -> HF checkpoint -> generation):
the model is loaded by `transformers.AutoModelForCausalLM` alone (no rlx engine, no Megatron) and
decoded greedily, in its own dtype on a GPU and in fp32 on CPU (`--dtype` chooses), on the prompts
of the run's `data.eval` sets, rendered and scored exactly as the run did (its recorded
`config.yaml`: keys, chat template, system prompt, `reward.fn` with its time limit and failure
rules, the eval response length). Only sets the run evaluated greedily (`temperature: 0`, or
`rollout.eval_temperature=0`) are re-checked: sampling would not give the same answers. Prints one
JSON object per set: `pass@1` and `reward_mean` here, the run's last `eval/SET/...` of each from
metrics.jsonl, the prompts counted and the dtype.

Greedy decoding in bf16 flips near-ties, the run's engine and transformers each their own way: a
bf16 run's SmolLM2 arithmetic eval (90.6%) was re-checked at 88.3% in bf16 and 89.8% in fp32
(docs/benchmarks.md). `--dtype float32` asks the weights' exact function, not another bf16 kernel's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from rlx.sample import Sample, Status


def generate_greedy(
    model: Any,
    tokenizer: Any,
    samples: list[Sample],
    max_new_tokens: int,
    batch_size: int,
    stop_ids=(),
    stop_strings=(),
) -> None:
    """Fill each sample's response (ids, text, status) with transformers' greedy decoding, ended by
    one of `stop_ids` (what ends the run's responses as its engines judge them, the checkpoint's EOS
    ids among them: `rlx.rollout.generate.stop_ids`; none: the length limit alone) or the first
    token whose text completes one of `stop_strings` (rollout.stop), as the engines end it."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = set(stop_ids)  # [] to transformers: its generation_config's EOS does not stop a row
    device = next(model.parameters()).device
    for start in range(0, len(samples), batch_size):
        batch = samples[start : start + batch_size]
        width = max(len(s.prompt_ids) for s in batch)
        ids = torch.tensor(
            [[pad] * (width - len(s.prompt_ids)) + list(s.prompt_ids) for s in batch], device=device
        )
        mask = torch.tensor(
            [[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in batch], device=device
        )
        # a row past a stop string is cut below (greedy tokens never look ahead; transformers'
        # stop_strings cannot read every tokenizer's vocabulary: a word-level one fails)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=sorted(eos_ids), pad_token_id=pad,
            )  # fmt: skip
        for sample, row in zip(batch, out[:, width:].tolist(), strict=True):
            end = _end(tokenizer, row, eos_ids, stop_strings)
            sample.response_ids = row if end is None else row[: end + 1]
            sample.response_text = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
            sample.status = Status.TRUNCATED if end is None else Status.COMPLETED


def _end(tokenizer: Any, row: list[int], eos_ids: set[int], stop_strings) -> int | None:
    """The index of the token that ends `row`: the first EOS or stop token, or the first whose text
    holds a stop string, as rlx's engine and SGLang match one (the newest `stop_window` tokens' text,
    special tokens in it); None when nothing ends it."""
    from rlx.engine.sequence import SamplingParams

    window = SamplingParams(stop=list(stop_strings)).stop_window
    for i, token in enumerate(row):
        if token in eos_ids:
            return i
        if stop_strings:
            text = tokenizer.decode(row[max(0, i + 1 - window) : i + 1], skip_special_tokens=False)
            if any(s in text for s in stop_strings):
                return i
    return None


DTYPES = ("auto", "float32", "bfloat16", "float16")


def load_dtype(name: str, cuda: bool):
    """`from_pretrained`'s dtype for `--dtype NAME`: "auto" is the checkpoint's own on a GPU, fp32 on
    the CPU (whose bf16 matmuls are slow)."""
    import torch

    if name not in DTYPES:
        raise SystemExit(f"error: --dtype {name}: not one of {', '.join(DTYPES)}")
    if name == "auto":
        return "auto" if cuda else torch.float32
    return getattr(torch, name)


def recheck(
    run_dir: Path,
    model_dir: Path | None = None,
    sets: list[str] | None = None,
    batch_size: int = 64,
    dtype: str = "auto",
):
    """{set: {"pass@1": here, "pass@1_run": the run's last, "reward_mean"..., "num_prompts": n}} for
    the run's greedy eval sets, the model loaded in `dtype` (`load_dtype`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.config.compose import compose, to_object
    from rlx.config.validate import run_max_prompt_len
    from rlx.eval import build_eval_sets, summarise
    from rlx.eval.runner import eval_sampling
    from rlx.reward import load_scorer
    from rlx.rollout.generate import stop_ids

    rc = to_object(compose([], config_dir=run_dir, config_name="config"))
    greedy = [
        n
        for n in rc.data.eval
        if eval_sampling(rc.rollout, rc.data.eval[n])[1].get("temperature", rc.rollout.temperature) == 0
    ]
    chosen = sets or greedy
    if unknown := [n for n in chosen if n not in greedy]:
        raise SystemExit(f"error: {unknown} not among the run's greedy eval sets {greedy}")
    model_dir = model_dir or run_dir / "hf"
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=load_dtype(dtype, cuda))
    model = model.to("cuda" if cuda else "cpu").eval()
    eval_sets = build_eval_sets(rc.data, tokenizer, run_max_prompt_len(rc))
    scorer = load_scorer(rc.reward, rollout=rc.rollout, tokenizer=tokenizer)
    max_new_tokens = rc.rollout.eval_max_response_len or rc.rollout.max_response_len
    ends = stop_ids(rc.rollout, tokenizer, str(model_dir))  # the EOS and stop ids the engines stopped on
    run_metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    results = {}
    for name in chosen:
        samples = eval_sets[name]
        generate_greedy(model, tokenizer, samples, max_new_tokens, batch_size, ends, rc.rollout.stop)
        asyncio.run(_score(scorer, samples))
        ours, results[name] = summarise(name, samples), {"num_prompts": len(samples)}
        for metric in ("pass@1", "reward_mean"):
            key = f"eval/{name}/{metric}"
            results[name] |= {
                metric: ours[key],
                f"{metric}_run": next((m[key] for m in reversed(run_metrics) if key in m), None),
            }
        results[name]["dtype"] = str(model.dtype).removeprefix("torch.")
    return results


async def _score(scorer, samples: list[Sample]) -> None:
    from rlx.agent.sandbox import close_sandboxes

    await asyncio.gather(*(scorer.score_group([s]) for s in samples))
    await scorer.aclose()
    await close_sandboxes()  # a reward's tool servers, before asyncio.run closes the loop


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory (config.yaml, metrics.jsonl)")
    parser.add_argument("--model", type=Path, default=None, help="HF directory (default: RUN_DIR/hf)")
    parser.add_argument("--set", action="append", dest="sets", help="an eval set (default: every greedy one)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--dtype", choices=DTYPES, default="auto", help="auto: the checkpoint's own on a GPU, float32 on CPU"
    )
    args = parser.parse_args(argv)
    for name, result in recheck(args.run_dir, args.model, args.sets, args.batch_size, args.dtype).items():
        print(json.dumps({"set": name, "model": str(args.model or args.run_dir / "hf"), **result}))


if __name__ == "__main__":
    main()
