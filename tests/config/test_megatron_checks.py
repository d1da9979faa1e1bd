"""No traceback from Megatron for a user's config (rlx.trainer.megatron_check, rlx.models.config.
shape_errors): every model family against edge values of its keys (heads and groups, RoPE
dimensions, MoE routing, MLA ranks; heads, groups and layers against TP, PP and virtual stages;
experts against EP). Each refusal is one clean message naming rlx's keys and the fix, raised when
composing; each acceptance starts cleanly: the trainer's Megatron model builds from it in a
one-rank world and takes a forward and backward pass (layouts over several ranks: Megatron's own
TransformerConfig accepts them; they train in tests/integration)."""

from __future__ import annotations

import pytest
import torch

from rlx.config import build
from rlx.config.compose import compose, to_object
from rlx.errors import ConfigError

TWO = ["cluster.num_trainer_procs=2"]
REFUSED = {
    "heads not a multiple of groups": (
        ["model=tiny_qwen3", "model.num_attention_heads=3"],
        ["model.num_attention_heads=3 is not a multiple of model.num_query_groups=2", "set model.num_query_groups"],
    ),
    "more groups than heads": (["model=tiny_llama3", "model.num_query_groups=8"], ["model.num_query_groups=8"]),
    "odd RoPE dimensions": (["model=tiny_llama3", "model.kv_channels=15"], ["15 rotary dimensions", "must be even"]),
    "odd partial RoPE": (["model=tiny_glm4", "model.kv_channels=18"], ["= 9 rotary dimensions"]),
    "odd MLA RoPE head": (["model=tiny_deepseek_v3", "model.qk_pos_emb_head_dim=3"], ["model.qk_pos_emb_head_dim = 3"]),
    "top-k over the experts": (
        ["model=tiny_qwen3_moe", "model.moe_router_topk=9"],
        ["model.moe_router_topk=9 is more than model.num_moe_experts=8", "model.moe_router_topk <= 8"],
    ),
    "no MoE layer left": (["model=tiny_qwen3_moe", "model.moe_first_dense_layers=2"], ["leaves no MoE layer"]),
    "expert groups that do not divide the experts": (
        ["model=tiny_deepseek_v3", "model.moe_router_num_groups=3"],
        ["Megatron refuses this model and layout", "model.num_moe_experts=16", "model.moe_router_num_groups=3",
         "should be divisible by"],
    ),
    "a Megatron setting Megatron refuses": (
        ["+model.megatron_overrides.recompute_granularity=full"],
        ["Megatron refuses this model and layout (model.megatron_overrides.recompute_granularity=full)",
         "recompute_method must be", "+model.megatron_overrides.NAME=..."],
    ),
    "heads against TP": (
        ["model=tiny_qwen3", *TWO, "cluster.tensor_parallel_size=2", "model.num_attention_heads=3",
         "model.num_query_groups=3", "model.kv_channels=16"],
        ["model.num_attention_heads=3", "cluster.tensor_parallel_size=2"],
    ),
    "layers against PP": (
        ["model=tiny_llama3", *TWO, "cluster.pipeline_parallel_size=2", "model.num_layers=3"],
        ["model.num_layers=3", "cluster.pipeline_parallel_size=2"],
    ),
    "layers against virtual stages": (
        ["model=tiny_qwen3", *TWO, "cluster.pipeline_parallel_size=2",
         "+model.megatron_overrides.virtual_pipeline_model_parallel_size=2"],
        ["virtual_pipeline_model_parallel_size=2", "model.num_layers=2"],
    ),
    "experts against EP": (
        ["model=tiny_qwen3_moe", *TWO, "cluster.expert_parallel_size=2", "model.num_moe_experts=5"],
        ["model.num_moe_experts=5", "cluster.expert_parallel_size=2"],
    ),
}  # fmt: skip
FAMILIES = ["tiny_qwen3", "tiny_llama3", "tiny_glm4", "tiny_qwen3_moe", "tiny_deepseek_v3"]
ACCEPTED = {
    **{f"{family} as shipped": [f"model={family}"] for family in FAMILIES},
    "multi-query": ["model=tiny_glm4", "model.num_query_groups=1"],
    "one group per head": ["model=tiny_qwen3", "model.num_query_groups=4"],
    "head dim apart from the width": ["model=tiny_llama3", "model.kv_channels=8"],
    "top-k of every expert": ["model=tiny_qwen3_moe", "model.moe_router_topk=8"],
    "no dense layer first": ["model=tiny_deepseek_v3", "model.moe_first_dense_layers=0"],
    "MLA without a query latent": ["model=tiny_deepseek_v3", "model.q_lora_rank=null"],
    "MLA of rank 1": ["model=tiny_deepseek_v3", "model.kv_lora_rank=1"],
}
LAYOUTS = {  # accepted over two ranks: Megatron's TransformerConfig takes them
    "TP=2 dense": ["model=tiny_llama3", *TWO, "cluster.tensor_parallel_size=2"],
    "PP=2 with 2 virtual stages": ["model=tiny_qwen3", *TWO, "cluster.pipeline_parallel_size=2", "model.num_layers=4",
                                   "+model.megatron_overrides.virtual_pipeline_model_parallel_size=2"],
    "EP=2 MoE": ["model=tiny_qwen3_moe", *TWO, "cluster.expert_parallel_size=2"],
    "TP=2 MLA": ["model=tiny_deepseek_v3", *TWO, "cluster.tensor_parallel_size=2"],
}  # fmt: skip


