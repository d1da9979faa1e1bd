"""Qwen3-MoE and DeepSeek-V3 (MLA + MoE) on megatron-core equal transformers (CPU, gloo).

Each family runs as its shipped tiny config (conf/model/tiny_*.yaml) and as a variant that takes
the other code paths (Qwen3-MoE: softmax before top-k without renormalisation, tied embeddings;
DeepSeek-V3: no query latent, plain RoPE, tied embeddings). Checked: logits == transformers';
HF -> Megatron -> HF returns the checkpoint; EP=2 and TP=2 (with sequence parallelism, which MoE
needs to train under TP) equal EP=1/TP=1 in logits and in gradients; the local engine's
logprobs == transformers'. The 2-step GRPO run through the loop is in test_family_loops.py.

Tiny checkpoints are written under a temporary RLX_CACHE. DeepSeek-V3 checkpoints get a random
selection bias (`e_score_correction_bias`): HF initialises it to zero, which would leave the
bias path untested.
"""

from __future__ import annotations

import json
from pathlib import Path

import helpers  # tests/ is on sys.path (conftest)
import pytest
import torch
from helpers import assert_same_tensors, hf_logits, megatron_logits, megatron_world, spawn_ranks
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rlx.config import build
from rlx.config.compose import compose, to_object
from rlx.models.attention import SDPAttention
from rlx.models.config import ModelConfig

VARIANTS: dict[str, tuple[str, list[str]]] = {
    "qwen3_moe": ("tiny_qwen3_moe", []),
    "qwen3_moe_pre_softmax": (
        "tiny_qwen3_moe",
        ["model.moe_router_norm_topk_prob=false", "model.tie_word_embeddings=true"],
    ),
    "deepseek_v3": ("tiny_deepseek_v3", []),
    "deepseek_v3_plain": (
        "tiny_deepseek_v3",
        [
            "model.q_lora_rank=null",
            "model.yarn_rotary_scaling_factor=null",
            "model.tie_word_embeddings=true",
            # without YaRN its other keys go back to their defaults (set alone they are refused)
            "model.yarn_original_max_position_embeddings=null",
            "model.yarn_mscale_all_dim=0.0",
        ],  # fmt: skip
    ),
}
PARALLEL_VARIANTS = ("qwen3_moe", "deepseek_v3")
SEQ_LEN = 40  # beyond the tiny DeepSeek's YaRN original context (16), inside its window (64)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[ModelConfig, Path]]:
    """Variant -> (its model config, its tiny HF checkpoint directory)."""
    cache = tmp_path_factory.mktemp("rlx_cache")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLX_CACHE", str(cache))
        for name, (option, overrides) in VARIANTS.items():
            cfg = to_object(compose([f"model={option}", *overrides])).model
            path = build(cfg).checkpoint_dir()
            assert path.is_relative_to(cache)
            if cfg.moe_router_enable_expert_bias:
                randomise_selection_bias(path / "model.safetensors")
            out[name] = (cfg, path)
    return out


def randomise_selection_bias(file: Path) -> None:
    tensors = load_file(file)
    biases = [k for k in tensors if k.endswith("mlp.gate.e_score_correction_bias")]
    assert biases and all(not tensors[k].any() for k in biases)  # what HF writes
    gen = torch.Generator().manual_seed(1)
    for k in biases:
        tensors[k] = 0.05 * torch.randn(tensors[k].shape, generator=gen)
    save_file(tensors, str(file), metadata={"format": "pt"})


def token_batch(seq_len: int = SEQ_LEN) -> torch.Tensor:
    return helpers.token_batch(seq_len)


def load_megatron(cfg: ModelConfig, hf_dir: Path):
    family = build(cfg)
    return family, helpers.load_megatron(family, hf_dir)


def megatron_grads(family, model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF-named gradients of a fixed function of the logits, after megatron's gradient
    finalisation (DP/expert-DP all-reduce, TP all-reduce of sequence-parallel norms)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    ddp = DistributedDataParallel(
        config=model.config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model
    )
    ddp.train()
    ddp.zero_grad_buffer()
    logits = megatron_logits(ddp, ids, grad=True)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    (logits * weights).sum().backward()
    finalize_model_grads([ddp])
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.data for p in params]
    for p in params:  # export the gradients through the bridge, as if they were the weights
        p.data = p.main_grad
    try:
        return {k: v for k, v in family.export_hf_weights(model) if not k.endswith("e_score_correction_bias")}
    finally:
        for p, data in zip(params, saved, strict=True):
            p.data = data


# ---- one process ---------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(world, models, variant):
    cfg, hf_dir = models[variant]
    _, model = load_megatron(cfg, hf_dir)
    layers = model.decoder.layers
    assert all(isinstance(layer.self_attention.core_attention, SDPAttention) for layer in layers)
    moe_layers = [layer for layer in layers if type(layer.mlp).__name__ == "MoELayer"]
    assert len(moe_layers) == cfg.num_layers - cfg.moe_first_dense_layers
    assert all(layer.mlp.num_local_experts == cfg.num_moe_experts for layer in moe_layers)
    if cfg.kv_lora_rank:
        assert all(type(layer.self_attention).__name__ == "MLASelfAttention" for layer in layers)
    ids = token_batch()
    expected = hf_logits(hf_dir, ids)
    with torch.no_grad():
        logits = megatron_logits(model, ids)
    assert logits.shape == expected.shape == (2, SEQ_LEN, 16)
    assert expected.std() > 0.1  # a real, non-degenerate output
    assert (logits - expected).abs().max().item() <= 1e-4


