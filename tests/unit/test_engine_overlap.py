"""The engine's overlapped decode (step k+1 launched before step k is read back) on CPU.

On CUDA the overlap runs decode CUDA graphs that take pending tokens from the device. Here a
runner stands in for them: it runs the eager CPU step, taking each PENDING input from the
previous launch's results by the row the engine names, and returns results only when the
engine collects them. Outputs must equal the engine without overlap, request by request:
seeded sampling, EOS stops, stop strings, aborts mid-flight, staggered arrivals and
preemption under a small KV budget.
"""

from __future__ import annotations

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

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def can_launch(self, batch: ScheduledBatch) -> bool:
        return batch.num_decode == len(batch.seqs)

    def launch(self, seqs, sources):
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
        return [float(t) for t in self.previous], [lp for _, _, lp in result.sampled]

    def collect(self, handle):
        return handle


def make_engine(path, overlap: bool, **kwargs) -> Engine:
    engine = Engine(EngineArgs(model_path=str(path), device="cpu", **kwargs))
    if overlap:
        engine.runner = EmulatedGraphRunner(engine.runner)
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
    ],
)
def test_overlap_gives_the_same_outputs(tiny_qwen3_dir, kwargs, abort_at, arrive_at):
    plain = run(make_engine(tiny_qwen3_dir, False, **kwargs), abort_at, arrive_at)
    engine = make_engine(tiny_qwen3_dir, True, **kwargs)
    overlapped = run(engine, abort_at, arrive_at)
    assert engine.runner.num_launched > 0
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
