"""What context parallelism (`cluster.context_parallel_size`, CP) adds to the trainer: each
micro-batch's sequence split over the CP ranks as Megatron splits it, and per-position results
gathered back in sequence order.

The split is Megatron-LM's load-balanced one (`get_batch_on_this_cp_rank`): the sequence, padded
to a multiple of 2 × CP (`pad_multiple`), is cut into 2 × CP chunks and CP rank r holds chunks r
and 2 × CP - 1 - r, so every rank does the same share of causal attention work. The model sees
only this rank's positions: tokens, position ids and the query rows of a packed attention mask
(its key columns stay the whole sequence: `rlx.models.attention.SDPAttention` all-gathers keys
and values). Megatron's RoPE takes the same chunks of its position table on each rank
(`get_pos_emb_on_this_cp_rank`), so every token is rotated by its position in the sequence.

Per-position outputs (log-probs, entropies, values) are computed on this rank's positions, then
all-gathered into sequence order with a backward that keeps this rank's slice of the gradient:
every CP rank then holds the whole micro-batch's outputs and computes the same loss, so what
the trainer returns and its loss are those of CP = 1. Each rank's parameter gradient is its
share of the total (its tokens, and its keys and values as every rank's queries used them);
megatron's schedule multiplies a loss by CP and DDP averages gradients over DP × CP ranks, which
together sum the shares. With CP = 1 every function here returns its input's values unchanged.

Shapes: B rows, L sequence positions (the whole, padded row), S this rank's L / CP positions.
"""

from __future__ import annotations

import torch

from rlx.models.attention import load_balanced_positions, to_sequence_order
from rlx.trainer.batch import MicroBatch
from rlx.trainer.logprobs import logprobs_and_entropy


def cp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size()


def local_positions(seq_len: int, device: torch.device) -> torch.Tensor:
    """This CP rank's positions of a sequence of `seq_len` (all of them with CP = 1)."""
    from megatron.core import parallel_state

    size = cp_size()
    if size == 1:
        return torch.arange(seq_len, device=device)
    return load_balanced_positions(seq_len, size, parallel_state.get_context_parallel_rank(), device)


def model_inputs(mb: MicroBatch) -> dict[str, torch.Tensor | None]:
    """GPTModel's keyword inputs for `mb`: this CP rank's positions of it."""
    inputs = {
        "input_ids": mb.tokens_BL,
        "position_ids": mb.position_ids_BL,
        "attention_mask": mb.attention_mask_B1LL,
    }
    if cp_size() == 1:
        return inputs
    index_S = local_positions(mb.tokens_BL.shape[1], mb.tokens_BL.device)
    inputs["input_ids"] = mb.tokens_BL[:, index_S]
    inputs["position_ids"] = mb.position_ids_BL[:, index_S]
    if mb.attention_mask_B1LL is not None:  # this rank's queries, every key
        inputs["attention_mask"] = mb.attention_mask_B1LL[:, :, index_S]
    return inputs


def gather_sequence(values_BS: torch.Tensor) -> torch.Tensor:
    """This CP rank's per-position `values_BS` ([B, S, ...]) -> the whole sequence's [B, L, ...],
    in sequence order, from every CP rank. Backward: this rank's slice of the gradient (each rank
    computes the same loss from the gathered values)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    size = cp_size()
    if size == 1:
        return values_BS
    gathered_LB = gather_from_sequence_parallel_region(
        values_BS.transpose(0, 1).contiguous(),
        tensor_parallel_output_grad=False,
        group=parallel_state.get_context_parallel_group(),
    )
    return to_sequence_order(gathered_LB, size).transpose(0, 1)


def next_token_logprobs(
    logits_BSV: torch.Tensor, tokens_BL: torch.Tensor, *, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(token p + 1) and the entropy at every position p < L - 1 ([B, L - 1] each), from
    this rank's (vocab- and context-parallel) logits of the micro-batch `tokens_BL`, which the
    backward overwrites with their gradient (the trainer reads them once)."""
    # position p predicts token p + 1; the last position's target (wrapped round) is dropped
    # below. Every position's logits go in whole, not as a [:, :-1] view: the gradient is then
    # written over them instead of into a zero-padded copy of the view's (SliceBackward)
    next_BL = tokens_BL.roll(-1, dims=1)
    target_BS = (
        next_BL if cp_size() == 1 else next_BL[:, local_positions(tokens_BL.shape[1], tokens_BL.device)]
    )
    logp_BS, entropy_BS = logprobs_and_entropy(
        logits_BSV, target_BS, temperature=temperature, with_entropy=with_entropy, grad_over_logits=True
    )
    logp_BL = gather_sequence(logp_BS)[:, :-1]
    entropy_BL = gather_sequence(entropy_BS)[:, :-1] if entropy_BS is not None else None
    return logp_BL, entropy_BL


def position_values(values_BS: torch.Tensor) -> torch.Tensor:
    """The critic's values at positions p < L - 1 ([B, L - 1]) from this rank's [B, S]."""
    return gather_sequence(values_BS)[:, :-1]
