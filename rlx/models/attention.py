"""Core attention for megatron's local (no Transformer Engine) layer spec, on torch SDPA.

The local spec's `DotProductAttention` materialises the full score matrix in Python
(17% MFU on an H200); `torch.nn.functional.scaled_dot_product_attention` picks a fused kernel
(flash / memory-efficient / math on CPU) and gives the same losses at about 3x the speed.
Packed sequences (`rlx.trainer.batch.make_packed_micro_batch`) arrive as a block-diagonal causal
`attention_mask`, which SDPA takes as is (its memory-efficient kernel on CUDA, not flash);
megatron's THD `packed_seq_params` are not supported.

Context parallelism (CP > 1) without Transformer Engine: each CP rank holds two chunks of the
sequence in Megatron's load-balanced layout (`load_balanced_positions`), all-gathers keys and
values over the CP group (backward: a reduce-scatter of their gradients, so each key's
gradient from every rank's queries lands on its owner), puts them in sequence order and
attends its own queries to them: each query chunk to the keys up to its end, causal aligned at
the bottom right (flash-eligible on CUDA); with a packed `attention_mask` (this rank's query
rows, every key column) in one call under that mask. Memory per rank is the full sequence's
keys and values, the local queries' scores (a packed mask still has a row of the whole
sequence per local query: varlen attention would drop it); Transformer Engine's ring attention
is not needed.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


def load_balanced_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The sequence positions CP rank `cp_rank` holds, in its order: the sequence cut into
    2 * `cp_size` equal chunks, rank r holding chunks r and 2 * cp_size - 1 - r (Megatron-LM's
    `get_batch_on_this_cp_rank`, and the rows megatron's RoPE takes on that rank).
    `seq_len` must be a multiple of 2 * cp_size."""
    chunk = divide(seq_len, 2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat(
        [
            torch.arange(first, first + chunk, device=device),
            torch.arange(second, second + chunk, device=device),
        ]
    )


def to_sequence_order(gathered: torch.Tensor, cp_size: int, dim: int = 0) -> torch.Tensor:
    """Every CP rank's positions concatenated in rank order along `dim` (an all-gather of
    `load_balanced_positions` shards) -> the same values in sequence order."""
    chunks = gathered.unflatten(dim, (cp_size, 2, -1))  # rank, which of its two chunks, token
    first = chunks.select(dim + 1, 0)  # chunk r of rank r
    second = chunks.select(dim + 1, 1).flip(dim)  # chunk 2 * cp_size - 1 - r of rank r
    return torch.cat([first, second], dim).flatten(dim, dim + 1)


class SDPAttention(MegatronModule):
    """Drop-in for `megatron.core.transformer.dot_product_attention.DotProductAttention`.

    Same constructor and forward signature: query is [sq, b, np, hn], key and value are
    [sk, b, ng, hn] (ng query groups for GQA, ng divides np); returns [sq, b, np * hn_v].
    Heads are this tensor-parallel rank's share; under context parallelism the three hold this
    CP rank's positions (`load_balanced_positions`) and sq = sk. `k_channels` / `v_channels` are accepted for
    attention types whose key and value head sizes differ (MLA passes them).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise NotImplementedError("SDPAttention supports vanilla full softmax attention only")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp_size = pg_collection.tp.size()
        # None without context parallelism: the plain path, no collective
        self.cp_group = pg_collection.cp if config.context_parallel_size > 1 else None
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.k_channels = k_channels or config.kv_channels
        # apply_query_key_layer_scaling divides the scale by the layer number and multiplies the
        # scores back in fp32; the product is the plain 1/sqrt(d) scale, which is what we use.
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention over [s, b, heads, dim] inputs; `attention_mask` is True where masked out."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention: packed sequences and attention bias unsupported")
        mask_type = attn_mask_type or self.attn_mask_type
        if self.cp_group is not None:
            # [s_local, b, ...] -> [s, b, ...] in sequence order, gradients reduce-scattered back
            key, value = (self._gather_over_cp(x) for x in (key, value))
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        sq, sk = q.shape[2], k.shape[2]
        if self.cp_group is not None and attention_mask is None:
            if mask_type != AttnMaskType.causal:
                raise NotImplementedError("SDPAttention under context parallelism: causal attention only")
            return self._causal_cp(q, k, v)
        attn_mask, is_causal = None, False
        if attention_mask is not None:
            # Megatron's masks are True where attention is forbidden; SDPA's are True where allowed.
            attn_mask = ~attention_mask.bool()
        elif mask_type == AttnMaskType.causal and sq > 1:
            if sq == sk:
                is_causal = True
            else:  # queries are the last sq positions (decoding with a cache): bottom-right causal
                attn_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        return self._output(self._sdpa(q, k, v, attn_mask, is_causal))

    def _sdpa(self, q, k, v, attn_mask, is_causal: bool) -> torch.Tensor:
        dropout_p = self.dropout_p if self.training else 0.0
        # Heads are split across TP ranks, so dropout draws from the tensor-parallel RNG stream.
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout_p > 0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with rng:
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=self.softmax_scale,
                enable_gqa=k.shape[1] != q.shape[1],
            )

    @staticmethod
    def _output(out: torch.Tensor) -> torch.Tensor:
        # [b, np, sq, hv] -> [sq, b, np * hv]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    def _gather_over_cp(self, x: torch.Tensor) -> torch.Tensor:
        """This CP rank's [s_local, ...] keys or values -> every rank's, [s, ...] in sequence order."""
        gathered = tensor_parallel.gather_from_sequence_parallel_region(
            x, tensor_parallel_output_grad=True, group=self.cp_group
        )
        return to_sequence_order(gathered, self.cp_group.size())

    def _causal_cp(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this CP rank's two query chunks ([b, h, s_local, d]) to the whole
        sequence's keys and values ([b, g, s, d]): each chunk sees the keys up to its own end."""
        # imported here: torch.nn.attention.bias imports torch._dynamo, 0.5 s of a trainer's start on CPU
        # (on a GPU liger-kernel's dispatch imports it anyway)
        from torch.nn.attention.bias import causal_lower_right

        cp_size, cp_rank = self.cp_group.size(), self.cp_group.rank()
        chunk = q.shape[2] // 2
        outs = []
        # the chunks' indices in the sequence (`load_balanced_positions`)
        for index, q_chunk in zip((cp_rank, 2 * cp_size - 1 - cp_rank), q.split(chunk, dim=2), strict=True):
            end = (index + 1) * chunk  # keys 0 .. end - 1; the chunk's queries are the last of them
            mask = causal_lower_right(chunk, end) if index > 0 else None
            outs.append(self._sdpa(q_chunk, k[:, :, :end], v[:, :, :end], mask, is_causal=mask is None))
        return self._output(torch.cat(outs, dim=2))
