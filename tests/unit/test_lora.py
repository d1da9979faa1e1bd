"""LoRA on the Megatron policy, one in-process rank (CPU, gloo): the adapters' arithmetic by hand,
the frozen base, the optimizer and checkpoint holding adapters only, the reference being the
base, and the exports (merged HF directory, PEFT adapter) reproducing the trainer's log-probs in
transformers and peft.

Tolerance: fp32 on both sides; megatron and transformers sum in another order: 1e-4 on log-probs.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_packing import _batch  # tests/unit is on sys.path (rootdir conftest)
from transformers import AutoModelForCausalLM

from rlx import checkpoint
from rlx.config.compose import compose, to_object
from rlx.lora.apply import adapters
from rlx.models.bridge import unwrap
from rlx.ports import free_port
from rlx.trainer.megatron import MegatronTrainer

RANK, ALPHA = 4, 8.0
LORA = [f"train.lora.rank={RANK}", f"train.lora.alpha={ALPHA}", "train.lr=0.05", "algo.use_kl_loss=true"]


def _trainer(tmp_path, *overrides, total_steps: int = 3) -> MegatronTrainer:
    cfg = to_object(compose([f"run.output_dir={tmp_path}", "rollout.batch_size=2", "rollout.n_samples_per_prompt=8",
                             "train.micro_batch_size=4", "data.max_prompt_len=8", "rollout.max_response_len=20",
                             *overrides]))  # fmt: skip
    return MegatronTrainer(cfg.model, cfg.algo, cfg.train, cfg.cluster, rank=0, world_size=1,
                           master_addr="127.0.0.1", master_port=free_port(), seed=0, total_steps=total_steps)  # fmt: skip


def _hf_logprobs(model, samples) -> list[torch.Tensor]:
    out = []
    for s in samples:
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float()
        logp_V = torch.log_softmax(logits, -1)[len(s.prompt_ids) - 1 : -1]
        out.append(logp_V.gather(1, torch.tensor(s.response_ids)[:, None])[:, 0])
    return out


def _assert_rows_close(got, expected, atol=1e-4):
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(g.float(), e.float(), rtol=0, atol=atol, msg=f"sample {i}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two rollouts of GRPO with KL loss on LoRA adapters (rank 4 on every linear layer), then
    the merged HF directory, the PEFT directory, and the log-probs of policy and reference."""
    tmp = tmp_path_factory.mktemp("lora")
    trainer = _trainer(tmp, *LORA)
    try:
        samples = _batch()
        history = [trainer.train(samples), trainer.train(samples)]
        base_dir = trainer.family.checkpoint_dir()
        checkpoint.export_hf(trainer, tmp / "hf", base_dir, tmp / "hf_adapter")
        result = {
            "tmp": tmp,
            "history": history,
            "samples": samples,
            "base_dir": base_dir,
            "policy_logp": trainer._logprobs(trainer.policy.chunks, samples),
            "ref_logp": trainer._reference_logprobs(samples),
            "trainable": [n for n, p in trainer.model.module.named_parameters() if p.requires_grad],
            "optimizer_params": [p for g in trainer.policy.optimizer.param_groups for p in g["params"]],
            "grad_buffer_numel": sum(b.numel_unpadded for b in trainer.model.buffers),
            "adapters": {
                name: (a.a.detach().clone(), a.b.detach().clone()) for name, a in adapters(trainer.model)
            },
            "layer": _one_layer_by_hand(trainer),
        }
    finally:
        trainer.shutdown()
    return result