def _swap_experts(model, layer: int, a: int, b: int) -> None:
    experts = model.decoder.layers[layer].mlp.experts.local_experts
    for name in ("linear_fc1", "linear_fc2"):
        wa, wb = getattr(experts[a], name).weight, getattr(experts[b], name).weight
        wa.data, wb.data = wb.data.clone(), wa.data.clone()


MUTATIONS = {
    "qwen3_moe: two experts swapped": ("qwen3_moe", lambda m: _swap_experts(m, 1, 0, 5)),
    "qwen3_moe: top-k not renormalised": (
        "qwen3_moe",
        lambda m: [
            setattr(layer.mlp.router.config, "moe_router_pre_softmax", True) for layer in m.decoder.layers
        ],
    ),
    "deepseek_v3: two experts swapped": ("deepseek_v3", lambda m: _swap_experts(m, 1, 0, 9)),
    "deepseek_v3: selection bias dropped": (
        "deepseek_v3",
        lambda m: m.decoder.layers[1].mlp.router.expert_bias.zero_(),
    ),
    "deepseek_v3: no group limit": (
        "deepseek_v3",
        lambda m: setattr(m.decoder.layers[1].mlp.router.config, "moe_router_group_topk", None),
    ),
    "deepseek_v3: no routed scaling": (
        "deepseek_v3",
        lambda m: setattr(m.decoder.layers[1].mlp.router.config, "moe_router_topk_scaling_factor", None),
    ),
}


@pytest.mark.parametrize(("variant", "mutate"), MUTATIONS.values(), ids=MUTATIONS)
def test_parity_fails_when_routing_is_wrong(world, models, variant, mutate):
    """The tiny models are sensitive enough: each routing detail moves the logits well past 1e-4."""
    cfg, hf_dir = models[variant]
    _, model = load_megatron(cfg, hf_dir)
    mutate(model)  # edits this model's own weights or TransformerConfig
    with torch.no_grad():
        logits = megatron_logits(model, token_batch())
    assert (logits - hf_logits(hf_dir, token_batch())).abs().max().item() > 1e-3


@pytest.mark.parametrize("variant", VARIANTS)
def test_round_trip_returns_the_checkpoint(world, models, variant, tmp_path):
    cfg, hf_dir = models[variant]
    on_disk = load_file(hf_dir / "model.safetensors")
    assert ("lm_head.weight" in on_disk) is not cfg.tie_word_embeddings
    assert sum(".mlp.experts." in k for k in on_disk) == 3 * cfg.num_moe_experts * (
        cfg.num_layers - cfg.moe_first_dense_layers
    )
    family, model = load_megatron(cfg, hf_dir)
    assert_same_tensors(dict(family.export_hf_weights(model)), on_disk)
    assert family.num_parameters() == sum(t.numel() for t in on_disk.values())

    # The same weights in several shards with an index (how large checkpoints come) load alike.
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).save_pretrained(
        sharded, max_shard_size="40KB"
    )
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) == len(
        on_disk
    )
    family, model = load_megatron(cfg, sharded)
    assert_same_tensors(dict(family.export_hf_weights(model)), on_disk)


def test_check_hf_config_names_each_wrong_moe_field(models, tmp_path):
    cfg, hf_dir = models["deepseek_v3"]
    config = json.loads((hf_dir / "config.json").read_text())
    wrong = {**config, "n_routed_experts": 32, "n_group": 8, "q_lora_rank": 64, "n_shared_experts": 1}
    (tmp_path / "config.json").write_text(json.dumps(wrong))
    with pytest.raises(ValueError) as error:
        build(cfg).check_hf_config(tmp_path)
    for part in (
        "model.num_moe_experts=16 but config.json has 32",
        "model.moe_router_num_groups=4 but config.json has 8",
        "model.q_lora_rank=32 but config.json has 64",
        "model.moe_shared_expert_intermediate_size=32 but config.json has 16",
    ):
        assert part in str(error.value)
    assert "kv_lora_rank" not in str(error.value)

    # A released checkpoint's older layout (rope_scaling + rope_theta, not rope_parameters) passes.
    legacy = {k: v for k, v in config.items() if k != "rope_parameters"}
    params = config["rope_parameters"]
    legacy |= {"rope_theta": params["rope_theta"], "rope_scaling": {**params, "type": "yarn"}}
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    build(cfg).check_hf_config(tmp_path)

    cfg, hf_dir = models["qwen3_moe"]
    config = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "num_local_experts": 4, "decoder_sparse_step": 2})
    )
    with pytest.raises(ValueError) as error:
        build(cfg).check_hf_config(tmp_path)
    assert "model.num_moe_experts=8 but config.json has 4" in str(error.value)
    assert "decoder_sparse_step" in str(error.value)


