"""Per-token log-probabilities and entropy from (possibly vocab-parallel) logits.

Shapes: B batch, S sequence positions, V vocabulary entries held by this tensor-parallel rank.
Reductions over the vocabulary go through Megatron's `reduce_from_tensor_model_parallel_region`
(all-reduce forward, identity backward), which is the right gradient because every TP rank
computes the same replicated loss downstream. With TP = 1 the reductions are no-ops.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def _vocab_all_reduce_max(x_BS: torch.Tensor) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        x_BS = x_BS.clone()
        torch.distributed.all_reduce(
            x_BS, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
        )
    return x_BS


def logprobs_and_entropy(
    logits_BSV: torch.Tensor, target_BS: torch.Tensor, *, temperature: float = 1.0, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and the entropy of the temperature-scaled distribution at every position.

    `logits_BSV` is this rank's vocabulary shard; `target_BS` holds global token ids.
    Computed in fp32 whatever the logits' dtype.
    """
    logits_BSV = logits_BSV.float()
    if temperature != 1.0:
        logits_BSV = logits_BSV / temperature
    num_local = logits_BSV.shape[-1]
    vocab_start = parallel_state.get_tensor_model_parallel_rank() * num_local

    max_BS = _vocab_all_reduce_max(logits_BSV.detach().amax(dim=-1))
    shifted_BSV = logits_BSV - max_BS.unsqueeze(-1)
    sum_exp_BS = reduce_from_tensor_model_parallel_region(shifted_BSV.exp().sum(dim=-1))
    log_z_BS = sum_exp_BS.log()

    local_target_BS = target_BS - vocab_start
    owned_BS = (local_target_BS >= 0) & (local_target_BS < num_local)
    picked_BS = shifted_BSV.gather(-1, local_target_BS.clamp(0, num_local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit_BS = reduce_from_tensor_model_parallel_region(picked_BS * owned_BS)
    logp_BS = target_logit_BS - log_z_BS

    entropy_BS = None
    if with_entropy:
        probs_BSV = (shifted_BSV - log_z_BS.unsqueeze(-1)).exp()
        expected_logit_BS = reduce_from_tensor_model_parallel_region((probs_BSV * shifted_BSV).sum(dim=-1))
        entropy_BS = log_z_BS - expected_logit_BS
    return logp_BS, entropy_BS
