"""One compact forward pass for the dense decoder families and Qwen3-MoE, over paged attention.

Module and parameter names are the HF checkpoint's (`model.layers.0.self_attn.q_proj.weight`),
so the trainer's exported tensors load by name, in place. What differs between families is a
handful of switches read from config.json:

| model_type | switches |
|---|---|
| qwen3 | q/k RMSNorm per head |
| llama | attention/MLP bias from the config; llama3 rope scaling (via transformers' rotary) |
| glm4 | q/k/v bias, fused gate_up_proj, post-attention and post-MLP norms, interleaved partial rotary |
| qwen3_moe | qwen3 attention, sparse MoE MLP on the layers the config names |

Legend: T tokens of the step (flattened over sequences), H query heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from rlx.engine.attention import AttentionMetadata, paged_attention
from rlx.engine.models.layers import FusedGatedMLP, GatedMLP, Linear, MergedLinear, RMSNorm, RotaryTable


class Attention(nn.Module):
    def __init__(self, cfg, family: str):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        hidden = cfg.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias and family != "glm4")
        self.qk_norm = family in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.qkv_proj: MergedLinear | None = None

    def merge_projections(self) -> None:
        """q/k/v_proj become one `qkv_proj` (CUDA builds; before weights load)."""
        parts = [(name, getattr(self, name).out_features) for name in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = MergedLinear(self.q_proj.in_features, parts, self.q_proj.bias is not None)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, positions, rotary: RotaryTable, kv, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        if self.qkv_proj is not None:  # row-strided views of one output: the kernels take strides
            q, k, v = self.qkv_proj(x).split(self.qkv_proj.sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if x.is_cuda and rotary.rotary_dim == self.head_dim and not rotary.interleaved:
            self._fused_qk(q, k, v, positions, rotary, kv, meta)
            out = paged_attention(q, k, v, kv, meta, self.scale, kv_written=True)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rotary(q, k, positions)
            out = paged_attention(q, k, v, kv, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))

    def _fused_qk(self, q, k, v, positions, rotary: RotaryTable, kv, meta: AttentionMetadata) -> None:
        """q/k norm, rotary and the KV store in one kernel (in place on q and k)."""
        from rlx.engine.triton_layers import qk_norm_rope_store

        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else None
        eps = self.q_norm.eps if self.qk_norm else 0.0
        qk_norm_rope_store(q, k, v, norms, eps, rotary.cos, rotary.sin, positions, kv, meta)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, family: str, mlp: nn.Module):
        super().__init__()
        self.self_attn = Attention(cfg, family)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_norms = family == "glm4"
        if self.post_norms:
            self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_fused(self, h, residual, positions, rotary, kv, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """CUDA: (this layer's MLP output, residual stream before it); each residual add is
        fused into the next norm. `h` None at the first layer (`residual` is the embedding)."""
        from rlx.engine.triton_layers import add_rms_norm

        norm = self.input_layernorm
        normed, residual = add_rms_norm(h, residual, norm.weight, norm.eps)
        h = self.self_attn(normed, positions, rotary, kv, meta)
        norm = self.post_attention_layernorm
        normed, residual = add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(normed), residual

    def forward(self, x, positions, rotary, kv, meta) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), positions, rotary, kv, meta)
        if self.post_norms:
            h = self.post_self_attn_layernorm(h)
        x = x + h
        h = self.mlp(self.post_attention_layernorm(x))
        if self.post_norms:
            h = self.post_mlp_layernorm(h)
        return x + h


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg, family: str, make_mlp):
        super().__init__()
        # built on the meta device and filled from the checkpoint: a given weight skips the random
        # init, whose normal_ on meta imports torch._dynamo (2 s of the engine's start on CPU)
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, family, make_mlp(i)) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder LM over paged attention: `forward` gives hidden states, `logits` the vocabulary scores."""

    def __init__(self, cfg, max_positions: int):
        super().__init__()
        self.config = cfg
        family = cfg.model_type
        self.model = Backbone(cfg, family, lambda i: self.make_mlp(cfg, i))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.max_positions = max_positions
        self.rotary: RotaryTable | None = None  # built by build_rotary, off the meta device
        self.tie_weights()

    def build_rotary(self, device: torch.device) -> None:
        cfg = self.config
        self.rotary = RotaryTable(cfg, self.max_positions, interleaved=cfg.model_type == "glm4").to(device)

    def make_mlp(self, cfg, layer: int) -> nn.Module:
        if cfg.model_type == "glm4":
            return FusedGatedMLP(cfg.hidden_size, cfg.intermediate_size)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=bool(getattr(cfg, "mlp_bias", False)))

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        if x.is_cuda and not self.model.layers[0].post_norms:  # fused kernels; GLM's post-norms: not
            from rlx.engine.triton_layers import add_rms_norm

            h = None
            for index, layer in enumerate(self.model.layers):
                h, x = layer.forward_fused(h, x, positions, self.rotary, kv_cache.layer(index), meta)
            return add_rms_norm(h, x, self.model.norm.weight, self.model.norm.eps)[0]
        for index, layer in enumerate(self.model.layers):
            x = layer(x, positions, self.rotary, kv_cache.layer(index), meta)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The LM head's logits (the head's dtype); into `out` (rows x vocabulary) where given, as
        every decode graph writes them into one buffer (`DecodeGraphs`): the same GEMM."""
        if out is None:
            return self.lm_head(hidden)
        return torch.mm(hidden, self.lm_head.weight.t(), out=out)

    def merge_projections(self) -> None:
        """One GEMM for q/k/v and one for gate/up in every layer (CUDA builds, on the meta device;
        CPU keeps separate GEMMs, whose numerics its tests and golden runs recorded)."""
        for module in list(self.modules()):
            if isinstance(module, Attention | GatedMLP):
                module.merge_projections()

    def enable_small_gemms(self) -> bool:
        """The layers' GEMMs at up to `triton_gemm.SMALL_ROWS` rows in `small_gemm` where the
        engine takes it (`small_gemms_on`: CUDA sm90+ under PDL) and each weight is small enough
        (`small_gemm_takes`); whether any is. gate_up takes its SwiGLU along; where the layers'
        fused forward sums o's and down's outputs in `add_rms_norm` (not GLM's post-norms), those
        split K in partials. After the weights are on their device (CUDA builds)."""
        from rlx.engine import triton_gemm as tg

        if not tg.small_gemms_on(self.model.embed_tokens.weight.device):
            return False
        taken = False
        for layer in self.model.layers:
            mlp = layer.mlp if isinstance(layer.mlp, GatedMLP) and layer.mlp.gate_up is not None else None
            if mlp is not None and tg.small_gemm_takes(mlp.gate_up.weight):
                mlp.small_swiglu = tg.small_swiglu_settings(mlp.gate_up.sizes[0], mlp.gate_up.in_features)
                mlp.small_rows = tg.SMALL_ROWS
            down = getattr(layer.mlp, "down_proj", None)
            summed = () if layer.post_norms else (layer.self_attn.o_proj, down)
            fused = mlp.gate_up if mlp is not None and mlp.small_swiglu is not None else None
            for module in layer.modules():
                if module is fused:  # the MLP runs it with its SwiGLU at those rows
                    taken = True
                elif isinstance(module, Linear) and tg.small_gemm_takes(module.weight):
                    settings = tg.small_split_settings if module in summed else tg.small_gemm_settings
                    module.small_settings, module.small_rows = settings(*module.weight.shape), tg.SMALL_ROWS
                    taken = True
        return taken

    def weight_views(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> the live tensor (or view of it) that name loads into."""
        views = {}
        for name, module in self.named_modules(remove_duplicate=False):
            if isinstance(module, MergedLinear):
                views.update(module.part_views(name.rsplit(".", 1)[0]))
        merged = {f"{name}." for name, m in self.named_modules() if isinstance(m, MergedLinear)}
        for name, p in self.named_parameters(remove_duplicate=False):
            if not any(name.startswith(prefix) for prefix in merged):
                views[name] = p.data
        return views

    supports_cuda_graph = True
