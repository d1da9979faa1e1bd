"""The memory plan (rlx.memory) on known small shapes, against bytes worked out by hand here.

The shape is the schema's default model (tiny Qwen3): 2 layers, hidden h=64, FFN f=128, a=4 heads,
g=2 KV groups of d=16, a 16-token vocabulary, tied embeddings, q/k norms. Samples are 8 prompt +
24 response = 32 tokens. CPU only: nothing is built but the family's parameter count.
"""

from __future__ import annotations

import os
import stat
from dataclasses import replace

import pytest

from rlx.cluster import ClusterConfig
from rlx.memory import GIB, Setup, memory_errors, plan_memory, report, trainer_peak_allocated
from rlx.memory.engine import ENGINE_DEFAULTS, kv_bytes_per_token, kv_cache
from rlx.memory.gpus import visible_gpu_bytes
from rlx.memory.params import model_params, rank_params
from rlx.memory.terms import CUDA_CONTEXT_BYTES
from rlx.memory.trainer import trainer_phases
from rlx.models.config import ModelConfig
from rlx.rollout.config import RolloutConfig
from rlx.trainer.config import TrainConfig

TINY = ModelConfig()  # the default tiny Qwen3
# ModelFamily.num_parameters() by hand, per layer:
#   attention h·(a·d + 2·g·d) + a·d·h = 64·(64 + 64) + 64·64 = 12,288; q/k norms 2·16 = 32
#   MLP 3·h·f = 3·64·128 = 24,576; two norms 2·64 = 128          -> 37,024 a layer
# 2 layers 74,048 + embedding 16·64 = 1,024 (tied: once) + final norm 64 = 75,136
TINY_PARAMS = 75_136
PER_LAYER = (TINY_PARAMS - 1_024) / 2  # 37,056: a layer and half the final norm


def setup(model: ModelConfig = TINY, **kw) -> Setup:
    """bf16, micro-batch 2 of 32-token samples, one GPU split from its engine, unless `kw` says otherwise."""
    train = TrainConfig(
        **{"precision": "bf16", "micro_batch_size": 2, "global_batch_size": 8} | kw.pop("train", {})
    )
    cluster = ClusterConfig(**{"gpus_per_node": 2, "num_rollout_gpus": 1} | kw.pop("cluster", {}))
    rollout = RolloutConfig(max_response_len=24, **kw.pop("rollout", {}))
    return Setup(model, train, cluster, rollout, prompt_len=8, **kw)


def terms(phase) -> dict[str, int]:
    """A phase's terms by the name before its parenthesis."""
    return {t.name.split(" (")[0]: t.bytes for t in phase.terms}


def test_parameters_are_the_familys_count_split_by_placement():
    p = model_params(TINY)
    assert (p.total, p.embedding, p.output, p.experts) == (TINY_PARAMS, 1_024, 0, 0)
    assert p.per_layer == PER_LAYER
    # TP=2: half of each layer and of the embedding: 2·37,056/2 + 1,024/2 = 37,568
    assert rank_params(p, tp=2, pp=1, ep=1, stage=0).total == 37_568
    # PP=2, one layer a stage; tied: the first stage has the embedding, the last its own copy
    assert rank_params(p, tp=1, pp=2, ep=1, stage=0).total == 37_056 + 1_024
    assert rank_params(p, tp=1, pp=2, ep=1, stage=1).total == 37_056 + 1_024
    # PPO's critic: the vocabulary head replaced by hidden -> 1 (64 + 1)
    assert rank_params(p, tp=1, pp=1, ep=1, stage=0, value_head=True).total == TINY_PARAMS + 65


def test_training_terms_of_one_gpu_by_hand():
    training, forward, step = trainer_phases(setup(), model_params(TINY), 0)
    # activations a token and layer (bf16, e = 2; fused SwiGLU; rlx.memory.activations):
    #   attention e·[2h + (a+2g)d + (a+g)d + a·d] + 4a = 2·(128 + 128 + 96 + 64) + 16 = 848
    #   MLP       e·[2h + 2f + f]                      = 2·(128 + 256 + 128)       = 1,024
    # 1,872 bytes × 2 rows × 32 tokens = 119,808 a layer; 2 layers = 239,616
    assert terms(training) == {
        "policy weights": TINY_PARAMS * 2,  # 150,272
        "gradients": TINY_PARAMS * 4,  # fp32 grad buffer: 300,544
        "optimizer state": TINY_PARAMS * 12,  # fp32 master + m + v: 901,632
        "activations": 239_616,
        # 64 tokens × 16 vocab × bf16: the backward writes the gradient over them
        "logits, their gradient written over them": 64 * 16 * 2,
        "CUDA context": CUDA_CONTEXT_BYTES,
    }
    assert training.bytes == 150_272 + 300_544 + 901_632 + 239_616 + 2_048 + CUDA_CONTEXT_BYTES
    # forward only: one layer at a time (119,808) and the logits without a gradient (2,048)
    assert terms(forward)["one layer's activations"] == 119_808
    assert terms(forward)["logits"] == 2_048
    # the optimizer step: torch's fused Adam (train.adam_fused, the default) adds no temporary
    assert terms(step) == {k: v for k, v in terms(training).items() if k in ("policy weights", "gradients",
                           "optimizer state", "CUDA context")}  # fmt: skip
    # what bench/grpo_step.py prints beside torch's max_memory_allocated: the largest phase less the
    # CUDA context; here training's (1,352,448 of state + 241,664) over the step's
    assert trainer_peak_allocated(setup()) == training.bytes - CUDA_CONTEXT_BYTES == 1_594_112
    # torch's unfused multi-tensor Adam: sqrt(v), fp32, 4 bytes a parameter; the step's phase is
    # then the largest (1,352,448 of state + 300,544 over training's + 241,664)
    unfused = setup(train={"adam_fused": False})
    step = trainer_phases(unfused, model_params(TINY), 0)[2]
    assert terms(step)["Adam's step temporary"] == TINY_PARAMS * 4
    assert trainer_peak_allocated(unfused) == step.bytes - CUDA_CONTEXT_BYTES == 1_652_992


def test_adam_one_tensor_at_a_time_holds_the_largest_tensors_temporary():
    """train.adam_fused=false, adam_foreach=false: sqrt(v) of one tensor at a time, the largest the rank holds: the gated
    MLP's fc1, 2·f·h = 2·128·64 = 16,384 weights (the fused QKV (a + 2g)·d·h = 8·16·64 = 8,192, the
    embedding 16·64 = 1,024), in fp32; the multi-tensor step's 4 bytes a parameter offer it as a knob."""
    s = setup(train={"adam_fused": False, "adam_foreach": False})
    step = plan_memory(s, GIB).roles[0].phases[2]
    assert step.name == "optimizer step"
    assert terms(step)["Adam's step temporary"] == 16_384 * 4
    wide = replace(TINY, vocab_size=1_000)  # now the embedding, 1,000·64, is the largest
    unfused = {"adam_fused": False, "adam_foreach": False}
    assert terms(plan_memory(setup(model=wide, train=unfused), GIB).roles[0].phases[2])[
        "Adam's step temporary"
    ] == 64_000 * 4  # fmt: skip
    (temporary,) = [
        t for t in plan_memory(setup(train={"adam_fused": False}), GIB).roles[0].phases[2].terms
        if t.name.startswith("Adam")
    ]  # fmt: skip
    assert {"train.adam_fused=true", "train.adam_foreach=false"} <= set(temporary.knobs)