def _one_layer_by_hand(trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's linear_fc2 (row-parallel) on a random input: its output, and W x + (alpha/r) B A x
    written out from its own tensors."""
    mlp = unwrap(trainer.model).decoder.layers[0].mlp
    layer, adapter = mlp.linear_fc2, mlp.linear_fc2_lora
    x = torch.randn(5, 1, layer.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, _ = layer(x)
        by_hand = x @ layer.weight.T + (ALPHA / RANK) * (x @ adapter.a.T) @ adapter.b.T
    return out, by_hand


def test_the_adapter_adds_its_scaled_low_rank_update_by_hand(trained):
    out, by_hand = trained["layer"]
    torch.testing.assert_close(out, by_hand, rtol=1e-5, atol=1e-6)


def test_only_the_adapters_train(trained):
    # tiny qwen3: 2 layers x 4 adapted layers (qkv, proj, fc1, fc2) x 2 factors
    assert len(trained["trainable"]) == 16
    assert all(n.endswith(("_lora.a", "_lora.b")) for n in trained["trainable"])
    assert len(trained["optimizer_params"]) == 16  # no Adam state or master copy of the base
    # grad buffers for the adapters alone: per layer, A [4, in] + B [out, 4] with hidden 64,
    # q/k/v out 4*16 + 2*2*16 = 128, fc1 out 2*128 = 256, fc2 in 128:
    #   qkv 4*64 + 128*4 = 768, proj 4*64 + 64*4 = 512, fc1 4*64 + 256*4 = 1280, fc2 4*128 + 64*4 = 768
    assert trained["grad_buffer_numel"] == 2 * (768 + 512 + 1280 + 768)
    # the adapters moved: B left zero at the first step
    assert all(b.abs().max() > 0 for _, b in trained["adapters"].values())


def test_merged_export_changes_adapted_weights_only(trained):
    base = load_file(trained["base_dir"] / "model.safetensors")
    merged = {}
    for path in sorted((trained["tmp"] / "hf").glob("model-*.safetensors")):
        merged |= load_file(path)
    assert set(merged) == set(base)
    adapted = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, tensor in base.items():
        if any(f".{m}." in name for m in adapted):
            assert (merged[name] - tensor).abs().max() > 1e-4, name  # W + (alpha/r) B A
        else:
            assert torch.equal(merged[name], tensor), name  # embedding, norms: frozen, bit for bit


def test_merged_checkpoint_reproduces_the_trainers_logprobs_in_transformers(trained):
    model = AutoModelForCausalLM.from_pretrained(trained["tmp"] / "hf", dtype=torch.float32)
    _assert_rows_close(_hf_logprobs(model, trained["samples"]), trained["policy_logp"])


def test_peft_adapter_on_the_base_reproduces_the_trainers_logprobs(trained):
    from peft import PeftModel

    config = json.loads((trained["tmp"] / "hf_adapter" / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    base = AutoModelForCausalLM.from_pretrained(trained["base_dir"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, trained["tmp"] / "hf_adapter").eval()
    _assert_rows_close(_hf_logprobs(model, trained["samples"]), trained["policy_logp"])
    # and the adapters are what moved it: without them, the base's log-probs
    with model.disable_adapter():
        plain = _hf_logprobs(model, trained["samples"])
    assert max((p - q).abs().max().item() for p, q in zip(plain, trained["policy_logp"], strict=True)) > 1e-3


def test_the_reference_is_the_base_model(trained):
    base = AutoModelForCausalLM.from_pretrained(trained["base_dir"], dtype=torch.float32)
    _assert_rows_close(trained["ref_logp"], _hf_logprobs(base, trained["samples"]))
    history = trained["history"]
    assert history[0]["train/kl"] == 0.0  # B = 0: the policy starts as its reference
    assert history[1]["train/kl"] > 0.0


def test_checkpoint_holds_the_adapters_and_resumes_exactly(tmp_path):
    from megatron.core import dist_checkpointing

    samples = _batch()
    trainer = _trainer(tmp_path, *LORA)
    try:
        trainer.train(samples)
        trainer.save(str(tmp_path / "ckpt"))
        uninterrupted = trainer.train(samples)
    finally:
        trainer.shutdown()
    model_keys = [
        k for k in dist_checkpointing.load_tensors_metadata(str(tmp_path / "ckpt")) if "optimizer" not in k
    ]
    assert model_keys and all(k.endswith(("_lora.a", "_lora.b")) for k in model_keys), model_keys
    trainer = _trainer(tmp_path, *LORA)
    try:
        trainer.load(str(tmp_path / "ckpt"))
        resumed = trainer.train(samples)
    finally:
        trainer.shutdown()
    for key in ("train/loss", "train/kl", "train/grad_norm", "train/entropy"):
        assert resumed[key] == pytest.approx(uninterrupted[key], rel=1e-6, abs=1e-9), key
    # another rank cannot take these adapters: named before anything loads
    trainer = _trainer(tmp_path, *[o.replace(f"rank={RANK}", "rank=2") for o in LORA])
    try:
        with pytest.raises(ValueError, match=r"written with LoRA rank=4.*this run trains with rank=2"):
            trainer.load(str(tmp_path / "ckpt"))
    finally:
        trainer.shutdown()


MLA = "train.lora.target_modules=[linear_q_up_proj,linear_kv_up_proj,linear_proj]"


@pytest.mark.parametrize(
    ("model", "targets", "peft_modules"),
    [
        ("tiny_llama3", [], {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
        ("tiny_glm4", [], {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"}),
        ("tiny_qwen3_moe", [], {"q_proj", "k_proj", "v_proj", "o_proj"}),  # routed experts: not adapted
        ("tiny_deepseek_v3", [MLA], {"q_b_proj", "kv_b_proj", "o_proj"}),  # MLA's up-projections
    ],
)
def test_every_family_exports_what_it_trained(model, targets, peft_modules, tmp_path):
    """Each family's layers (GLM-4's fused gate_up and q/k/v biases, MoE attention, MLA's up-projections)
    adapted and trained a step: the merged export in transformers and the PEFT adapter on the base give
    the trainer's log-probs."""
    from peft import PeftModel

    trainer = _trainer(tmp_path, f"model={model}", *LORA, *targets)
    try:
        samples = _batch()
        trainer.train(samples)
        policy = trainer._logprobs(trainer.policy.chunks, samples)
        base_dir = trainer.family.checkpoint_dir()
        checkpoint.export_hf(trainer, tmp_path / "hf", base_dir, tmp_path / "hf_adapter")
    finally:
        trainer.shutdown()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    _assert_rows_close(_hf_logprobs(merged, samples), policy)
    config = json.loads((tmp_path / "hf_adapter" / "adapter_config.json").read_text())
    assert set(config["target_modules"]) == peft_modules
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, tmp_path / "hf_adapter").eval()
    _assert_rows_close(_hf_logprobs(adapted, samples), policy)
    with adapted.disable_adapter():
        plain = _hf_logprobs(adapted, samples)
    assert max((p - q).abs().max().item() for p, q in zip(plain, policy, strict=True)) > 1e-3


