"""megatron-core 0.16's distributed optimizer, checkpointed with torch's Adam (no TE, no apex).

Three things stood between `train.distributed_optimizer=true` and a checkpoint that resumes:

- its default format, `fully_sharded_model_space`, makes flattened `ShardedTensor`s, which
  megatron's own checkpointing then refuses ("ShardedTensor.flattened_range is not supported"):
  every save of such a run failed. `METADATA` asks for `fully_reshardable` (each weight's state
  gathered into its canonical shape), which loads at any TP/PP/DP, as rlx's checkpoints do, its
  memory-efficient variant (gathered over gloo into data-parallel rank 0's host memory alone).
  Its cost: a save holds the whole optimizer state, 12 bytes a parameter, in rank 0's host memory,
  and a load in every rank's (113 GB for a 9.4B model); `dp_reshardable`, megatron's parallel
  format, restored no step counts and did not load on fewer ranks here;
- an optimizer that has not stepped has no Adam state, and `DistributedOptimizer.state_dict()`
  (called to build what is loaded) reads every weight's step count: `allocate_state` gives it
  one, megatron's own way (its FSDP path's `_init_optimizer_states_with_dummy_values`: one step
  of zero gradients, whose state and master weights the loaded ones replace);
- loading a `fully_reshardable` state copies every entry of a weight's Adam state from the
  checkpoint's, where torch's step count is not (megatron restores it separately): a KeyError.
  `apply()` hands the copy the weight's own step count for that key (a copy onto itself).

After a load every weight shares one step tensor (megatron sets the same one on all):
`rlx.trainer.adam.choose_adam_kernel` gives each its own, or Adam would count a step once a
weight.
"""

from __future__ import annotations

METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
}


def allocate_state(sub_optimizer) -> None:
    """Adam state for `sub_optimizer` (one of megatron's wrappers, as
    `rlx.trainer.offload.sub_optimizers` lists them) if it is a distributed optimizer with none yet."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if isinstance(sub_optimizer, DistributedOptimizer) and not sub_optimizer.optimizer.state:
        sub_optimizer._init_optimizer_states_with_dummy_values()


def apply() -> None:
    """Let a loaded weight state without a step count through (idempotent)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(set_states, "_rlx_keeps_step", False):
        return

    def with_own_step(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state.get(main_param, {}).get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return set_states(self, model_param, tensors)

    with_own_step._rlx_keeps_step = True
    DistributedOptimizer._set_main_param_and_optimizer_states = with_own_step