def test_fp32_keeps_no_master_copy_and_unfused_swiglu_keeps_the_gate():
    s = setup(model=replace(TINY, kernels="torch"), train={"precision": "fp32"})
    training = terms(trainer_phases(s, model_params(TINY), 0)[0])
    assert training["optimizer state"] == TINY_PARAMS * 8  # Adam m, v; the fp32 weights are the masters
    # e = 4: attention 4·416 + 16 = 1,680; MLP 4·(2h + 3f + f) = 4·(128 + 384 + 128) = 2,560
    assert training["activations"] == (1_680 + 2_560) * 64 * 2


def test_tensor_parallel_and_the_distributed_optimizer():
    s = setup(
        cluster={"num_trainer_procs": 4, "tensor_parallel_size": 2}, train={"distributed_optimizer": True}
    )
    training = terms(trainer_phases(s, model_params(TINY), 0)[0])
    assert training["policy weights"] == 37_568 * 2
    assert training["gradients"] == 37_568 * 4  # the grad buffer is whole on every rank
    assert training["optimizer state"] == 37_568 * 12 // 2  # sharded over DP = 4 / TP = 2
    # heads and FFN split over TP (no sequence parallelism for a dense model):
    #   attention 2·(128 + 128/2 + 96/2 + 64/2) + 16/2 = 552; MLP 2·(128 + 256/2 + 128/2) = 640
    assert training["activations"] == (552 + 640) * 64 * 2
    assert training["logits, their gradient written over them"] == 64 * 8 * 2  # an 8-way vocabulary shard


def test_pipeline_stages_hold_their_micro_batches_in_flight():
    # PP=2 over 4 ranks: DP 2, 8 samples -> 4 a rank -> 2 micro-batches; 1F1B: the first stage
    # holds min(2, 2) of its one layer, the last one, plus the logits
    s = setup(cluster={"num_trainer_procs": 4, "pipeline_parallel_size": 2})
    p = model_params(TINY)
    first, last = (terms(trainer_phases(s, p, stage)[0]) for stage in (0, 1))
    assert first["activations"] == 2 * 119_808 and "logits, their gradient written over them" not in first
    assert last["activations"] == 119_808 and last["logits, their gradient written over them"] == 2_048
    assert [r.name for r in plan_memory(s, None).roles] == [
        "trainer GPU (first pipeline stage)", "trainer GPU (last pipeline stage)", "engine GPU"
    ]  # fmt: skip


def test_context_parallel_keeps_the_whole_sequences_keys_and_values():
    # CP=2: each rank 32 of the 64 tokens; SDPA keeps the all-gathered k and v (2·g·d·CP a token):
    # attention 2·(128 + 128 + (64 + 2·32·2) + 64) + 16 = 1,040; MLP 1,024
    s = setup(cluster={"num_trainer_procs": 2, "context_parallel_size": 2})
    training = terms(trainer_phases(s, model_params(TINY), 0)[0])
    assert training["activations"] == (1_040 + 1_024) * 32 * 2
    assert training["logits, their gradient written over them"] == 32 * 16 * 2


def test_recompute_and_packing():
    p = model_params(TINY)
    full = terms(trainer_phases(setup(train={"recompute": "full"}), p, 0)[0])
    assert full["activations"] == 64 * 2 * 64 * 2  # each layer's input: 64 tokens × h × bf16, 2 layers
    assert full["activations of the layer being recomputed"] == 119_808
    # packing: one row of the 40-token budget; SDPA keeps a bf16 bias of the row per query token
    # and layer (e·L = 80 bytes), the row has its 40 × 40 boolean mask
    packed = terms(trainer_phases(setup(train={"max_tokens_per_micro_batch": 40}), p, 0)[0])
    assert packed["activations"] == (1_872 + 80) * 40 * 2
    assert packed["packed attention masks"] == 40 * 40
    # selective recompute rebuilds the core attention: no bias, no log-sum-exp (4a = 16) kept
    selective = terms(
        trainer_phases(setup(train={"max_tokens_per_micro_batch": 40, "recompute": "selective"}), p, 0)[0]
    )
    assert selective["activations"] == (1_872 - 16) * 40 * 2


def test_reference_model_and_critic():
    p = model_params(TINY)
    training = terms(trainer_phases(setup(needs_ref=True, needs_critic=True), p, 0)[0])
    assert training["reference model"] == TINY_PARAMS * 2  # bf16 weights only
    critic = TINY_PARAMS + 65
    assert training["critic"] == critic * (2 + 4 + 12)  # weights, fp32 grads, master + m + v


def test_lora_keeps_gradients_and_optimizer_state_for_the_adapters_only():
    """rank 4 on every linear layer: A [4, in] and B [out, 4] (the layers' sizes in the module docstring;
    q/k/v out a·d + 2·g·d = 128, fc1 out 2f = 256):
        linear_qkv 4·64 + 128·4 = 768, linear_proj 4·64 + 64·4 = 512,
        linear_fc1 4·64 + 256·4 = 1,280, linear_fc2 4·128 + 64·4 = 768   -> 3,328 a layer, 6,656 in all
    (the count tests/unit/test_lora.py reads from the built model's gradient buffers)."""
    from rlx.lora.config import LoRAConfig

    lora = {"lora": LoRAConfig(rank=4)}
    training, _, step = trainer_phases(setup(train=lora, needs_ref=True), model_params(TINY), 0)
    assert terms(training) | {"activations": 0} == terms(
        trainer_phases(setup(), model_params(TINY), 0)[0]
    ) | {
        "gradients": 6_656 * 4,
        "optimizer state": 6_656 * 12,
        "activations": 0,
    }  # no reference model: the base is the reference (activations: the adapters' own are not counted)
    assert "Adam's step temporary" not in terms(step)  # the fused Adam's step holds none
    unfused = setup(train=lora | {"adam_fused": False}, needs_ref=True)
    assert terms(trainer_phases(unfused, model_params(TINY), 0)[2])["Adam's step temporary"] == 6_656 * 4
    # TP=2: the split factor halves (column-parallel B, row-parallel A):
    #   qkv 256 + 64·4 = 512, proj 4·32 + 256 = 384, fc1 256 + 128·4 = 768, fc2 4·64 + 256 = 512
    tp2 = setup(train=lora, cluster={"num_trainer_procs": 2, "tensor_parallel_size": 2})
    assert terms(trainer_phases(tp2, model_params(TINY), 0)[0])["gradients"] == 2 * 2_176 * 4
    # only the attention's projections: 768 + 512 a layer
    attention = {"lora": LoRAConfig(rank=4, target_modules=["linear_qkv", "linear_proj"])}
    assert (
        terms(trainer_phases(setup(train=attention), model_params(TINY), 0)[0])["gradients"] == 2 * 1_280 * 4
    )


