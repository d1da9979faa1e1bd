"""GRPO on the built-in toy tasks in plain PyTorch, many settings side by side on one GPU, to
choose the settings of a learning run before spending rlx loop minutes on it.

It mirrors what the rlx loop does for `algo=grpo` with one optimizer step per rollout (so the
PPO ratio is 1 and the clip inactive): prompts from `rlx.data.toy.ToyTask`, a random
transformers Qwen3 over the toy vocabulary (`rlx.models.tiny.VOCAB`, no BOS, pad row filled as
`write_tiny_checkpoint` does), sampling at temperature 1 until EOS or `--max-new`, reward
`rlx.reward.toy.position_match` on the words before EOS, GRPO advantages (group mean, unbiased
std + 1e-6), token-mean policy-gradient loss over the response tokens (EOS included), optional
entropy bonus, Adam with linear warmup, bf16 autocast over fp32 weights. It is a model of the
loop, not the loop: figures that matter are re-measured with `python launch.py +experiment=...`.

    python3 bench/grpo_toy_sweep.py --task reverse --digits 8 --steps 400 \\
        --sweep lr=1e-4,3e-4 entropy=0,0.01            # every combination, one process each

Prints one JSON line per run every `--log-every` steps and a summary line at the end.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import subprocess
import sys
import time

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run only
DEFAULTS = dict(
    task="reverse", digits=8, layers=8, hidden=512, heads=8, kv_heads=4, head_dim=64, ffn=2048,
    lr=1e-4, warmup=10, beta2=0.999, entropy=0.0, prompts=64, group=16, temperature=1.0,
    steps=400, seed=1, init=0.02,
)  # fmt: skip


def build_model(c: dict):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from rlx.models.tiny import VOCAB, _fill_zero_embedding_rows

    config = Qwen3Config(
        vocab_size=len(VOCAB), hidden_size=c["hidden"], intermediate_size=c["ffn"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
        head_dim=c["head_dim"], max_position_embeddings=64, tie_word_embeddings=True,
        initializer_range=c["init"], pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(c["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_zero_embedding_rows(model, std=c["init"])
    return model.to(DEVICE)


def position_match(label: list[str], response: list[str]) -> float:
    return sum(a == b for a, b in zip(label, response, strict=False)) / len(label)


@torch.no_grad()
def sample(model, prompt_BP: torch.Tensor, max_new: int, temperature: float, eos: int) -> torch.Tensor:
    ids = prompt_BP
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(max_new):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            logits = model(ids).logits[:, -1].float() / temperature
        token = torch.multinomial(logits.softmax(-1), 1)[:, 0]
        token = torch.where(done, torch.zeros_like(token), token)  # pad after EOS
        ids = torch.cat([ids, token[:, None]], dim=1)
        done |= token == eos
    return ids[:, prompt_BP.shape[1] :]


def run(c: dict, log_every: int) -> None:
    from rlx.data.toy import ToyTask
    from rlx.models.tiny import VOCAB

    word_id = {w: i for i, w in enumerate(VOCAB)}
    eos = word_id["<eos>"]
    rows = ToyTask(c["task"], c["digits"]).rows(4096, c["seed"])
    max_new = len(rows[0]["label"].split()) + 1
    model = build_model(c)
    num_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters(), lr=c["lr"], betas=(0.9, c["beta2"]))
    rng = random.Random(c["seed"])
    start, first_08, curve = time.time(), None, []
    for step in range(c["steps"]):
        for group in opt.param_groups:
            group["lr"] = c["lr"] * min(1.0, (step + 1) / max(c["warmup"], 1))
        batch = rng.sample(rows, c["prompts"])
        prompt = torch.tensor([[word_id[w] for w in r["prompt"].split()] for r in batch], device=DEVICE)
        prompt = prompt.repeat_interleave(c["group"], dim=0)
        response = sample(model.eval(), prompt, max_new, c["temperature"], eos)
        ends = (response == eos).int().cumsum(1)
        mask = ((ends == 0) | ((ends == 1) & (response == eos))).float()  # up to and including EOS
        rewards = []
        for i, tokens in enumerate(response.tolist()):
            words = [VOCAB[t] for t in tokens]
            words = words[: words.index("<eos>")] if "<eos>" in words else words
            rewards.append(position_match(batch[i // c["group"]]["label"].split(), words))
        r = torch.tensor(rewards, device=DEVICE).view(c["prompts"], c["group"])
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).flatten()
        model.train()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            logits = model(torch.cat([prompt, response], 1)).logits[:, prompt.shape[1] - 1 : -1].float()
        logp_all = (logits / c["temperature"]).log_softmax(-1)
        logp = logp_all.gather(-1, response[..., None])[..., 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        n = mask.sum()
        pg = -(adv[:, None] * logp * mask).sum() / n
        ent = (entropy * mask).sum() / n
        loss = pg - c["entropy"] * ent
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        reward = r.mean().item()
        curve.append(round(reward, 3))
        if first_08 is None and reward >= 0.8:
            first_08 = step
        if step % log_every == 0 or step == c["steps"] - 1:
            line = dict(run=c, step=step, reward=round(reward, 4), entropy=round(ent.item(), 4),
                        grad_norm=round(grad_norm.item(), 3), wall_s=round(time.time() - start, 1))  # fmt: skip
            print(json.dumps(line), flush=True)
    summary = dict(summary=c, params=num_params, first_step_reward_ge_0_8=first_08, wall_s=round(time.time() - start, 1),
                   last10=sum(curve[-10:]) / 10, curve_every_10=curve[::10])  # fmt: skip
    print(json.dumps(summary), flush=True)


def parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    for key, value in DEFAULTS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--sweep", nargs="*", default=[], help="key=v1,v2 ...: one process per combination")
    parser.add_argument("--log-every", type=int, default=25)
    args = parser.parse_args()
    base = {k: getattr(args, k) for k in DEFAULTS}
    if not args.sweep:
        return run(base, args.log_every)
    axes = [(k, [parse_value(v) for v in vs.split(",")]) for k, vs in (s.split("=") for s in args.sweep)]
    procs = []
    for values in itertools.product(*(vs for _, vs in axes)):
        overrides = dict(zip((k for k, _ in axes), values, strict=True))
        argv = [f"--{k.replace('_', '-')}={v}" for k, v in {**base, **overrides}.items()]
        argv.append(f"--log-every={args.log_every}")
        procs.append(subprocess.Popen([sys.executable, __file__, *argv]))
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()
