"""Host-side batch work of one trainer call, apart from the model: print one JSON line.

    python bench/trainer_host.py                       # the shapes below, on this machine's CPU
    python bench/trainer_host.py --shape 1024x9:256    # SAMPLESxRESPONSE_LEN:MICRO_BATCH
    python bench/trainer_host.py --algo ppo            # grpo (default), reinforce_pp, ppo

Before and around the model's passes the trainer builds micro-batches (padding every field of
every sample), computes advantages, the log-prob gap to the engine and advantage statistics, on
the host, per step. On a GPU this time leaves the GPU idle, so it is part of the gap between the
loop's trainer and `bench/train_mfu.py`. Times are milliseconds per step, mean of `--repeats`
after one warm-up, single-threaded torch; synthetic samples (prompts of 20 tokens, responses of
1 to RESPONSE_LEN tokens, groups of 8, random rewards).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from datetime import date

import torch

from rlx.algo.config import AlgoConfig
from rlx.algo.grpo import GRPO
from rlx.algo.ppo import PPO
from rlx.algo.reinforce_pp import ReinforcePP
from rlx.sample import Sample
from rlx.trainer.batch import make_micro_batch
from rlx.trainer.megatron import advantage_stats, logprob_gap, rollout_logprobs

SHAPES = ("256x4:64", "1024x9:256", "128x512:8")  # the default job, reverse8_1gpu, grpo_step 1.7b
# each algorithm as its conf/algo yaml sets it up (whitened advantages for REINFORCE++ and PPO)
ALGOS = {
    "grpo": lambda: GRPO(AlgoConfig()),
    "reinforce_pp": lambda: ReinforcePP(AlgoConfig(gamma=1.0, whiten_advantages=True)),
    "ppo": lambda: PPO(AlgoConfig(whiten_advantages=True)),
}


def _samples(n: int, response_len: int, rng: random.Random) -> list[Sample]:
    out = []
    for i in range(n):
        length = rng.randint(1, response_len)
        out.append(Sample(prompt="p", prompt_ids=[1] * 20, group=i // 8, index=i % 8, response_ids=[2] * length,
                          rollout_logprobs=[-0.5] * length, reward=rng.random()))  # fmt: skip
    return out


def _ms(work, repeats: int) -> float:
    work()
    started = time.perf_counter()
    for _ in range(repeats):
        work()
    return round((time.perf_counter() - started) / repeats * 1e3, 2)


def measure(shape: str, repeats: int, algo_name: str = "grpo") -> dict:
    counts, micro = shape.split(":")
    n, response_len = (int(x) for x in counts.split("x"))
    micro_batch = int(micro)
    samples = _samples(n, response_len, random.Random(0))
    old_logp = [torch.full((s.response_len,), -0.4) for s in samples]
    algo = ALGOS[algo_name]()
    inputs = {"old_logp": old_logp}
    if algo.needs_critic:
        inputs["values"] = [torch.full((s.response_len,), 0.3) for s in samples]
    advantages = algo.advantages(samples, inputs).advantages
    extras = {"adv": advantages, "old_logp": old_logp, "rollout_logp": rollout_logprobs(samples)}

    def micro_batches(fields: dict) -> None:  # one pass: forward-only takes {}, training all fields
        for i in range(0, n, micro_batch):
            make_micro_batch(
                samples[i : i + micro_batch], {k: v[i : i + micro_batch] for k, v in fields.items()}
            )

    times = {
        "forward_only_micro_batches": _ms(lambda: micro_batches({}), repeats),
        "advantages": _ms(lambda: algo.advantages(samples, inputs), repeats),
        "logprob_gap": _ms(lambda: logprob_gap(samples, old_logp), repeats),
        "advantage_stats": _ms(lambda: advantage_stats(samples, advantages), repeats),
        "rollout_logprobs": _ms(lambda: rollout_logprobs(samples), repeats),
        "train_micro_batches": _ms(lambda: micro_batches(extras), repeats),
    }
    return {"shape": shape, "algo": algo_name, "ms": times, "total_ms": round(sum(times.values()), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", action="append", help="SAMPLESxRESPONSE_LEN:MICRO_BATCH (repeatable)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--algo", choices=sorted(ALGOS), default="grpo")
    args = parser.parse_args()
    torch.set_num_threads(1)
    record = {
        "bench": "trainer_host", "date": date.today().isoformat(), "machine": platform.node(),
        "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
        "results": [measure(shape, args.repeats, args.algo) for shape in args.shape or SHAPES],
    }  # fmt: skip
    print(json.dumps(record))


if __name__ == "__main__":
    main()
