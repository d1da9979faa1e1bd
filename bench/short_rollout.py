"""Where one short rollout batch goes: the loop's request shape through HTTP, the same requests
handed to the engine's scheduler without HTTP, and the engine stepped alone; prints JSON.

An RL step with short answers (the toy tasks: a few tokens each for hundreds of samples) spends
little GPU time per token, so what the engine does around its forward passes decides the
rollout time. The run's model, data and rollout settings come from the same overrides as
`launch.py` (default `+experiment=reverse8_1gpu`: 64 prompts x 16 samples, 9 new tokens):

    python bench/short_rollout.py                                   # CPU or GPU, whichever the engine picks
    python bench/short_rollout.py --rounds 5 +rollout.engine_args.max_running_requests=1024
    python bench/short_rollout.py --paths engine --timeline --profile gpu.txt --cprofile host.txt
    python bench/short_rollout.py --paths http --turns 5,5,5 +experiment=tool_calc_gpu   # multi-turn requests

Per path, the median over `--rounds` batches (the first batch of each path warms up and is left
out): wall seconds, engine steps, seconds inside `Engine.step`, and output tokens/s; the wall
seconds outside the steps split into before the first step (`lead_s`: requests arriving), between
steps (`gaps_s`) and after the last (`tail_s`: answers returning).
- `http`: one /generate request per group with n prompts and per-sample seeds, all groups at
  once through one `EngineClient` kept across rounds, as `RolloutPool` sends them (no reward, no sample bookkeeping),
  from another process, as a run's driver is (a client in the engine's process would contend
  with its scheduler thread for the GIL);
- `turns` (`--turns A,T,B`): each sample's conversation as a `rollout.generate_fn` sends it, one
  request per sample and model turn: A tokens, T tool tokens appended, B tokens (the `http` path
  then asks A + B tokens a sample, the same output in one request a group);
- `scheduler`: the same requests submitted to the server's scheduler thread directly;
- `engine`: `Engine.add` for every sample, then `Engine.step` until done, on this thread.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

from rlx.config import build
from rlx.config.compose import compose, to_object
from rlx.config.validate import run_max_prompt_len


class StepTimer:
    """Counts `engine.step` calls and the seconds spent in them (wraps the bound method); with
    `timeline`, each step's (ms, sequences running and waiting before it, finished in it)."""

    def __init__(self, engine):
        self.engine, self.inner = engine, engine.step
        self.steps, self.seconds = 0, 0.0
        self.first = self.last = None  # perf_counter of the first step's start and the last's end
        self.timeline: list | None = None
        engine.step = self

    def __call__(self):
        before = (self.engine.num_running, self.engine.num_waiting)
        start = time.perf_counter()
        finished = []
        self.first = start if self.first is None else self.first
        try:
            finished = self.inner()
            return finished
        finally:
            self.last = time.perf_counter()
            elapsed = self.last - start
            self.seconds += elapsed
            self.steps += 1
            if self.timeline is not None:
                self.timeline.append((round(elapsed * 1e3, 2), *before, len(finished)))

    def take(self) -> tuple[int, float, float | None, float | None]:
        """(steps, seconds in them, the first's start, the last's end) since the last call."""
        out = self.steps, self.seconds, self.first, self.last
        self.steps, self.seconds, self.first, self.last = 0, 0.0, None, None
        return out


def _requests(prompts, n: int, params: dict, round_: int) -> list[tuple[list[list[int]], list[dict]]]:
    """One (input_ids, sampling_params) pair of lists per group, seeds distinct per sample."""
    out = []
    for g, p in enumerate(prompts):
        seeds = [(round_ * 1_000_003 + g * 1009 + i) & (2**62 - 1) for i in range(n)]
        out.append(([list(p.prompt_ids)] * n, [params | {"sampling_seed": s} for s in seeds]))
    return out


_CLIENT: dict = {}  # in the client process: one loop and one EngineClient for every round


def _client(url: str):
    """The client process's loop and EngineClient, kept across rounds as the run's rollout pool
    keeps its own (a client a round would connect anew each round)."""
    from rlx.rollout.client import EngineClient

    if url not in _CLIENT:
        _CLIENT[url] = (asyncio.new_event_loop(), EngineClient(url, timeout=600.0))
    return _CLIENT[url]