def test_an_moe_models_mlp_adapters_get_the_merged_export_only(tmp_path):
    """peft moves an MoE model's gate/up/down adapters onto its fused routed experts (transformers v5),
    so DeepSeek-V3's dense layer and shared experts' adapters have no PEFT export: refused, naming the
    way out, while the merged export holds them."""
    trainer = _trainer(tmp_path, "model=tiny_deepseek_v3", *LORA)
    try:
        trainer.train(_batch())
        trainer.export_weights(str(tmp_path / "hf"))
        with pytest.raises(
            ValueError, match="adapted MLP layers, whose adapters peft loads onto the fused routed"
        ):
            trainer.export_adapter(str(tmp_path / "hf_adapter"))
    finally:
        trainer.shutdown()
    assert not (tmp_path / "hf_adapter").exists()


CONFIG_ERRORS = [
    (["train.lora.rank=0"], "train.lora.rank=0 must be >= 1, or null to train every weight without LoRA"),
    (["train.lora.alpha=32"], "train.lora.alpha=32.0 takes effect only when train.lora.rank is set"),
    (["train.lora.rank=4", "train.lora.dropout=1.0"], "train.lora.dropout=1.0 must be in [0, 1)"),
    (
        ["train.lora.rank=4", "train.lora.target_modules=[q_proj]"],
        "q_proj names no layer of model=tiny_qwen3; q_proj is HF's name: rlx adapts Megatron's layers, and "
        "linear_qkv holds it; the model's layers LoRA can adapt are linear_qkv, linear_proj, linear_fc1, linear_fc2",
    ),
    (
        ["train.lora.rank=4", "model=tiny_deepseek_v3", "train.lora.target_modules=[linear_qkv]"],
        "linear_qkv names no layer of model=tiny_deepseek_v3; the model's layers LoRA can adapt are "
        "linear_q_up_proj, linear_kv_up_proj, linear_proj, linear_fc1, linear_fc2",
    ),
    (["train.lora.rank=4", "train.lora.target_modules=[]"], "train.lora.target_modules is empty"),
    (["train.lora.rank=4", "algo=ppo"], "LoRA trains the policy only, and this algorithm trains a critic"),
    (["train.lora.rank=4", "train.lora.experts=true"], "model=tiny_qwen3 has no routed experts"),
    (
        [
            "train.lora.rank=4",
            "train.lora.experts=true",
            "model=tiny_qwen3_moe",
            "cluster.num_trainer_procs=2",
            "cluster.tensor_parallel_size=2",
        ],
        "train.lora.experts=true with cluster.tensor_parallel_size=2",
    ),  # fmt: skip
]


CONFIG_ERROR_IDS = ["rank 0", "alpha alone", "dropout", "HF name", "MLA names", "empty targets", "critic",
                    "experts on a dense model", "experts under TP"]  # fmt: skip


@pytest.mark.parametrize(("overrides", "message"), CONFIG_ERRORS, ids=CONFIG_ERROR_IDS)
def test_lora_mistakes_are_named_at_compose(overrides, message):
    from rlx.errors import ConfigError

    with pytest.raises(ConfigError) as error:
        compose(overrides)
    assert message in str(error.value)


def test_every_family_names_the_layers_it_adapts():
    """A LoRA config with the defaults (all-linear) composes for every tiny family, and naming each
    family's own layers does too."""
    from rlx.config.build import build

    for model in ("tiny_qwen3", "tiny_llama3", "tiny_glm4", "tiny_qwen3_moe", "tiny_deepseek_v3"):
        cfg = to_object(compose([f"model={model}", "train.lora.rank=4"]))
        names = build(cfg.model).lora_modules()
        compose([f"model={model}", "train.lora.rank=4", f"train.lora.target_modules=[{','.join(names)}]"])
