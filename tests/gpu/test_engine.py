"""rlx.engine on CUDA: parity with transformers (fp32 and bf16), CUDA-graph decode, memory
release/resume, in-place weight reload. Skipped without a GPU. The Triton kernels themselves are
tested in tests/kernels (on a GPU, and in Triton's CPU interpreter)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[5, 9, 2], list(range(2, 40)), [7] * 70, list(range(100, 117))]


def small_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        initializer_range=0.1, tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlx.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(small_config(), tmp_path_factory.mktemp("gpu_engine") / "m", seed=0)


def engine_for(path, **kwargs):
    from rlx.engine import Engine, EngineArgs

    return Engine(EngineArgs(model_path=str(path), device="cuda", **kwargs))


def reference(path, prompt, output, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output], device="cuda")).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(output, device="cuda")[:, None])[:, 0].cpu()


def greedy(engine, max_new=24):
    from rlx.engine import GenerateRequest, SamplingParams

    sp = dict(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return engine.generate([GenerateRequest(list(p), SamplingParams(**sp)) for p in PROMPTS])


def test_fp32_greedy_and_logprobs_match_transformers(model_dir):
    from transformers import AutoModelForCausalLM

    engine = engine_for(model_dir, dtype="float32", max_total_tokens=4096)
    assert engine.runner.graphs is not None
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
    for prompt, out in zip(PROMPTS, greedy(engine), strict=True):
        expected = model.generate(
            torch.tensor([prompt], device="cuda"),
            do_sample=False,
            max_new_tokens=24,
            min_new_tokens=24,
            pad_token_id=0,
        )
        assert out.output_ids == expected[0, len(prompt) :].tolist()
        ref = reference(model_dir, prompt, out.output_ids)
        assert (torch.tensor(out.output_logprobs) - ref).abs().max().item() < 1e-3


def test_bf16_logprobs_within_tolerance_of_fp32_transformers(model_dir):
    """bf16 engine vs transformers in fp32 on the engine's own tokens: max |dlogp| <= 0.15,
    mean <= 0.03 (bf16 has 8 mantissa bits; transformers bf16 itself differs as much)."""
    engine = engine_for(model_dir, dtype="bfloat16", max_total_tokens=4096)
    diffs = []
    for prompt, out in zip(PROMPTS, greedy(engine), strict=True):
        ref = reference(model_dir, prompt, out.output_ids)
        diffs.append((torch.tensor(out.output_logprobs) - ref).abs())
    diffs = torch.cat(diffs)
    print(f"bf16 |dlogp| max {diffs.max():.4f} mean {diffs.mean():.4f}")
    assert diffs.max().item() <= 0.15 and diffs.mean().item() <= 0.03


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_kv_cache_stays_near_fp32_transformers(model_dir, kv):
    """`kv_cache_dtype=fp8_*`: one byte an element, written by the fused q/k kernel, read by the
    decode kernel in and out of its CUDA graphs. The first new token comes from the prefill, which
    attends to the step's own K/V as computed: it is the bf16 cache's, logprob and all; every later
    token reads rounded keys and values (e4m3: 3 mantissa bits, e5m2: 2), against transformers in
    fp32 within max |dlogp| 0.6 / 1.0, mean 0.15 / 0.25 (1×H200: 0.38 / 0.64 and 0.091 / 0.134;
    bf16's own cache 0.071 and 0.021, above): a cache read wrongly is off by nats."""
    bf16 = greedy(engine_for(model_dir, dtype="bfloat16", max_total_tokens=4096))
    engine = engine_for(model_dir, dtype="bfloat16", max_total_tokens=4096, kv_cache_dtype=kv)
    assert engine.kv_cache.data.element_size() == 1 and engine.runner.graphs is not None
    diffs = []
    for prompt, out, out16 in zip(PROMPTS, greedy(engine), bf16, strict=True):
        assert (out.output_ids[0], out.output_logprobs[0]) == (out16.output_ids[0], out16.output_logprobs[0])
        ref = reference(model_dir, prompt, out.output_ids)
        diffs.append((torch.tensor(out.output_logprobs) - ref).abs())
    diffs = torch.cat(diffs)
    print(f"{kv} |dlogp| max {diffs.max():.4f} mean {diffs.mean():.4f}")
    most, mean = {"fp8_e4m3": (0.6, 0.15), "fp8_e5m2": (1.0, 0.25)}[kv]
    assert diffs.max().item() <= most and diffs.mean().item() <= mean


@pytest.mark.parametrize("saver", [True, False], ids=["memory_saver", "no_saver"])
@pytest.mark.parametrize("backup", [True, False], ids=["cpu_backup", "no_backup"])
def test_release_and_resume_free_and_restore_memory(model_dir, backup, saver):
    """Released, the weights and KV cache are given back (and work is refused); resumed, the
    same tokens. With the memory saver they come back at their addresses, though the memory
    they had was taken meanwhile, and the decode graphs are replayed, not captured again."""
    engine = engine_for(
        model_dir,
        dtype="bfloat16",
        mem_fraction_static=0.5,
        enable_weights_cpu_backup=backup,
        enable_memory_saver=saver,
    )
    assert (engine.model.weight_arena is not None) == saver
    before = [o.output_ids for o in greedy(engine)]
    graphs = engine.runner.graphs
    captured = graphs.num_captured
    pointers = [engine.kv_cache.data.data_ptr(), *(p.data_ptr() for p in engine.model.parameters())]
    kv_bytes = engine.kv_cache.data.nbytes
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    engine.release_memory(["kv_cache", "weights"])
    free_released = torch.cuda.mem_get_info()[0]
    assert free_released - free_before >= 0.9 * kv_bytes
    with pytest.raises(RuntimeError, match="kv_cache and weights memory is released"):
        greedy(engine)
    taken = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")  # what the trainer would take
    del taken
    torch.cuda.empty_cache()
    engine.resume_memory(["kv_cache", "weights"])
    free_resumed = torch.cuda.mem_get_info()[0]
    assert abs(free_resumed - free_before) <= 0.1 * kv_bytes
    if not backup:  # the weights came back uninitialized: refused until loaded again
        with pytest.raises(RuntimeError, match="without a CPU backup"):
            greedy(engine)
        engine.load_weights_from_disk(str(model_dir))
    assert [o.output_ids for o in greedy(engine)] == before
    if saver:
        assert [
            engine.kv_cache.data.data_ptr(),
            *(p.data_ptr() for p in engine.model.parameters()),
        ] == pointers
        assert graphs.num_captured == captured
    else:  # the graphs were cleared at the release and captured again
        assert graphs.num_captured > captured


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kv_cache_is_zeroed_only_where_an_attention_path_reads_unwritten_slots(model_dir, dtype):
    """bf16 (the decode kernel's masked loads, flash prefill over each row's own keys): a cache
    full of NaN after a resume, as new memory may be, gives the same tokens and logprobs, bit for
    bit, fresh and through cached prefixes (the second batch, against the same batch before). fp32
    (SDPA over gathered blocks, where a masked slot meets V): the resumed cache is zeros though
    NaN filled it before."""
    engine = engine_for(model_dir, dtype=dtype, mem_fraction_static=0.5, enable_memory_saver=True)
    assert engine.kv_cache.zeroed == (dtype == "float32")

    def fresh_then_cached():
        return [[(o.output_ids, o.output_logprobs) for o in greedy(engine)] for _ in range(2)]

    before = fresh_then_cached()
    engine.kv_cache.data.fill_(float("nan"))
    engine.release_memory(["kv_cache"])
    engine.resume_memory(["kv_cache"])
    if dtype == "bfloat16":
        engine.kv_cache.data.fill_(float("nan"))
    else:
        assert torch.count_nonzero(engine.kv_cache.data) == 0
    # the cached batch prefills only the prompts' last blocks: other GEMM shapes than the fresh
    # one (the layers' small GEMMs at up to 64 rows), so its tokens are compared with the same
    # batch's before, not with the fresh batch's
    assert fresh_then_cached() == before


def test_server_info_reports_the_saver_and_the_graphs_on_cuda(model_dir):
    """/get_server_info's rlx fields read the CUDA engine: the saver resolved on, the graphs'
    largest batch, and after a request the graphs captured and the seconds spent on them."""
    from rlx.engine.local import LocalEngine
    from rlx.engine.serve.server import EngineServer

    engine = LocalEngine(str(model_dir), device="cuda", dtype="bfloat16", mem_fraction_static=0.5,
                         enable_memory_saver=True, cuda_graph_max_bs=32)  # fmt: skip
    server = EngineServer(engine)
    info, state = server.server_args(), server.internal_state()
    assert info["enable_memory_saver"] is True and info["device"] == "cuda"
    assert info["cuda_graph_max_bs"] == 32 and info["disable_cuda_graph"] is False
    assert state["num_cuda_graphs_captured"] == engine.runner.graphs.num_captured
    greedy(engine)
    state = server.internal_state()
    assert state["num_cuda_graphs_captured"] >= 1 and state["cuda_graph_capture_s"] > 0


def test_weight_reload_in_place(model_dir, tmp_path):
    from rlx.models.tiny import write_tiny_checkpoint

    other = write_tiny_checkpoint(small_config(), tmp_path / "other", seed=1)
    engine = engine_for(model_dir, dtype="float32", max_total_tokens=4096)
    greedy(engine)  # graphs captured
    pointers = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    engine.load_weights_from_disk(str(other), weight_version="2")
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == pointers
    for prompt, out in zip(PROMPTS, greedy(engine), strict=True):
        ref = reference(other, prompt, out.output_ids)
        assert (torch.tensor(out.output_logprobs) - ref).abs().max().item() < 1e-3


def test_overlap_and_graphs_give_the_plain_engine_outputs(model_dir):
    """Overlapped graph decode equals decode without overlap, token for token (greedy and
    seeded sampling, EOS stops, a top-k row)."""
    from rlx.engine import GenerateRequest, SamplingParams

    def run(**kwargs):
        engine = engine_for(model_dir, dtype="float32", max_total_tokens=4096, **kwargs)
        requests = [
            GenerateRequest(
                list(p), SamplingParams(max_new_tokens=20 + i, sampling_seed=i, top_k=8 if i == 1 else -1)
            )
            for i, p in enumerate(PROMPTS * 3)
        ]
        return [(o.output_ids, o.finish_reason) for o in engine.generate(requests)]

    assert run() == run(disable_overlap_schedule=True)


def test_top_k_one_in_decode_graphs_samples_the_argmax(model_dir):
    """Rows with top-k go through the torch sampler after the graph's fused draw (the flag each
    sequence carries, `Sequence.truncates`): top-k 1 at temperature 1 gives the greedy tokens."""
    from rlx.engine import GenerateRequest, SamplingParams

    engine = engine_for(model_dir, dtype="float32", max_total_tokens=4096)

    def run(**sampling):
        requests = [
            GenerateRequest(list(p), SamplingParams(max_new_tokens=12, ignore_eos=True, **sampling))
            for p in PROMPTS * 3
        ]
        return [o.output_ids for o in engine.generate(requests)]

    assert run(top_k=1, sampling_seed=3) == run(temperature=0.0)
    assert engine.runner.graphs.num_captured > 0


def test_graphs_captured_mid_rollout_give_the_outputs_of_graphs_captured_up_front(model_dir):
    """A batch size is captured the first time a decode step needs it, between overlapped steps
    (the batch shrinks as rows finish): its warm-up must not touch the live KV cache or the
    sampled tokens the next step reads. Same tokens as with the whole ladder captured before, and
    as after a memory release, where steps replay a captured graph of up to twice their rows."""
    from rlx.engine import GenerateRequest, SamplingParams

    def run(up_front: bool, released: bool = False):
        engine = engine_for(model_dir, dtype="float32", max_total_tokens=4096)
        if released:  # the graphs cleared, as in a colocated step: pad rather than capture
            engine.release_memory(["kv_cache"])
            engine.resume_memory(["kv_cache"])
        if up_front:
            engine.runner.graphs.capture()
        captured = engine.runner.graphs.num_captured
        requests = [
            GenerateRequest(
                list(p), SamplingParams(max_new_tokens=8 + 3 * i, sampling_seed=i, ignore_eos=True)
            )
            for i, p in enumerate(PROMPTS * 3)
        ]
        outputs = [o.output_ids for o in engine.generate(requests)]
        return outputs, engine.runner.graphs.num_captured - captured

    lazy, captured_during = run(up_front=False)
    assert captured_during == 5  # 12 rows shrinking one by one: sizes 16, 8, 4, 2, 1
    padded, captured_after_release = run(up_front=False, released=True)
    assert captured_after_release == 4  # 16 (12 to 8 rows), 8 (7 to 4), 4 (3 and 2), 1
    assert lazy == padded == run(up_front=True)[0]


def test_seeded_rows_draw_the_same_alone_and_batched(model_dir):
    """A seeded request's tokens do not depend on its batch-mates, on the GPU too: the first
    token comes from the eager (prefill) step, the rest from the decode graphs."""
    from rlx.engine import GenerateRequest, SamplingParams

    engine = engine_for(model_dir, dtype="float32", max_total_tokens=4096)

    def request(i, prompt):
        return GenerateRequest(
            list(prompt), SamplingParams(max_new_tokens=12, sampling_seed=50 + i, ignore_eos=True)
        )

    together = engine.generate([request(i, p) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        (alone,) = engine.generate([request(i, prompt)])
        assert alone.output_ids == together[i].output_ids


def test_dependent_launches_give_the_outputs_of_plain_launches(model_dir, monkeypatch):
    """Programmatic dependent launch (rlx/engine/pdl.py) changes when a kernel starts, never what
    it reads: bf16 decode through the graphs (seeded sampling, default shares) gives the same
    tokens and logprobs, bit for bit, with it off, waiting only, and launching the next early;
    with cuBLAS's GEMMs, and with the layers' small GEMMs (rlx/engine/triton_gemm.py), which the
    engine takes only under PDL and which here also run with plain launches."""
    import rlx.engine.triton_gemm as tg
    from rlx.engine import GenerateRequest, SamplingParams
    from rlx.engine.pdl import pdl_mode

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm90")

    def run(mode: str, small: bool):
        monkeypatch.setenv("RLX_ENGINE_PDL", mode)
        monkeypatch.setenv("RLX_ENGINE_SMALL_GEMM", "1" if small else "0")
        monkeypatch.setattr(tg, "pdl_mode", lambda device: 2)  # what small_gemms_on asks
        pdl_mode.cache_clear()
        engine = engine_for(model_dir, dtype="bfloat16", max_total_tokens=4096)
        assert pdl_mode(torch.device("cuda")) == int(mode)
        assert (engine.runner.model.model.layers[0].self_attn.o_proj.small_settings is not None) == small
        requests = [
            GenerateRequest(list(p), SamplingParams(max_new_tokens=16, sampling_seed=i, ignore_eos=True))
            for i, p in enumerate(PROMPTS * 4)
        ]
        return [(o.output_ids, o.output_logprobs) for o in engine.generate(requests)]

    try:
        for small in (False, True):
            plain = run("0", small)
            assert run("1", small) == plain
            assert run("2", small) == plain
    finally:
        pdl_mode.cache_clear()


def test_the_small_gemms_only_where_the_decode_runs_in_graphs(model_dir, monkeypatch):
    """An engine whose decode runs eagerly (`disable_cuda_graph`) keeps cuBLAS's GEMMs: there the
    host's launch of the small GEMM costs more than it saves (rlx/engine/model_runner.py). So do
    a graphed engine's eager steps: a prompt of 3 tokens is prefilled on cuBLAS's GEMMs, and
    only the decode graphs' warm-up and capture call the small GEMM."""
    import rlx.engine.triton_gemm as tg
    from rlx.engine import GenerateRequest, SamplingParams

    monkeypatch.setenv("RLX_ENGINE_SMALL_GEMM", "1")
    monkeypatch.setattr(tg, "pdl_mode", lambda device: 2)  # what small_gemms_on asks
    for eager in (False, True):
        engine = engine_for(model_dir, dtype="bfloat16", max_total_tokens=4096, disable_cuda_graph=eager)
        layer = engine.runner.model.model.layers[0]
        assert (layer.self_attn.o_proj.small_settings is None) == eager
        assert (layer.mlp.small_swiglu is None) == eager
    engine = engine_for(model_dir, dtype="bfloat16", max_total_tokens=4096)
    graphs, plain, in_graphs = engine.runner.graphs, tg.small_gemm, []

    def recording(*args, **kwargs):
        capture = torch.cuda.is_current_stream_capturing()
        in_graphs.append(capture or torch.cuda.current_stream() == graphs.warm_up_stream)
        return plain(*args, **kwargs)

    monkeypatch.setattr(tg, "small_gemm", recording)
    sampling = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    (done,) = engine.generate([GenerateRequest([5, 9, 2], sampling)])
    assert len(done.output_ids) == 4
    assert in_graphs and all(in_graphs), in_graphs


def test_the_graph_ladder_shares_one_logits_buffer(model_dir):
    """Every decode graph writes its logits into one buffer of the largest batch: capturing the
    ladder's smaller sizes after the largest adds no logits of their own. Each graph kept its own
    output before, and the ladder's outputs added up (10.1 GB for graphs up to 1,024 rows at
    Qwen3's vocabulary, where the buffer takes 0.31)."""
    engine = engine_for(model_dir, dtype="float32", max_total_tokens=4096, cuda_graph_max_bs=256)
    graphs = engine.runner.graphs
    graphs.capture([256])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graphs.capture()
    torch.cuda.synchronize()
    added = torch.cuda.memory_allocated() - before
    own_logits = sum(bs * 512 * 4 for bs in graphs.sizes if bs != 256)  # fp32, vocabulary 512
    assert len(graphs.graphs) == len(graphs.sizes) == 20
    for bs, (_, logits) in graphs.graphs.items():
        assert logits.shape == (bs, 512) and logits.data_ptr() == graphs.logits.data_ptr()
    assert added < own_logits / 4, (added, own_logits)


def test_captures_warm_up_on_one_stream(model_dir, monkeypatch):
    """Capturing makes no new CUDA stream: cuBLAS keeps a workspace (32 MiB on Hopper) for every
    stream it runs on, for the process's life, and a stream a capture (cycling through torch's
    pool of 32) held 1 GiB of them (1xH200, bench/graph_cap.py's first engine)."""
    engine = engine_for(model_dir, dtype="float32", max_total_tokens=4096, cuda_graph_max_bs=64)
    graphs = engine.runner.graphs
    graphs.capture([64])  # the first graph of a process makes torch.cuda.graph's own capture stream
    made, real = [], torch.cuda.Stream

    def counted(*args, **kwargs):
        if "stream_id" not in kwargs:  # not torch's wrapper of an existing stream (current_stream)
            made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Stream", counted)
    graphs.capture()  # the other seven sizes: 1, 2, 4, 8, 16, 32, 48
    assert len(graphs.graphs) == 8 and made == []