async def _http_round(client, groups) -> int:
    outs = await asyncio.gather(*(client.generate_batch(ids, params) for ids, params in groups))
    return sum(len(o["output_ids"]) for group in outs for o in group)


def _http_round_in_process(url: str, groups) -> int:
    loop, client = _client(url)
    return loop.run_until_complete(_http_round(client, groups))


async def _turns_round(client, groups, turns: tuple[int, int, int]) -> int:
    """Each sample's conversation as a generate_fn sends it: one request per sample and model
    turn (`turns`: tokens of the first turn, tool tokens appended, tokens of the second)."""
    first, tool, second = turns

    async def conversation(ids: list[int], params: dict) -> int:
        out = await client.generate(ids, params | {"max_new_tokens": first})
        ids = ids + out["output_ids"] + [ids[-1]] * tool  # the tool's tokens: any ids will do
        out2 = await client.generate(
            ids, params | {"max_new_tokens": second, "sampling_seed": params["sampling_seed"] + 1}
        )
        return len(out["output_ids"]) + len(out2["output_ids"])

    pairs = [(i, p) for ids, params in groups for i, p in zip(ids, params, strict=True)]
    return sum(await asyncio.gather(*(conversation(i, p) for i, p in pairs)))


def _turns_round_in_process(url: str, groups, turns) -> int:
    loop, client = _client(url)
    return loop.run_until_complete(_turns_round(client, groups, turns))


def _scheduler_round(server, groups) -> int:
    from rlx.engine.serve.protocol import parse_generate

    pendings = []
    for ids, params in groups:
        items, _ = parse_generate({"input_ids": ids, "sampling_params": params, "return_logprob": True},
                                  server.engine)  # fmt: skip
        pendings += server.scheduler.submit([item["request"] for item in items])
    return sum(len(p.future.result()[0].output_ids) for p in pendings)


def _engine_round(engine, groups) -> int:
    from rlx.engine.serve.protocol import parse_generate

    seqs = []
    for ids, params in groups:
        items, _ = parse_generate(
            {"input_ids": ids, "sampling_params": params, "return_logprob": True}, engine
        )
        seqs += [engine.add(item["request"]) for item in items]
    while engine.has_work():
        engine.step()
    return sum(s.num_output for s in seqs)


def _measure(name: str, one_round, rounds: int, timer: StepTimer) -> dict:
    runs = []
    for r in range(rounds + 1):  # round 0 warms up
        timer.take()
        start = time.perf_counter()
        tokens = one_round(r)
        end = time.perf_counter()
        steps, step_s, first, last = timer.take()
        if r:  # before the first step (requests arriving), between steps, after the last (answers)
            lead, tail = first - start, end - last
            gaps = last - first - step_s
            runs.append({"wall_s": end - start, "steps": steps, "step_s": step_s, "tokens": tokens,
                         "lead_s": lead, "gaps_s": gaps, "tail_s": tail})  # fmt: skip
        print(
            f"{name} round {r}: {end - start:.3f} s, {steps} steps, {step_s:.3f} s in Engine.step",
            file=sys.stderr,
        )
    median = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
    median["tokens_per_s"] = median["tokens"] / median["wall_s"]
    median["outside_step_s"] = median["wall_s"] - median["step_s"]
    median["rounds_wall_s"] = [round(run["wall_s"], 4) for run in runs]  # the spread behind the median
    return median


def _profile(path: str, one_round) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        one_round()
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    if torch.cuda.is_available():
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=30))
    Path(path).write_text("\n\n".join(tables))