def test_routing_megatron_cannot_reproduce_is_refused(models):
    cfg, _ = models["deepseek_v3"]
    family = build(ModelConfig(**(vars(cfg) | {"moe_router_group_topk": 1})))
    with pytest.raises(
        ValueError, match=r"model.moe_router_topk=4 must be 2 \* model.moe_router_group_topk=1"
    ):
        family.hf_config()
    with pytest.raises(ValueError, match="model.moe_router_score_function"):
        build(ModelConfig(**(vars(cfg) | {"moe_router_score_function": "softmax"})))


# ---- expert and tensor parallelism ----------------------------------------------------------------


def _parallel_rank(rank: int, world_size: int, port: int, models: dict, layout: dict, out_dir: Path) -> None:
    torch.set_num_threads(1)
    results = {}
    with megatron_world(rank, world_size, port, **layout):
        for variant in PARALLEL_VARIANTS:
            cfg, hf_dir = models[variant]
            family, model = load_megatron(cfg, hf_dir)
            moe = model.decoder.layers[-1].mlp
            with torch.no_grad():
                logits = megatron_logits(model, token_batch())
            results[variant] = {
                "sequence_parallel": model.config.sequence_parallel,
                "local_experts": moe.local_expert_indices,
                "local_vocab": model.output_layer.output_size_per_partition,
                "logits": logits,
                "weights": dict(family.export_hf_weights(model)),
                "grads": megatron_grads(family, model, token_batch()),
            }
    torch.save(results, out_dir / f"rank{rank}.pt")


def _reference(models: dict) -> dict[str, dict]:
    """EP=1, TP=1 logits and gradients in this process."""
    out = {}
    for variant in PARALLEL_VARIANTS:
        cfg, hf_dir = models[variant]
        family, model = load_megatron(cfg, hf_dir)
        with torch.no_grad():
            logits = megatron_logits(model, token_batch())
        out[variant] = {"logits": logits, "grads": megatron_grads(family, model, token_batch())}
    return out


def _assert_matches_reference(results: dict, reference: dict, models: dict) -> None:
    for variant in PARALLEL_VARIANTS:
        got, want = results[variant], reference[variant]
        torch.testing.assert_close(got["logits"], want["logits"], atol=1e-5, rtol=1e-5)
        assert sorted(got["grads"]) == sorted(want["grads"])
        assert max(g.abs().max().item() for g in want["grads"].values()) > 1e-2  # real gradients
        for name, grad in want["grads"].items():
            # fp32 summation order differs between layouts: relative to the tensor's largest entry
            # (the embedding's gradient reaches ~6e4 here).
            assert (got["grads"][name] - grad).abs().max().item() <= 1e-5 * grad.abs().max().item(), name
        # Every rank gets every expert back, identical to the checkpoint.
        assert_same_tensors(got["weights"], load_file(models[variant][1] / "model.safetensors"))


def test_ep2_matches_ep1(world, models, tmp_path):
    spawn_ranks(_parallel_rank, 2, models, {"ep": 2}, tmp_path)
    reference = _reference(models)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for variant in PARALLEL_VARIANTS:
            half = models[variant][0].num_moe_experts // 2
            assert results[variant]["local_experts"] == list(range(rank * half, (rank + 1) * half))
            assert results[variant]["local_vocab"] == 16  # TP=1: nothing else is split
        _assert_matches_reference(results, reference, models)


def test_tp2_matches_tp1(world, models, tmp_path):
    spawn_ranks(_parallel_rank, 2, models, {"tp": 2}, tmp_path)
    reference = _reference(models)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for variant in PARALLEL_VARIANTS:
            assert results[variant]["sequence_parallel"] is True  # MoE under TP trains only with SP
            assert results[variant]["local_vocab"] == 8  # really sharded
            assert results[variant]["local_experts"] == list(range(models[variant][0].num_moe_experts))
        _assert_matches_reference(results, reference, models)


# ---- the rollout side and the loop ----------------------------------------------------------------


@pytest.mark.parametrize("variant", PARALLEL_VARIANTS)
def test_local_engine_logprobs_match_transformers(models, variant):
    from rlx.engine import GenerateRequest, SamplingParams
    from rlx.engine.local import LocalEngine

    hf_dir = models[variant][1]
    engine = LocalEngine(str(hf_dir), seed=0)
    prompts = [[2, 3, 4], [5, 6], [7, 8, 9, 10, 11], [12]]  # different lengths: left padding in one batch
    sampling = dict(max_new_tokens=24, temperature=1.0, ignore_eos=True)
    outputs = engine.generate([GenerateRequest(p, SamplingParams(**sampling)) for p in prompts])
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out.output_ids) == 24
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1 : -1]
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(out.output_ids)[:, None])[:, 0]
        assert (torch.tensor(out.output_logprobs) - expected).abs().max().item() <= 1e-5