def test_moe_experts_split_over_expert_parallel_ranks():
    moe = replace(
        TINY, _target_="rlx.models.qwen3_moe.Qwen3Moe", tie_word_embeddings=False, num_moe_experts=8,
        moe_router_topk=2, moe_ffn_hidden_size=32,
    )  # fmt: skip
    p = model_params(moe)
    # Qwen3Moe.num_parameters: attention h·d·(2a + 2g) + 2d = 12,320; experts 8·(h + 3·h·32) = 49,664;
    # norms 128: 62,112 a layer; ×2 + embedding and lm_head 2·1,024 + final norm 64 = 126,336
    assert p.total == 126_336 and p.experts == 2 * 8 * 3 * 64 * 32  # 98,304 routed-expert weights
    # TP=2, EP=2 on 4 ranks: dense (126,336 - 2,048 - 98,304) / 2 = 12,992 a layer, halved by TP,
    # plus the embedding and the lm_head halved; experts 98,304 / (EP 2 × TP 2)
    r = rank_params(p, tp=2, pp=1, ep=2, stage=0)
    assert (r.dense, r.expert) == (12_992 + 1_024, 24_576)
    s = setup(model=moe, cluster={"num_trainer_procs": 4, "tensor_parallel_size": 2, "expert_parallel_size": 2},
              train={"distributed_optimizer": True})  # fmt: skip
    training = terms(trainer_phases(s, p, 0)[0])
    # dense state over DP×CP = 4/2 ranks, experts over 4/(2·2) = 1 rank
    assert training["optimizer state"] == 12 * (14_016 // 2 + 24_576)
    # sequence parallel (MoE under TP): h-sized tensors halved, h_s = 32; bf16
    #   attention 2·(2·32 + 128/2 + 96/2 + 64/2) + 8 = 424
    #   MoE MLP   2·(2·32 + E=8 + k=2·(2h + 4·32/2)) = 2·(72 + 2·192) = 912
    assert training["activations"] == (424 + 912) * 64 * 2
    # the output layer under sequence parallelism keeps GPTModel's batch-first copy of the logits and
    # makes their gradient contiguous: two copies of 64 tokens × an 8-way vocabulary shard × bf16
    assert training["logits and their gradient"] == 2 * 64 * 8 * 2


def test_engine_kv_cache_by_hand():
    s = setup()
    # 2 (k, v) × 2 layers × 2 KV heads × 16 × bf16 (an fp32 tiny checkpoint served in the trainer's bf16)
    assert kv_bytes_per_token(s) == 256
    # blocks of 16 tokens = 4,096 bytes. On a 1 GiB GPU: round(0.88 × 1,073,741,824) = 944,892,805,
    # less the weights (150,272) and a CUDA context (536,870,912) = 407,871,621 = 99,578 blocks and a
    # bit; capped by 256 running requests × 4 blocks (context 64) = 1,024, + 1 reserved block
    budget = round(0.88 * GIB) - TINY_PARAMS * 2 - CUDA_CONTEXT_BYTES
    assert budget == 407_871_621 and budget // 4_096 == 99_578
    assert kv_cache(s, budget) == (1_025 * 4_096, 1_024 * 16)
    # max_total_tokens=100: ceil(100 / 16) = 7 blocks, + 1
    assert kv_cache(setup(rollout={"engine_args": {"max_total_tokens": 100}}), budget) == (8 * 4_096, 7 * 16)
    many = setup(rollout={"engine_args": {"max_running_requests": 10**6}})  # the budget decides
    assert kv_cache(many, budget) == (99_579 * 4_096, 99_578 * 16)
    engine = terms(plan_memory(many, GIB).roles[-1].phases[0])
    assert engine["KV cache"] == 99_579 * 4_096 and engine["engine weights"] == TINY_PARAMS * 2


def test_the_engine_sizes_its_cache_as_the_planner_does():
    from rlx.engine.config import EngineArgs
    from rlx.engine.kv_cache import num_blocks_for_budget

    defaults = EngineArgs(model_path="x")
    assert {k: getattr(defaults, k) for k in ENGINE_DEFAULTS} == ENGINE_DEFAULTS
    s = setup(rollout={"engine_args": {"max_total_tokens": 5_000}})
    for budget in (0, 4_095, 4_096, 10**6, 10**9):
        blocks = num_blocks_for_budget(budget, 4_096, 16, 5_000, 256 * 4)
        assert kv_cache(s, budget) == (blocks * 4_096, (blocks - 1) * 16)


def test_colocated_gpu_holds_what_the_other_side_leaves():
    s = setup(cluster={"gpus_per_node": 1, "colocate": True, "offload_trainer": False})
    role = plan_memory(s, GIB).roles[0]
    assert role.kind == "colocated" and [p.name for p in role.phases] == [
        "training", "forward-only passes", "optimizer step", "weight sync", "generating"
    ]  # fmt: skip
    training, generating = terms(role.phases[0]), terms(role.phases[4])
    assert training["CUDA context"] == CUDA_CONTEXT_BYTES  # dict: the engine's, released, named the same
    kept = {k: v for k, v in generating.items() if k.startswith("trainer's")}
    # offload_trainer=false: weights and optimizer state stay, the gradient buffer is freed
    assert kept == {
        "trainer's policy weights, kept on the GPU": TINY_PARAMS * 2,
        "trainer's optimizer state, kept on the GPU": TINY_PARAMS * 12,
    }
    # while the engine takes the new weights: what the trainer keeps, the sync's bucket, the engine's weights
    assert terms(role.phases[3]) == {
        **kept, "weight sync bucket": 2 * 512 * 2**20, "CUDA context": CUDA_CONTEXT_BYTES,
        "engine weights": TINY_PARAMS * 2,
    }  # fmt: skip


def test_nothing_released_holds_both_sides_whole_in_every_phase():
    """cluster.release_memory=false: no turns, so while the engine generates (and takes the new
    weights) the trainer holds what its largest phase, training, holds: weights, the fp32
    gradient buffer, the optimizer state, a micro-batch's activations and logits (the allocator
    keeps their memory); and while the trainer trains the engine holds its weights, CUDA context,
    graphs, workspace and its KV cache as the run sizes it (256 running requests × 32 tokens, in
    pages of 16, and a reserved page), not the released engine's leftovers."""
    s = setup(
        cluster={"gpus_per_node": 1, "colocate": True, "offload_trainer": False, "release_memory": False}
    )
    plan = plan_memory(s, 4 * GIB)  # room for the KV cache's cap: 256 requests at the full context of 64
    role = plan.roles[0]
    training, syncing, generating = (terms(role.phases[i]) for i in (0, 3, 4))
    kept = {k: v for k, v in generating.items() if k.startswith("trainer's")}
    assert kept == {
        "trainer's policy weights": TINY_PARAMS * 2,
        "trainer's gradients": TINY_PARAMS * 4,
        "trainer's optimizer state": TINY_PARAMS * 12,
        # 2 × 32 tokens: 2 layers' stored activations; the logits of one micro-batch (16-entry vocabulary, bf16)
        "trainer's activations": training["activations"],
        "trainer's logits": 2 * 32 * 16 * 2,
    }
    assert (
        training["activations"] > 0
        and {k: v for k, v in syncing.items() if k.startswith("trainer's")} == kept
    )
    assert generating["engine weights"] == training["engine weights"] == TINY_PARAMS * 2
    # KV: 2 (K, V) × 2 layers × 2 KV heads × 16 dims × 2 bytes = 256 bytes a token
    assert training["KV cache"] == syncing["KV cache"] == (256 * 32 + 16) * 256
    assert "CUDA context (engine, released)" not in training and "CUDA graphs" in training
    assert generating["KV cache"] == (256 * 64 + 16) * 256 and "resident" in plan.headline
    # evaluation's longer responses are held too (8 prompt + 40 tokens), as the run sizes the cache
    longer = replace(s, rollout=replace(s.rollout, eval_max_response_len=40))
    assert terms(plan_memory(longer, 4 * GIB).roles[0].phases[0])["KV cache"] == (256 * 48 + 16) * 256


def test_release_memory_auto_keeps_both_sides_resident_where_a_steps_samples_still_fit():
    """cluster.release_memory=auto (rlx.memory.plan.release_decision), for a trainer whose
    state stays: nothing released exactly while each engine's KV cache, beside the trainer's
    training peak, holds its share of a step's samples at full length; released otherwise, and
    always when the state itself is offloaded or the GPU's size unknown; a colocated debug run of
    one side has no hand-over, and says so rather than "not colocated"."""
    from rlx.memory.engine import kv_tokens
    from rlx.memory.plan import offload_decision, release_decision
    from rlx.memory.trainer import resident_while_generating

    kept = {"gpus_per_node": 1, "colocate": True, "offload_trainer": False}
    s = setup(cluster=kept, rollout={"engine_args": {"max_running_requests": 256}, "weight_bucket_mb": 1})
    whole = replace(s, cluster=replace(s.cluster, release_memory=False))
    # a GPU on which neither cache reaches its cap (every running request at the full context)
    p, gpu = model_params(TINY), 1167 * 2**20
    tokens = kv_tokens(whole, p, resident_while_generating(whole, p, 0), gpu)
    state_only = kv_tokens(s, p, resident_while_generating(s, p, 0), gpu)
    # the peak holds the gradients, activations and logits more than the state: that many bytes fewer
    # for the cache, to a page (16 tokens) of the engine's rounding
    more = TINY_PARAMS * 4 + terms(trainer_phases(s, p, 0)[0])["activations"] + 2 * 32 * 16 * 2
    assert 0 < tokens < state_only < 16_384
    assert abs((state_only - tokens) * kv_bytes_per_token(s) - more) < 16 * kv_bytes_per_token(s)
    fits, over = tokens // 32, tokens // 32 + 1
    for samples, release in ((fits, False), (over, True)):
        step = replace(s, rollout=replace(s.rollout, batch_size=samples, n_samples_per_prompt=1))
        decided, why = release_decision(step, gpu)
        assert decided is release, why
        assert why.startswith(
            "released: beside the trainer's training peak each engine's KV cache would hold"
            if release
            else "nothing released: trainer and engines stay resident"
        )
    offloaded = replace(s, cluster=replace(s.cluster, offload_trainer=True))
    assert release_decision(offloaded, gpu) == (
        True,
        "released: the trainer's state is offloaded while the engines generate",
    )
    assert release_decision(s, None)[0] is True
    assert release_decision(setup(), gpu) == (True, "not colocated")
    for half, alone in (
        (dict(with_trainer=False), "the engines run"),
        (dict(with_engines=False), "the trainer runs"),
    ):
        why = f"no hand-over: {alone} alone (debug.rollout_only / debug.train_only)"  # colocated halves
        assert (
            release_decision(replace(s, **half), gpu)
            == offload_decision(replace(s, **half), gpu)
            == (True, why)
        )
    assert (
        release_decision(s, 2 * 2**20)[1] == "released: trainer and engines would not fit resident together"
    )


def test_a_colocated_weight_sync_holds_the_trainers_weights_beside_the_engines():
    """rlx.colocation: the trainer's gradients and optimizer state leave before the engine's weights
    come back; its weights (read by the sync) and the reference's stay until the sync is done."""
    s = setup(
        cluster={"gpus_per_node": 1, "colocate": True}, rollout={"weight_bucket_mb": 64}, needs_ref=True
    )
    role = plan_memory(s, GIB).roles[0]
    sync = {t.name: t.bytes for t in role.phases[3].terms}
    expected = {
        "trainer's policy weights (bf16), read by the sync": TINY_PARAMS * 2,
        # rlx's engines read a bucket flat: the gathered tensors and their flat copy
        "weight sync bucket (gathered tensors, and their flat copy)": 2 * 64 * 2**20,
        "CUDA context (trainer)": CUDA_CONTEXT_BYTES,
        "engine weights (bfloat16, 75,136 parameters)": TINY_PARAMS * 2,
        "CUDA context (engine)": CUDA_CONTEXT_BYTES,
        "trainer's reference model (bf16 weights)": TINY_PARAMS * 2,  # the KL term's
    }
    assert role.phases[3].name == "weight sync" and sync == expected
    # SGLang's engines take a handle a tensor: the gathered tensors alone
    sglang = replace(s, rollout=replace(s.rollout, _target_="rlx.rollout.launchers.SGLangLauncher"))
    sync = {t.name: t.bytes for t in plan_memory(sglang, GIB).roles[0].phases[3].terms}
    assert sync["weight sync bucket (gathered tensors)"] == 64 * 2**20


def over_setup(micro_batch: int) -> Setup:
    """A 1.7B-wide shape whose activations at long samples outgrow an 80 GiB GPU."""
    wide = replace(TINY, num_layers=28, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=16,
                   num_query_groups=8, kv_channels=128, vocab_size=151936, max_position_embeddings=40960)  # fmt: skip
    return replace(setup(model=wide, train={"micro_batch_size": micro_batch, "global_batch_size": 64}),
                   prompt_len=1024, rollout=RolloutConfig(max_response_len=7168))  # fmt: skip


def test_a_run_over_the_gpu_is_refused_naming_the_knob_that_fits():
    s, gpu = over_setup(8), round(79.6 * GIB)
    plan = plan_memory(s, gpu, "cluster.gpu_memory_gib=79.6")
    (message,) = memory_errors(s, plan)
    trainer = plan.roles[0]
    assert trainer.peak.bytes > gpu
    assert message.startswith(
        f"memory plan: the trainer GPU needs {trainer.peak.bytes / GIB:.1f} GiB at its peak (training)"
    )
    assert "more than the 79.6 GiB of a GPU (cluster.gpu_memory_gib=79.6)" in message
    assert "largest terms (GiB): activations" in message
    # the micro-batch it names fits with 10% to spare (what the plan does not flag), the next larger does not
    fits = {m: plan_memory(over_setup(m), gpu).roles[0].peak.bytes <= 0.9 * gpu for m in (1, 2, 4, 8)}
    largest = max(m for m, ok in fits.items() if ok)
    assert largest < 8 and not fits[2 * largest]
    after = plan_memory(over_setup(largest), gpu).roles[0].peak.bytes
    assert f"set train.micro_batch_size={largest} (the plan then predicts {after / GIB:.1f} GiB)" in message
    assert "train.recompute=full" in message and "run.plan_only=true" in message


def test_an_engine_cache_too_small_for_one_sample_is_refused_naming_the_fraction():
    s = replace(
        over_setup(1), rollout=RolloutConfig(max_response_len=7168, engine_args={"mem_fraction_static": 0.05})
    )
    gpu = round(79.6 * GIB)
    errors = memory_errors(s, plan_memory(s, gpu, "cluster.gpu_memory_gib=79.6"))
    (kv,) = [e for e in errors if "KV cache" in e]
    # 8,192 tokens × (2 · 28 layers · 8 heads · 128 · bf16 = 114,688 bytes) do not fit in
    # 0.05 × 79.6 GiB less the weights (1.72B × 2 bytes) and the engine's CUDA context
    weights = model_params(s.model).total * 2
    loaded = weights + CUDA_CONTEXT_BYTES
    tokens = (round(0.05 * gpu) - loaded) // (114_688 * 16) * 16
    assert f"holds {tokens:,} tokens, fewer than one sample of 8,192" in kv
    need = (loaded + (8_192 + 32) * 114_688) / gpu  # one sample and two blocks' slack
    assert f"rollout.engine_args.mem_fraction_static={-(-round(need * 1e6) // 10_000) / 100}" in kv


def test_unknown_gpu_memory_refuses_nothing_and_says_so():
    s = over_setup(8)
    plan = plan_memory(s, None)
    assert memory_errors(s, plan) == []
    text = report(plan)
    assert "GPU memory: unknown" in text and "cluster.gpu_memory_gib" in text


def test_the_report_names_every_term_and_the_margin():
    text = report(plan_memory(setup(), round(1.5 * GIB), "cluster.gpu_memory_gib=1.5"))
    lines = text.splitlines()
    assert lines[0] == (
        "memory plan: tiny_qwen3 (75,136 parameters), bf16, TP=1 PP=1 CP=1 EP=1 DP=1, split: 1 trainer GPU + 1 engine GPU"
    )
    assert lines[1] == "GPU memory: 1.5 GiB (cluster.gpu_memory_gib=1.5)"
    for name in ("policy weights", "gradients (fp32 grad buffer)", "optimizer state", "activations",
                 "logits, their gradient written over them", "engine weights", "KV cache", "CUDA graphs", "workspace"):  # fmt: skip
        assert f"    {name}" in text, name
    # the trainer's peak is training: 1,594,112 bytes + its CUDA context = 538,465,024, which leaves
    # 1,610,612,736 - 538,465,024 = 1,072,147,712 bytes (1.0 GiB, 67%) of a 1.5 GiB GPU
    assert "  peak 0.5 GiB (training): 1.0 GiB (67%) to spare" in lines


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """An `nvidia-smi` on PATH printing two GPUs (index, MiB)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, 81559'\necho '1, 40960'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    visible_gpu_bytes.cache_clear()
    yield
    visible_gpu_bytes.cache_clear()


def test_gpu_memory_is_read_from_nvidia_smi(fake_smi, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpu_bytes() == 40960 * 2**20  # the smallest GPU
    visible_gpu_bytes.cache_clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert visible_gpu_bytes() == 81559 * 2**20  # the visible one: 79.6 GiB


def _bench(name: str = "grpo_step"):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


_grpo_bench = _bench


@pytest.mark.parametrize(("gpu_gib", "expected"), [(79.6, 2), (139.8, 4)])
def test_the_training_bench_chooses_the_largest_micro_batch_the_plan_fits(gpu_gib, expected):
    """bench/train_mfu.py without --micro-batch: the Qwen3-1.7B shape at seq 4096, 32 rows a step.
    Its default 4 x 8 ran out of memory on an H100 (80 GB) and measured 75.4 GiB on an H200, 52.2 GiB
    at 2 x 16 on an H100 (docs/benchmarks.md): the plan, with the bench's own logits, gives 2 on an
    H100 and 4 on an H200; the next larger one would leave less than 10% free."""
    bench = _bench("train_mfu")
    cfg = bench.model_config([])
    gpu = round(gpu_gib * GIB)
    assert bench.choose_micro_batch(cfg, 4096, gpu) == expected
    need = {m: bench.bench_peak_bytes(cfg, m, 32 // m, 4096) for m in (1, 2, 4, 8)}
    assert need[expected] <= 0.9 * gpu < need[2 * expected]
    # the cross entropy's logits: a bf16 gradient beside them and both in fp32, 2 + 2 x 2 bytes a token
    # and word over the plan's (which writes the RL loss's gradient over its bf16 logits)
    assert need[2] - round(bench.predicted_peak_gib(cfg, 2, 16, 4096) * GIB) == 6 * 2 * 4096 * 151_936


def test_the_grpo_bench_prints_the_plans_prediction_of_its_measured_peak():
    from rlx.config.compose import compose, to_object
    from rlx.config.memory_check import memory_setup

    bench = _grpo_bench()
    args = bench.build_parser().parse_args(["--shape", "0.6b", "--split", "--micro-batch", "8"])
    cfg = compose(bench.overrides_for(args))
    setup = replace(memory_setup(to_object(cfg)), prompt_len=6)
    assert bench.predicted_peak_gib(cfg, 6.2) == trainer_peak_allocated(setup) / GIB
    # bf16 Qwen3-0.6B, micro-batch 8 of 6 + 512 tokens: between its weights alone and an 80 GiB GPU
    assert 0.6e9 * 16 / GIB < bench.predicted_peak_gib(cfg, 6.2) < 79.6


H100_GIB = "cluster.gpu_memory_gib=79.6"


def test_the_plan_names_the_largest_micro_batch_that_fits_as_well():
    """`roomier_micro_batch`: the 1.7B shape colocated at micro-batch 8 on an 80 GB GPU, the trainer's
    state kept by `auto`: 32 fits as well (its peak is the plan's own at 32; measured 67.2 GiB at its
    peak, docs/benchmarks.md), 64 would not (109.2 GiB to train); at 32 nothing larger fits; packing
    has no micro-batch size to raise."""
    from rlx.config.compose import compose, to_object
    from rlx.config.memory_check import memory_setup, roomier_micro_batch

    bench = _grpo_bench()

    def config(*extra: str):
        args = bench.build_parser().parse_args(["--shape", "1.7b", "--micro-batch", extra[0]])
        return to_object(compose([*bench.overrides_for(args), H100_GIB, *extra[1:]]))

    size, peak, released = roomier_micro_batch(config("8"))
    assert size == 32 and peak == trainer_peak_allocated(memory_setup(config("32"))) / GIB
    assert roomier_micro_batch(config("16"))[0] == 32
    # at 8 and 16 trainer and engines stay resident (release_memory=auto); at 32 they would not fit
    # together (a 68.5 GiB training peak beside the engine's 3.2 GiB of weights and its step's KV):
    # the note says so, which `release_decision` itself decides at each size
    from rlx.memory.plan import release_decision

    assert [release_decision(memory_setup(config(m)), round(79.6 * GIB))[0] for m in ("8", "16", "32")] == [
        False,
        False,
        True,
    ]
    assert released is True
    assert roomier_micro_batch(config("8", "cluster.release_memory=true"))[2] is False
    assert roomier_micro_batch(config("32")) is None
    assert roomier_micro_batch(config("8", "train.max_tokens_per_micro_batch=8192")) is None


def test_the_grpo_bench_picks_the_largest_micro_batch_the_plan_keeps_on_the_gpu(monkeypatch):
    """1.7B colocated on an 80 GB H100: 32 keeps the trainer's state beside the engine (measured:
    67.2 GiB at its peak, docs/benchmarks.md), the bench's cap; split, the trainer's GPU alone, 32 as
    well; where the plan sees no GPU, the old fixed 8."""
    bench = _grpo_bench()
    args = bench.build_parser().parse_args(["--shape", "1.7b"])
    assert bench.choose_micro_batch(args, [H100_GIB])[0] == 32 == bench.MAX_MICRO_BATCH
    split = bench.build_parser().parse_args(["--shape", "1.7b", "--split"])
    assert bench.choose_micro_batch(split, [H100_GIB])[0] == 32
    monkeypatch.setattr("rlx.config.memory_check.visible_gpu_bytes", lambda: None)  # no nvidia-smi
    assert bench.choose_micro_batch(args, [])[0] == bench.FALLBACK_MICRO_BATCH == 8


@pytest.mark.parametrize(
    ("argv", "layout"),
    [
        (["--option", "glm4_9b", "--gpus", "4", "--tp", "2", "--response-len", "1024", "--micro-batch", "2"],
         {"gpus_per_node": 4, "num_trainer_procs": 4, "num_rollout_gpus": 4, "colocate": True, "tensor_parallel_size": 2}),
        (["--option", "qwen3_30b_a3b", "--layers", "18", "--gpus", "4", "--ep", "4", "--micro-batch", "2"],
         {"gpus_per_node": 4, "num_trainer_procs": 4, "colocate": True, "expert_parallel_size": 4}),
    ],
)  # fmt: skip
def test_issue_28s_bench_runs_compose_and_fit_an_h100_by_the_plan(argv, layout):
    """The 4-GPU runs bench/grpo_step.py documents compose on rlx's rules (the plan's refusal
    included, at 79.6 GiB) into the layout they name: a GPU session can run them as written."""
    from rlx.config.compose import compose, to_object

    bench = _grpo_bench()
    rc = to_object(compose([*bench.overrides_for(bench.build_parser().parse_args(argv)), H100_GIB]))
    assert {k: getattr(rc.cluster, k) for k in layout} == layout
    assert rc.train.distributed_optimizer and rc.rollout.num_engines == 4


def test_the_30b_a3b_slice_that_ran_out_of_memory_is_refused_by_the_margin():
    """Qwen3-30B-A3B cut to 20 layers, EP=4, with torch's multi-tensor Adam (`train.adam_fused=false`,
    the only Adam then): the plan's optimizer step is 72.4 GiB of 79.6 (the engine's decode graphs,
    kept while released, among it), 9% free; on 4×H100 it ran out of memory there (72.2 planned
    then) with 3.7 GiB fragmented (docs/benchmarks.md). Refused at compose under the
    default cluster.memory_margin=0.1, naming the margin and how to go on anyway. The fused Adam
    (the default) holds no temporary: the peak is then training's, 71.1 GiB, which starts."""
    from rlx.config.compose import compose
    from rlx.errors import ConfigError

    bench = _grpo_bench()
    argv = ["--option", "qwen3_30b_a3b", "--layers", "20", "--gpus", "4", "--ep", "4", "--micro-batch", "2"]
    overrides = [*bench.overrides_for(bench.build_parser().parse_args(argv)), H100_GIB]
    compose(overrides)  # the fused Adam
    overrides.append("train.adam_fused=false")
    with pytest.raises(ConfigError) as refused:
        compose(overrides)
    message = str(refused.value)
    assert (
        "trainer needs 72.4 GiB at its peak (optimizer step), leaving 7.2 GiB (9%) of the 79.6 GiB" in message
    )
    assert (
        "less than cluster.memory_margin=0.1" in message
        and "cluster.memory_margin=0.09 to start it anyway" in message
    )
    assert "largest terms (GiB): optimizer state 36.6" in message
    # the fused Adam, or Adam one tensor at a time (its 12.2 GiB temporary shrinks to the vocabulary
    # shard's 1.2): the peak is then training's
    assert (
        "set train.adam_fused=true (the plan then predicts 70.9 GiB) or "
        "train.adam_foreach=false (the plan then predicts 70.9 GiB)" in message
    )
    compose([*overrides, "cluster.memory_margin=0.09"])  # what the message offers starts