def _cprofile(path: str, one_round) -> None:
    """Where the host's time goes in one round (the GPU's work shows as the waits for it)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(one_round)
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    Path(path).write_text(out.getvalue())


def local_engine(overrides: list[str], output_dir: str):
    """The run's config, its first rollout batch's prompts, and a LocalLauncher serving its
    checkpoint as the loop's engine would (its dtype as the loop picks it)."""
    from transformers import AutoTokenizer

    from rlx.rollout.launchers import LocalLauncher
    from rlx.trainer.config import PRECISION_DTYPES

    rc = to_object(compose([f"run.output_dir={output_dir}", *overrides]))
    hf_dir = build(rc.model).checkpoint_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    data = build(rc.data, tokenizer, seed=rc.run.seed, max_prompt_len=run_max_prompt_len(rc))
    rollout = LocalLauncher.for_run(
        rc.rollout,
        colocated=False,
        precision_dtype=PRECISION_DTYPES[rc.train.precision],
        hf_dir=hf_dir,
        gpus=rc.cluster.gpus_per_node > 0,
    )
    return rc, data.take(rc.rollout.batch_size), LocalLauncher(rollout, str(hf_dir), seed=rc.run.seed)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paths", default="http,scheduler,engine")
    parser.add_argument(
        "--turns", help="A,T,B: the turns path's model, tool and model tokens (adds the path)"
    )
    parser.add_argument("--timeline", action="store_true", help="the engine path's last round, step by step")
    parser.add_argument("--profile", help="a torch.profiler table of one engine round to this file")
    parser.add_argument("--cprofile", help="the host's functions (cProfile) in one engine round to this file")
    parser.add_argument("overrides", nargs="*", default=["+experiment=reverse8_1gpu"])
    args = parser.parse_args()

    from rlx.gc_freeze import freeze_startup_objects

    rc, prompts, launcher = local_engine(args.overrides, "/tmp/rlx_short_rollout")
    n = rc.rollout.n_samples_per_prompt
    params = rc.rollout.sampling_params()  # as RolloutPool sends them
    turns = tuple(int(t) for t in args.turns.split(",")) if args.turns else None
    if turns:  # fixed lengths, so that both paths generate the same tokens
        params |= {"max_new_tokens": turns[0] + turns[2], "ignore_eos": True}
    freeze_startup_objects()  # as the engine's actor process does (rlx.gc_freeze)
    server = launcher.server
    engine = server.engine
    timer = StepTimer(engine)
    result = {
        "overrides": args.overrides, "device": str(getattr(engine, "device", "?")),
        "groups": len(prompts), "samples_per_group": n, "max_new_tokens": rc.rollout.max_response_len,
        "max_running_requests": engine.args.max_running_requests, "dtype": str(engine.torch_dtype),
    }  # fmt: skip
    paths = args.paths.split(",") + (["turns"] if turns else [])
    try:
        if "http" in paths or "turns" in paths:  # the client in a process of its own, started once
            spawn = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as client:
                if "http" in paths:  # round 0 warms it
                    result["http"] = _measure("http", lambda r: client.submit(_http_round_in_process, server.url, _requests(prompts, n, params, r)).result(),
                                              args.rounds, timer)  # fmt: skip
                if turns:
                    result["turns"] = _measure("turns", lambda r: client.submit(_turns_round_in_process, server.url, _requests(prompts, n, params, r), turns).result(),
                                               args.rounds, timer)  # fmt: skip
                    result["turns"]["requests"] = 2 * len(prompts) * n
        if "scheduler" in paths:
            result["scheduler"] = _measure("scheduler", lambda r: _scheduler_round(server, _requests(prompts, n, params, r)),
                                           args.rounds, timer)  # fmt: skip
    finally:
        launcher.shutdown()
    if "engine" in paths:  # the scheduler thread has ended: the engine is this thread's
        result["engine"] = _measure("engine", lambda r: _engine_round(engine, _requests(prompts, n, params, r)),
                                    args.rounds, timer)  # fmt: skip
        if args.timeline:  # (ms, running, waiting, finished) per step
            timer.timeline = []
            _engine_round(engine, _requests(prompts, n, params, args.rounds + 1))
            result["engine_timeline"] = timer.timeline
        if args.profile:
            _profile(
                args.profile, lambda: _engine_round(engine, _requests(prompts, n, params, args.rounds + 2))
            )
        if args.cprofile:
            _cprofile(
                args.cprofile, lambda: _engine_round(engine, _requests(prompts, n, params, args.rounds + 3))
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
