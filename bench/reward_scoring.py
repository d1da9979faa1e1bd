"""Time the driver's reward calls for one rollout batch: print one JSON line.

    python bench/reward_scoring.py                        # 64 groups x 16 samples, position_match
    python bench/reward_scoring.py --groups 256 --n 8 --workers 16

A sync per-sample reward function (`rlx.reward.toy.position_match`, about 2 us a call) goes through
`FunctionScorer` as the rollout pool calls it: every group's `score_group` gathered on one event
loop, the calls run by the scorer's worker threads. What is timed is what rlx adds around the
function (hand-offs to the threads and back, time limits); the median of `--repeats` batches after
one warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from datetime import date

from rlx.reward.config import RewardConfig
from rlx.reward.scorer import FunctionScorer
from rlx.reward.toy import position_match
from rlx.sample import Sample


def _batch(groups: int, n: int) -> list[list[Sample]]:
    return [
        [
            Sample(
                prompt="p",
                prompt_ids=[1],
                response_ids=[2],
                response_text="1 2 3 4 5 6 7 8",
                label="1 2 3 4 5 6 7 9",
                group=g,
                index=i,
            )
            for i in range(n)
        ]  # fmt: skip
        for g in range(groups)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--n", type=int, default=16, help="samples per group")
    parser.add_argument("--workers", type=int, default=RewardConfig().num_workers, help="reward.num_workers")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    scorer = FunctionScorer(
        position_match, "rlx.reward.toy.position_match", RewardConfig(num_workers=args.workers)
    )

    async def score(groups: list[list[Sample]]) -> None:
        await asyncio.gather(*(scorer.score_group(g) for g in groups))

    seconds = []
    for i in range(args.repeats + 1):
        groups = _batch(args.groups, args.n)
        start = time.perf_counter()
        asyncio.run(score(groups))
        if i:
            seconds.append(time.perf_counter() - start)
        assert all(s.reward == 0.875 for g in groups for s in g)
    asyncio.run(scorer.aclose())
    print(json.dumps({
        "bench": "reward_scoring", "date": date.today().isoformat(), "machine": platform.node(),
        "samples": args.groups * args.n, "workers": args.workers,
        "ms_median": round(statistics.median(seconds) * 1e3, 1), "ms_all": [round(s * 1e3, 1) for s in seconds],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