def test_a_9b_trainer_on_two_h100s_is_refused_by_the_plan():
    """GLM-4-9B's trainer on 2 GPUs (split 2+2, TP=2, so DP=1: the optimizer state unsharded) needs
    more than an H100: 9.40B / 2 parameters x (2 weights + 4 grads + 12 master and moments) is
    78.8 GiB before the activations (88.0 GiB at training's peak); refused at compose, naming the GPU
    and the knobs."""
    from rlx.config.compose import compose
    from rlx.errors import ConfigError

    bench = _grpo_bench()
    argv = [
        "--option",
        "glm4_9b",
        "--split",
        "2+2",
        "--tp",
        "2",
        "--response-len",
        "1024",
        "--micro-batch",
        "2",
    ]
    with pytest.raises(ConfigError, match=r"the trainer GPU needs 88\.0 GiB .* more than the 79.6 GiB"):
        compose([*bench.overrides_for(bench.build_parser().parse_args(argv)), H100_GIB])


def test_a_plan_that_fits_with_little_to_spare_says_so():
    alone = setup(with_engines=False)  # a trainer alone (debug.train_only)
    peak = plan_memory(alone, None).roles[0].peak.bytes
    roomy, tight = (plan_memory(alone, round(peak / share)) for share in (0.85, 0.95))
    assert not [n for n in roomy.notes if "too little" in n]
    (note,) = [n for n in tight.notes if "too little" in n]
    assert note.startswith("trainer GPU: the trainer's peak leaves 5% of the GPU: too little for an estimate")
    assert memory_errors(alone, roomy) == []
    # under the default cluster.memory_margin (0.1) 5% free is refused; with a margin of 0.04, a warning
    (refusal,) = memory_errors(alone, tight)
    assert (
        "leaving" in refusal and "(5%)" in refusal and "less than cluster.memory_margin=0.1 of it" in refusal
    )
    lowered = replace(alone, cluster=replace(alone.cluster, memory_margin=0.04))
    assert memory_errors(lowered, plan_memory(lowered, tight.gpu_bytes)) == []


