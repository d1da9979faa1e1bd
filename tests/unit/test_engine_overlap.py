"""The engine's overlap schedule (step k+1 launched before step k is read back) on CPU.

On CUDA the overlap runs decode CUDA graphs that take pending tokens from the device, and
launches eager steps (prefill chunks) behind the step in flight. Here a runner stands in for
the graphs: it runs the eager CPU step, taking each PENDING input from the previous launch's
results by the row the engine names, and returns results only when the engine collects them;
eager steps go through the CPU runner's own `launch_eager` / `collect_eager`. Outputs must
equal the engine without overlap, request by request: seeded sampling, EOS stops, stop
strings, aborts mid-flight, staggered arrivals, preemption under a small KV budget, and
chunked prompts with prompt logprobs.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rlx.engine import Engine, EngineArgs, GenerateRequest, SamplingParams
from rlx.engine.scheduler import ScheduledBatch
from rlx.engine.sequence import PENDING, SequenceStatus


class EmulatedGraphRunner:
    """The CUDA runner's overlap seam (can_launch / launch / collect) over the CPU runner."""

    def __init__(self, runner):
        self.inner = runner
        self.previous: list[int] = []
        self.num_launched = 0
        self.in_flight = 0  # launched, not collected
        self.num_eager_behind = 0  # eager steps launched while another step was in flight
        self.steps: list[set[int]] = []  # the sequences of each launch, eager or graph
        self.scheduler = None  # the engine's (make_engine)
        self.behind_while_waiting = 0  # decode graphs launched behind a step while requests wait

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def can_launch(self, batch: ScheduledBatch) -> bool:
        return batch.num_decode == len(batch.seqs)

    def launch(self, seqs, sources):
        self.steps.append({s.seq_id for s in seqs})
        self.behind_while_waiting += bool(self.in_flight and self.scheduler.waiting)
        pending = [s for s in seqs if s.token_ids[-1] == PENDING]
        for seq, source in zip(seqs, sources, strict=True):
            if seq.token_ids[-1] == PENDING:
                assert source >= 0, "a pending input needs the row that samples it"
                seq.token_ids[-1] = self.previous[source]
        result = self.inner.run(ScheduledBatch(list(seqs), [1] * len(seqs), len(seqs)))
        for seq in pending:
            seq.token_ids[-1] = PENDING
        self.previous = [token for _, token, _ in result.sampled]
        self.num_launched += 1
        self.in_flight += 1
        return [float(t) for t in self.previous], [lp for _, _, lp in result.sampled]

    def collect(self, handle):
        self.in_flight -= 1
        return handle

    def launch_eager(self, batch):
        assert all(s.token_ids[-1] != PENDING for s in batch.seqs), "an eager step's inputs are known"
        self.num_eager_behind += self.in_flight > 0
        self.steps.append({s.seq_id for s in batch.seqs})
        self.in_flight += 1
        return self.inner.launch_eager(batch)

    def collect_eager(self, step):
        self.in_flight -= 1
        return self.inner.collect_eager(step)


def make_engine(path, overlap: bool, **kwargs) -> Engine:
    engine = Engine(EngineArgs(model_path=str(path), device="cpu", **kwargs))
    if overlap:
        engine.runner = EmulatedGraphRunner(engine.runner)
        engine.runner.scheduler = engine.scheduler
        engine.overlap = True
    return engine


def requests() -> list[GenerateRequest]:
    prompts = [[5], [2, 3, 4], [9, 8, 7, 6, 5, 4, 12], [3, 13, 2, 14, 6, 11, 10, 4, 7, 12], [7, 7]]
    out = []
    for i, prompt in enumerate(prompts * 2):
        sampling = SamplingParams(max_new_tokens=4 + 3 * (i % 4), temperature=1.0, sampling_seed=i)
        if i % 3 == 0:
            sampling.ignore_eos = True
        if i == 7:
            sampling.top_k = 5  # a truncating row beside the fused ones
        out.append(GenerateRequest(list(prompt), sampling))
    return out


def run(engine: Engine, abort_at: dict[int, int], arrive_at: dict[int, int]) -> list:
    """Requests arrive at steps `arrive_at[i]` (default 0); request i is aborted at step `abort_at[i]`."""
    batch = requests()
    seqs: dict[int, object] = {}
    step = 0
    while len(seqs) < len(batch) or any(s.status is not SequenceStatus.FINISHED for s in seqs.values()):
        for i, request in enumerate(batch):
            if i not in seqs and arrive_at.get(i, 0) <= step:
                seqs[i] = engine.add(request)
        for i, when in abort_at.items():
            if when == step and i in seqs:
                engine.abort(seqs[i])
        engine.step()
        step += 1
    while engine.has_work():  # the step behind may still be in flight
        engine.step()
    outputs = [seqs[i].output() for i in range(len(batch))]
    for out in outputs:
        assert PENDING not in out.output_ids
        assert len(out.output_ids) == len(out.output_logprobs)
    return outputs