@pytest.mark.parametrize("overrides, fragments", REFUSED.values(), ids=REFUSED.keys())
def test_a_config_megatron_cannot_build_is_refused_when_composing(overrides, fragments):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    message = str(e.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "Traceback" not in message


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    from helpers import megatron_world

    with megatron_world():
        yield


@pytest.mark.parametrize("overrides", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_an_accepted_model_builds_and_trains_a_step(one_rank, overrides, monkeypatch, tmp_path):
    monkeypatch.setenv("RLX_CACHE", str(tmp_path))
    rc = to_object(compose(overrides))
    model = build(rc.model).build_model()
    ids = torch.randint(2, rc.model.vocab_size, (2, 6))
    positions = torch.arange(6).expand(2, -1)
    logits = model(input_ids=ids, position_ids=positions, attention_mask=None)
    logits.float().logsumexp(-1).mean().backward()
    assert torch.isfinite(logits).all()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("overrides", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layouts_over_two_ranks_compose(overrides):
    from rlx.trainer.megatron_check import megatron_errors

    assert megatron_errors(to_object(compose(overrides))) == []


def test_an_accepted_config_is_remembered_and_a_refused_one_is_built_every_time(tmp_path, monkeypatch):
    """A process that only composes (a SLURM submission, run.plan_only) need not import Megatron for
    a config it accepted before; its refusals are always Megatron's own."""
    from rlx.models.family import ModelFamily
    from rlx.trainer import megatron_check

    accepted = to_object(compose(["model=tiny_deepseek_v3"]))  # MoE and MLA: both configs' arguments
    other = to_object(compose(["model=tiny_deepseek_v3", "model.kv_lora_rank=1"]))
    monkeypatch.setenv("RLX_CACHE", str(tmp_path))
    assert megatron_check.megatron_errors(accepted) == []
    assert len(list((tmp_path / "accepted" / "megatron_config").iterdir())) == 1

    monkeypatch.setattr(ModelFamily, "transformer_config", lambda *a, **k: pytest.fail("built again"))
    assert megatron_check.megatron_errors(accepted) == []
    with pytest.raises(pytest.fail.Exception, match="built again"):  # another argument
        megatron_check.megatron_errors(other)
    monkeypatch.undo()

    monkeypatch.setenv("RLX_CACHE", str(tmp_path))
    overrides, fragments = REFUSED["a Megatron setting Megatron refuses"]
    for _ in range(2):
        with pytest.raises(ConfigError) as e:
            compose(overrides)
        assert all(fragment in str(e.value) for fragment in fragments)