def test_the_advice_offers_offloading_and_tensor_parallelism_only_where_they_apply():
    # a colocated GPU whose trainer state, kept beside the engine, leaves its KV cache nothing
    s = replace(over_setup(1), cluster=ClusterConfig(gpus_per_node=2, num_trainer_procs=2, num_rollout_gpus=2,
                                                     colocate=True, offload_trainer=False))  # fmt: skip
    errors = memory_errors(s, plan_memory(s, round(30 * GIB), "cluster.gpu_memory_gib=30"))
    assert any("cluster.offload_trainer=true" in e for e in errors), errors
    from rlx.memory.plan import tensor_parallel_fits

    # TP=2 over 2 ranks on nodes of 2: 16 heads, 8 groups, 151,936 entries divide; TP=4 leaves the node
    assert tensor_parallel_fits(s, 2) and not tensor_parallel_fits(s, 4)
    assert not tensor_parallel_fits(replace(s, model=replace(s.model, num_query_groups=1)), 2)


def test_offload_trainer_auto_keeps_the_state_where_a_steps_samples_fit_the_kv_cache_beside_it():
    """cluster.offload_trainer=auto (rlx.memory.plan.offload_decision): kept on the GPU exactly while
    each engine's KV cache, beside the kept state, holds its share of a step's samples at full length."""
    from rlx.memory.engine import kv_tokens
    from rlx.memory.plan import offload_decision
    from rlx.memory.trainer import resident_while_generating

    colocated = {"gpus_per_node": 1, "colocate": True, "offload_trainer": True}
    # the running cap pinned: unset, it grows with the batch (`engine_args_for_batch`), and the cache
    # with it (at most every running request at full context)
    s = setup(cluster=colocated, rollout={"engine_args": {"max_running_requests": 256}})
    kept = replace(s, cluster=replace(s.cluster, offload_trainer=False))
    p = model_params(TINY)
    gpu = 4 * GIB  # two CUDA contexts (1 GiB) and room for a KV cache
    tokens = kv_tokens(kept, p, resident_while_generating(kept, p, 0), gpu)
    assert tokens > 0 and s.sample_len == 32
    fits, over = tokens // 32, tokens // 32 + 1  # samples a step: the last that fits, the first that does not
    for samples, offload in ((fits, False), (over, True)):
        step = replace(s, rollout=replace(s.rollout, batch_size=samples, n_samples_per_prompt=1))
        decided, why = offload_decision(step, gpu)
        assert decided is offload, why
        assert why.startswith(
            "offloaded: kept on the GPU, it would leave" if offload else "kept on the GPU: beside it"
        )
    # two engines share a step's samples
    two = replace(s, rollout=replace(s.rollout, batch_size=over, n_samples_per_prompt=1, num_engines=2))
    assert offload_decision(two, gpu)[0] is False
    assert offload_decision(s, None) == (
        True,
        "offloaded: the GPU's memory is unknown here (cluster.gpu_memory_gib sets it)",
    )
    assert offload_decision(setup(), gpu)[0] is True  # split placement: nothing to keep beside the engine
    # a GPU too small for the kept state beside the engine
    assert offload_decision(s, 2 * 2**20)[1].startswith("offloaded: kept on the GPU, it would not fit")