@pytest.mark.parametrize(
    "kwargs, abort_at, arrive_at",
    [
        ({}, {}, {}),
        ({}, {2: 3, 6: 5}, {3: 2, 8: 6}),
        ({"max_total_tokens": 48, "page_size": 4}, {}, {5: 1}),  # preemption and recompute
        ({"max_running_requests": 3}, {4: 6}, {}),  # requests wait for a running slot
        ({"max_running_requests": 4, "admission_group": 2}, {}, {7: 3}),  # and join two at a time
    ],
)
def test_overlap_gives_the_same_outputs(tiny_qwen3_dir, kwargs, abort_at, arrive_at):
    plain = run(make_engine(tiny_qwen3_dir, False, **kwargs), abort_at, arrive_at)
    engine = make_engine(tiny_qwen3_dir, True, **kwargs)
    overlapped = run(engine, abort_at, arrive_at)
    assert engine.runner.num_launched > 0
    if arrive_at and not kwargs:  # late prompts prefill behind the decode in flight
        assert engine.runner.num_eager_behind > 0
    if "max_running_requests" in kwargs:  # decodes go on overlapped while the others wait
        assert engine.runner.behind_while_waiting > 0
    for a, b in zip(plain, overlapped, strict=True):
        assert a.finish_reason == b.finish_reason
        if a.finish_reason["type"] == "abort":  # read back later: a prefix at abort time
            n = len(b.output_ids)
            assert b.output_ids == a.output_ids[:n]
            a.output_logprobs = a.output_logprobs[:n]
        else:
            assert a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5)


def test_overlap_drains_before_weights_move(tiny_qwen3_dir):
    engine = make_engine(tiny_qwen3_dir, True)
    seq = engine.add(
        GenerateRequest([2, 3], SamplingParams(max_new_tokens=3, ignore_eos=True, sampling_seed=1))
    )
    while seq.status is not SequenceStatus.FINISHED:
        engine.step()
    engine.load_weights_from_disk(str(tiny_qwen3_dir))
    assert engine._inflight is None and not engine.has_work()


def test_small_budget_preempts_under_overlap(tiny_qwen3_dir):
    engine = make_engine(tiny_qwen3_dir, True, max_total_tokens=48, page_size=4)
    run(engine, {}, {5: 1})
    assert engine.scheduler.num_preempted > 0


def test_chunked_prompts_with_prompt_logprobs_under_overlap(tiny_qwen3_dir):
    """Chunks of a long prompt launched behind one another (each chunk's prompt logprobs read
    back a step later) while short requests decode beside them, and a prompt-only request
    (max_new 0): as without overlap, and once the prompts are in, the decodes run as one batch."""
    prompt = [3, 13, 2, 14, 6, 11, 10, 4, 7, 12] * 3

    def run_chunked(overlap: bool):
        engine = make_engine(
            tiny_qwen3_dir, overlap, page_size=4, chunked_prefill_size=8, max_running_requests=8
        )
        short = [[5, 6], [7, 8, 9], [2]]
        requests = [
            GenerateRequest(p, SamplingParams(max_new_tokens=12, sampling_seed=i, ignore_eos=True))
            for i, p in enumerate(short)
        ]
        requests += [
            GenerateRequest(
                list(prompt),
                SamplingParams(max_new_tokens=5, sampling_seed=7, ignore_eos=True),
                logprob_start_len=4,
            ),
            GenerateRequest(list(prompt[:9]), SamplingParams(max_new_tokens=0), logprob_start_len=0),
        ]
        return engine, engine.generate(requests)

    _, plain = run_chunked(False)
    engine, overlapped = run_chunked(True)
    assert engine.runner.num_eager_behind > 0
    assert len(plain[3].input_logprobs) == 30 - 4 and plain[4].output_ids == []  # as requested
    # the decodes are never split into halves that take turns (each step reading every weight)
    steps = engine.runner.steps
    assert not any(a and b and a.isdisjoint(b) for a, b in itertools.pairwise(steps)), steps
    for a, b in zip(plain, overlapped, strict=True):
        assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
        assert [v is None for v in a.input_logprobs] == [v is None for v in b.input_logprobs]
        values = [torch.tensor([v for v in out.input_logprobs if v is not None]) for out in (a, b)]
        assert torch.allclose(*values, atol=1e-5)
        assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-5)
