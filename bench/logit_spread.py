"""How a trained model's next-token distributions spread: what the truncating sampler's first
pass assumes (`rlx/engine/triton_truncate.py`, `_start_state`: top_p * Z at most 64 for the pass
near the maximum, which tests values 0.125-28.1 below it). Prints one JSON line.

    python bench/logit_spread.py [--steps 48] [--top-p 0.9]   # CPU, about a minute

SmolLM2-135M-Instruct (the example model, converted on first use) samples `--steps` tokens at
T = 1 after each of four chat prompts; at every step, Z = sum exp(s - max s) (the mass in units
of the largest token's) and how far below the maximum top_p's boundary lies (the kept token of
smallest logit, in logit units).
"""

from __future__ import annotations

import argparse
import json

import torch

PROMPTS = [
    "What is 17 + 25? Answer with the number.",
    "Write a short poem about the sea.",
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--top-p", type=float, default=0.9)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlx.tools.example_model import example_model_dir

    path = example_model_dir("float32")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    z, depth = [], []
    for prompt in PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        out = model.generate(
            ids, max_new_tokens=args.steps, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
        for scores in out.scores:
            s = torch.sort(scores[0].float(), descending=True).values
            mass = torch.exp(s - s[0])
            z.append(mass.sum().item())
            kept = int((mass.cumsum(0) - mass <= args.top_p * mass.sum()).sum().item())
            depth.append((s[0] - s[kept - 1]).item())
    z_t, depth_t = torch.tensor(z), torch.tensor(depth)
    result = {
        "model": path.name,
        "steps": len(z),
        "z": {
            "median": round(z_t.median().item(), 2),
            "p90": round(z_t.quantile(0.9).item(), 2),
            "max": round(z_t.max().item(), 2),
        },
        "share_top_p_z_at_most_64": round((args.top_p * z_t <= 64).float().mean().item(), 3),
        "top_p": args.top_p,
        "boundary_below_max": {
            "median": round(depth_t.median().item(), 2),
            "max": round(depth_t.max().item(), 2),
        },
        "share_within_28_1": round((depth_t <= 28.1).float().mean().item(), 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