def test_offload_trainer_auto_is_decided_before_the_run_and_refused_when_misspelt():
    from rlx.config.compose import compose, to_object
    from rlx.config.memory_check import resolve_offload
    from rlx.errors import ConfigError

    rc = to_object(compose([]))  # the CPU default job, split: auto by default, nothing to decide or log
    assert rc.cluster.offload_trainer == "auto"
    assert resolve_offload(rc) is None and rc.cluster.offload_trainer is True
    rc = to_object(compose([]))
    # colocated without a plan (a user's model class; composing refuses colocation on a CPU)
    rc.cluster.colocate = True
    assert (
        resolve_offload(rc) == "offloaded: no memory plan for this run" and rc.cluster.offload_trainer is True
    )
    gpu = ["cluster=1gpu", "train.precision=bf16", "cluster.gpu_memory_gib=79.6"]  # auto by default
    rc = to_object(compose(gpu))
    assert resolve_offload(rc).startswith("kept on the GPU") and rc.cluster.offload_trainer is False
    assert resolve_offload(rc) is None  # decided: no longer auto
    with pytest.raises(ConfigError, match="cluster.offload_trainer.*true, false or auto"):
        compose(["cluster.offload_trainer=sometimes"])


def test_release_memory_auto_is_decided_after_the_offload_and_refused_beside_an_offloaded_state():
    from rlx.config.compose import compose, to_object
    from rlx.config.memory_check import resolve_offload, resolve_release
    from rlx.errors import ConfigError

    rc = to_object(compose([]))  # the CPU default job, split: nothing to decide or log
    assert resolve_release(rc) is None and rc.cluster.release_memory is True
    gpu = ["cluster=1gpu", "train.precision=bf16", "cluster.gpu_memory_gib=79.6"]
    rc = to_object(compose(gpu))
    resolve_offload(rc)
    assert resolve_release(rc).startswith("nothing released: trainer and engines stay resident")
    assert rc.cluster.release_memory is False and resolve_release(rc) is None  # decided
    rc = to_object(compose([*gpu, "cluster.offload_trainer=true"]))
    assert resolve_release(rc).startswith("released: the trainer's state is offloaded")
    assert rc.cluster.release_memory is True
    with pytest.raises(
        ConfigError,
        match=r"release_memory=false keeps the trainer and the engines resident .* cluster.offload_trainer=true moves",
    ):
        compose([*gpu, "cluster.offload_trainer=true", "cluster.release_memory=false"])
    rc = to_object(compose([*gpu, "cluster.release_memory=false"]))
    rc.cluster.offload_trainer = True  # what auto decides where the plan cannot keep the state
    with pytest.raises(
        ConfigError, match="cluster.offload_trainer=auto moves the trainer's state to the CPU"
    ):
        resolve_release(rc)
    with pytest.raises(ConfigError, match="cluster.release_memory.*true, false or auto"):
        compose(["cluster.release_memory=never"])


