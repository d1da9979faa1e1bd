"""rlx.engine's release_memory / resume_memory (SGLang's memory occupation calls) on CPU: weights
come back with their values only with `enable_weights_cpu_backup`; without it the engine refuses
requests until every tensor has been loaded again (from a weight update or a whole checkpoint)."""

from __future__ import annotations

import pytest
import torch

from rlx.engine import Engine, EngineArgs, GenerateRequest, SamplingParams

PROMPTS = [[5], [2, 3, 4], [9, 8, 7, 6, 5, 4, 12]]


def make_engine(path, **kwargs) -> Engine:
    return Engine(EngineArgs(model_path=str(path), device="cpu", **kwargs))


def greedy(engine: Engine) -> list[list[int]]:
    sp = dict(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    return [
        o.output_ids
        for o in engine.generate([GenerateRequest(list(p), SamplingParams(**sp)) for p in PROMPTS])
    ]


def checkpoint_tensors(path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(path / "model.safetensors")).items())


def test_with_cpu_backup_weights_come_back_with_their_values(scrambled_dir):
    engine = make_engine(scrambled_dir, enable_weights_cpu_backup=True)
    before = greedy(engine)
    engine.release_memory()
    assert all(p.numel() == 0 for p in engine.model.parameters())
    assert engine.kv_cache.released
    engine.resume_memory()
    assert greedy(engine) == before
    engine.release_memory(["weights"])  # the host copies are reused the second time
    engine.resume_memory(["weights"])
    assert greedy(engine) == before


def test_requests_are_refused_while_released_and_the_saver_changes_nothing_on_cpu(scrambled_dir):
    """A request while the memory is released is refused with what to do (with the memory saver
    a released tensor's addresses have no memory behind them). On the CPU the saver (CUDA
    virtual memory) is off whatever the argument: release and resume behave as without it."""
    engine = make_engine(scrambled_dir, enable_memory_saver=True, enable_weights_cpu_backup=True)
    assert engine.model.weight_arena is None and engine.kv_cache.arena is None
    before = greedy(engine)
    engine.release_memory(["kv_cache"])
    with pytest.raises(RuntimeError, match="kv_cache memory is released: resume_memory_occupation first"):
        greedy(engine)
    engine.resume_memory()
    assert greedy(engine) == before


def test_without_backup_requests_wait_for_every_tensor_to_be_loaded(scrambled_dir):
    engine = make_engine(scrambled_dir)  # SGLang's default: no CPU backup
    before = greedy(engine)
    engine.release_memory()
    engine.resume_memory()
    with pytest.raises(RuntimeError, match="enable_weights_cpu_backup=true"):
        greedy(engine)
    named = checkpoint_tensors(scrambled_dir)
    assert "lm_head.weight" not in dict(named)  # tied: the embedding fills both names
    engine.load_named_weights(named[:-1], weight_version="1")  # a bucket short: still refused
    with pytest.raises(RuntimeError, match=rf"1 tensors \(first: {named[-1][0]}\)"):
        greedy(engine)
    engine.load_named_weights(named[-1:], weight_version="1")
    assert greedy(engine) == before


def test_without_backup_a_whole_checkpoint_restores_and_a_partial_one_is_refused(scrambled_dir, tmp_path):
    from safetensors.torch import save_file

    engine = make_engine(scrambled_dir)
    before = greedy(engine)
    engine.release_memory(["weights"])
    engine.resume_memory(["weights"])
    partial = tmp_path / "partial"
    partial.mkdir()
    named = checkpoint_tensors(scrambled_dir)
    save_file(dict(named[1:]), str(partial / "model.safetensors"))
    with pytest.raises(ValueError, match=f"lacks.*{named[0][0]}"):
        engine.load_weights_from_disk(str(partial))
    engine.load_weights_from_disk(str(scrambled_dir))
    assert greedy(engine) == before


def test_http_generate_answers_the_refusal_and_the_server_keeps_serving(scrambled_dir):
    from rlx.engine.local import LocalEngine
    from rlx.engine.serve.scheduler_thread import SchedulerThread

    local = LocalEngine(str(scrambled_dir), device="cpu")
    scheduler = SchedulerThread(local, max_batch_size=8)
    scheduler.start()
    try:
        request = GenerateRequest([5, 6], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
        scheduler.call(lambda: (local.release_memory(), local.resume_memory())).result(30)
        (pending,) = scheduler.submit([request])
        with pytest.raises(RuntimeError, match="released without a CPU backup"):
            pending.future.result(30)
        named = checkpoint_tensors(scrambled_dir)
        scheduler.call(lambda: local.load_named_weights(named)).result(30)
        (pending,) = scheduler.submit([request])
        output, _ = pending.future.result(30)
        assert len(output.output_ids) == 3
    finally:
        scheduler.stop()


def test_the_cpu_cache_is_zeroed_because_its_gather_path_reads_unwritten_slots(scrambled_dir):
    """The gather + SDPA path (CPU, fp32) meets every slot of a row's blocks, masked or not, and
    0 x NaN is NaN: a cache holding NaN where nothing was written changes the tokens, so the
    engine keeps it zeroed there (at allocation and at every resume). The GPU's bf16 paths read
    written slots only and skip it (tests/gpu/test_engine.py)."""
    engine = make_engine(scrambled_dir)
    assert engine.kv_cache.zeroed
    before = greedy(engine)
    engine.kv_cache.data.fill_(float("nan"))
    engine.blocks.forget_cached()
    assert greedy(engine) != before  # NaN in the slots past each row's context
    engine.release_memory(["kv_cache"])
    engine.resume_memory(["kv_cache"])
    assert torch.count_nonzero(engine.kv_cache.data) == 0
    assert greedy(engine) == before
