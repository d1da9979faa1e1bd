"""The decode graph's input fill, `HostRows` against the rule before it, in one engine process:
rounds of one rollout batch alternate between the two, so that what varies between processes
(on the H200's host, ±50% for the same work) does not decide. Prints one JSON line.

The rule before (`Rewrite`): every row whose sequence moved since the buffer set last held it was
written again from its Sequence (seed, sampling, the whole block table), as
`DecodeGraphs._fill_host` did until `rlx/engine/host_rows.py`. Needs a GPU (decode graphs).

    python3 bench/fill_ab.py --rounds 8 +experiment=smollm2_arithmetic
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from short_rollout import StepTimer, _engine_round, _requests, local_engine  # noqa: E402

from rlx.engine.host_rows import HostRows  # noqa: E402


class Rewrite(HostRows):
    """Rows `first`.. written again from their Sequences, whole tables included."""

    def _place(self, seqs, first: int) -> None:
        for row in range(first, len(seqs)):
            self._write(row, seqs[row])
        self.seqs[first : len(seqs)] = seqs[first:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=8, help="timed rounds of each fill")
    parser.add_argument("overrides", nargs="*", default=["+experiment=smollm2_arithmetic"])
    args = parser.parse_args()

    rc, prompts, launcher = local_engine(args.overrides, "/tmp/rlx_fill_ab")
    n, params = rc.rollout.n_samples_per_prompt, rc.rollout.sampling_params()
    engine = launcher.server.engine
    launcher.shutdown()  # its scheduler thread ends: the engine is this thread's (`_engine_round`)
    graphs = engine.runner.graphs
    shape = graphs.host[0].tables.shape
    timer = StepTimer(engine)
    walls: dict[str, list[float]] = {"host_rows": [], "rewrite": []}
    for r in range(2 * args.rounds + 2):  # the first two warm up
        name, cls = ("host_rows", HostRows) if r % 2 else ("rewrite", Rewrite)
        graphs.host = [cls(*shape), cls(*shape)]
        timer.take()
        start = time.perf_counter()
        _engine_round(engine, _requests(prompts, n, params, r))
        if r >= 2:
            walls[name].append(time.perf_counter() - start)
    result = {"overrides": args.overrides, "steps_a_round": timer.take()[0]}
    for name, values in walls.items():
        result[name] = {
            "median_s": statistics.median(values),
            "min_s": min(values),
            "rounds_s": [round(v, 4) for v in values],
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