def test_a_trainer_kept_on_the_gpu_caps_each_engines_kv_cache_at_its_share_beside_it():
    """The engines size their KV caches when they start, before the trainer's first step allocates
    its optimizer state: with cluster.offload_trainer=false (or auto deciding so) each engine's
    cache is capped (engine_args.max_total_tokens) at what is left beside the trainer's whole state."""
    from rlx.config.compose import compose, to_object
    from rlx.config.memory_check import cap_engine_cache

    # a 2 GiB GPU, the sync's buckets (twice 256 MiB: rlx's flat form) within it
    gpu = ["cluster=1gpu", "train.precision=bf16", "cluster.gpu_memory_gib=2", "rollout.weight_bucket_mb=256"]
    many = ["+rollout.engine_args.max_running_requests=1000000"]  # the budget decides, not the requests
    rc = to_object(compose([*gpu, *many, "cluster.offload_trainer=false"]))
    why = cap_engine_cache(rc)
    # on 2 GiB: round(0.88 × 2 GiB) = 1,889,785,610, less the trainer's bf16 weights (2 N) and its
    # fp32 master + Adam m, v (12 N), the engine's bf16 weights (2 N), two CUDA contexts (1 GiB):
    # 814,841,610 bytes = 198,935 blocks of 16 tokens × 256 bytes (and a bit)
    budget = round(0.88 * 2 * GIB) - 16 * TINY_PARAMS - 2 * CUDA_CONTEXT_BYTES
    assert budget == 814_841_610 and budget // 4_096 == 198_935
    assert rc.rollout.engine_args["max_total_tokens"] == 198_935 * 16
    assert why.endswith("(rollout.engine_args.max_total_tokens=3182960)"), why
    assert cap_engine_cache(rc) is None  # set: a user's (or an earlier) cap is kept
    split = ["cluster.offload_trainer=false", "cluster.colocate=false", "cluster.gpus_per_node=2"]
    for offloaded in (["cluster.offload_trainer=true"], split):
        rc = to_object(compose([*gpu, *many, *offloaded]))  # offloaded, or split from its engines
        assert cap_engine_cache(rc) is None and "max_total_tokens" not in rc.rollout.engine_args


