"""megatron's SelfAttention, handing its q norm the query heads where they lie in the fused QKV
projection's output.

megatron splits the QKV projection's output [s, b, groups, (heads a group + 2) x d] into q, k and v
views and reshapes q to [s, b, heads, d]; with more than one query head a KV group that reshape
cannot be a view, so it copies q, which the q norm then keeps for its backward: 4 KB a token and
layer at the Qwen3-1.7B shape (the copy was 21 ms of a 2.9 s training step on 1×H200,
docs/benchmarks.md; kept, 1.8 GiB of activations at the GRPO bench's micro-batch of 32 × 516
tokens). `QKNormSelfAttention` gives the q norm the query view itself, [s, b, groups, heads a
group, d], which rlx's Triton norm reads in place (`rlx.models.rows.grouped_rows`), and
views the norm's contiguous output as megatron's [s, b, heads, d]: the same arithmetic, without the
copy.

Only for a q norm that reads such rows (`reads_grouped_rows`: the liger kernel set's) and for
megatron's plain case (q, k and v split, no output gate, no cross-attention keys, at least as many
query groups as tensor-parallel ranks); anything else is megatron's own method.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention


class QKNormSelfAttention(SelfAttention):
    def get_query_key_value_tensors(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        output_gate: bool = False,
        split_qkv: bool = True,
    ):
        if (
            output_gate
            or not split_qkv
            or key_value_states is not None
            or not getattr(self.q_layernorm, "reads_grouped_rows", False)
            or self.config.num_query_groups < self.world_size
            or self.config.test_mode
        ):
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, output_gate, split_qkv
            )
        d = self.hidden_size_per_attention_head
        groups = self.num_query_groups_per_partition
        heads_a_group = self.num_attention_heads_per_partition // groups
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        mixed_qkv = mixed_qkv.view(*mixed_qkv.shape[:-1], groups, (heads_a_group + 2) * d)
        query, key, value = torch.split(mixed_qkv, [heads_a_group * d, d, d], dim=3)
        # [s, b, groups, heads a group, d], normalised where it lies; the output is contiguous
        query = self.q_layernorm(query.unflatten(-1, (heads_a_group, d)))
        query = query.reshape(*query.shape[:2], -1, d)  # a view of a contiguous output
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value
