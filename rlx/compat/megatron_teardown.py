"""What megatron-core (0.16.1) leaves holding a model or its process groups after a run tears down.

A rank kept for another run (`rlx.actor_reuse`) must free both: every gloo group left alive keeps
its threads (`gloo_tcp_loop`, two `pt_gloo_runloop`), polling every 10 ms in an idle process.

- MoE token dispatchers keep their last forward's routing probabilities (`probs`, `local_probs`,
  a comm manager's `token_probs`) on themselves. After a training forward that tensor carries its
  autograd graph, whose `AccumulateGrad` nodes hold megatron DDP's grad hooks, closures over the
  DDP wrapper: model -> dispatcher -> graph -> hook -> DDP -> model is a cycle through C++ autograd
  nodes, which Python's collector cannot see (a node's hooks are traversed only while Python alone
  owns the node). The model, its gradient buffers and every group it holds (the dispatcher's EP/TP
  groups, DDP's) then outlive the run. `drop_router_graphs` lets go of those tensors.
- `parallel_state.destroy_model_parallel` resets neither `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`
  nor its gloo twin, which alias the data-parallel-with-CP groups under one distributed-optimizer
  instance: two gloo groups per rank stay alive until the next run replaces them.
  `forget_groups` resets whatever group the module still names.
"""

from __future__ import annotations

import torch


def drop_router_graphs(chunks: list[torch.nn.Module]) -> None:
    """Let go of the tensors with an autograd graph that the MoE layers of `chunks` (models, DDP
    wrapped or not) keep from their last forward; the layers write them anew in the next one."""
    for chunk in chunks:
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is None:
                continue
            for holder in (dispatcher, getattr(dispatcher, "_comm_manager", None)):  # flex: DeepEP's
                for name, value in list(vars(holder).items() if holder is not None else ()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(holder, name, None)


def forget_groups() -> None:
    """After `destroy_model_parallel`: reset every `parallel_state` global that still names a
    process group, so nothing of megatron's keeps a destroyed group (and its threads) alive."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