def test_runs_sharing_a_gpu_are_each_planned_on_their_share():
    """bench/recipe_seeds.py --per-gpu 2 on an 80 GB GPU: each run's engine takes its fraction and
    its plan counts 39.8 GiB (composed: the plan sees that much), unless the run's overrides name the
    size; one run a GPU is told nothing."""
    from rlx.config.compose import compose, to_object
    from rlx.config.memory_check import gpu_memory

    seeds = _bench("recipe_seeds")
    shared = seeds.shared_overrides(2, 0.4, 79.6, [])
    assert shared == ["+rollout.engine_args.mem_fraction_static=0.4", "cluster.gpu_memory_gib=39.8"]
    rc = to_object(compose(["+experiment=reverse8_1gpu", *shared]))
    assert gpu_memory(rc)[0] == round(39.8 * GIB)
    assert seeds.shared_overrides(2, 0.4, 79.6, ["cluster.gpu_memory_gib=30"]) == shared[:1]
    assert seeds.shared_overrides(1, 0.4, 79.6, []) == []


def test_a_colocated_engines_kv_cache_holds_its_running_requests_at_full_length_and_no_more():
    """Sized by free memory, a colocated engine's KV cache (SmolLM2-135M's: 120 GiB) was unmapped
    and mapped again whole at every hand-over. It holds every running request at the longest
    prompt plus the longest response, in whole pages: 64 prompts × 8 samples on one engine run 512
    at once (LocalLauncher's running cap), a prompt of at most 37 tokens and 96 of response take
    ceil(133 / 16) = 9 pages, so 512 × 144 = 73,728 tokens."""
    from rlx.config.compose import compose, to_object
    from rlx.config.memory_check import size_engine_cache

    gpu = ["cluster=1gpu", "train.precision=bf16", "rollout.batch_size=64", "rollout.n_samples_per_prompt=8",
           "rollout.max_response_len=96", "train.global_batch_size=512", "model.max_position_embeddings=512"]  # fmt: skip
    rc = to_object(compose(gpu))
    line = size_engine_cache(rc, longest_prompt=37, user_cap=False)
    assert rc.rollout.engine_args["max_total_tokens"] == 73_728
    assert line.startswith("each engine's KV cache holds its 512 running requests at full length"), line
    assert line.endswith("(rollout.engine_args.max_total_tokens=73728); a hand-over moves no more"), line
    # evaluations answer at rollout.eval_max_response_len: 37 + 200 -> 15 pages
    rc = to_object(compose([*gpu, "rollout.eval_max_response_len=200"]))
    size_engine_cache(rc, 37, False)
    assert rc.rollout.engine_args["max_total_tokens"] == 512 * 240
    # a smaller cap already there (cap_engine_cache's, beside a kept trainer) stays
    rc = to_object(compose([*gpu, "+rollout.engine_args.max_total_tokens=50000"]))
    assert size_engine_cache(rc, 37, user_cap=False) is None
    assert rc.rollout.engine_args["max_total_tokens"] == 50_000
    # a larger one is the user's: kept (user_cap), else lowered to what the requests use
    for user_cap, expected in ((True, 10**7), (False, 73_728)):
        rc = to_object(compose([*gpu, f"+rollout.engine_args.max_total_tokens={10**7}"]))
        size_engine_cache(rc, 37, user_cap)
        assert rc.rollout.engine_args["max_total_tokens"] == expected
    # split engines, CPU engines, and SGLang sizing its own running cap are left as they are
    split = ["cluster.colocate=false", "cluster.gpus_per_node=2"]
    for overrides in (
        [*gpu, *split],
        ["rollout.max_response_len=8"],
        [*gpu, "rollout=sglang", "rollout.server_module=rlx.engine.serve"],
    ):
        rc = to_object(compose(overrides))
        assert size_engine_cache(rc, 37, False) is None and "max_total_tokens" not in rc.rollout.engine_args
