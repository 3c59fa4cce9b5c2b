"""One decoder for Llama / SmolLM2 (tied embeddings, GQA), Qwen2 (q/k/v bias) and Mistral.

RMSNorm, RoPE, SwiGLU; fused ``wqkv`` and ``w_gate_up`` projections; float32 or bfloat16.
Two forward paths with the same contract: the fused one (``use_fused``, the default where
cext.ops is built) keeps the residual stream in float32 and runs every op between the
matmuls in C kernels (engine.models.fused), decode attention included; the torch
reference path (``ENGINE_FUSED=0`` or ``model.use_fused = False``) is plain aten ops with
the residual in the compute dtype. Prefill attention is torch's SDPA on both.
Implements the model interface of ``engine.batch``: ``forward(batch, kv_cache)`` writes
each new row's K/V at ``batch.slot_mapping`` and attends through the paged cache.

Weights come in as a state dict with Hugging Face names (``model.layers.0.self_attn.q_proj.weight``,
...); the loaders translate GGUF names and layouts to these.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import ForwardBatch
from engine.models import fused
from engine.models.attention import AttentionPlan, PagedKVCache, paged_attention, plan_attention
from engine.models.config import ModelConfig
from engine.models.linear import Linear
from engine.models.quant import Int8Weight, Weight, cat_rows
from engine.models.rope import RotaryTable, apply_rope

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REFINE_TOP_K = 64  # bfloat16: logits recomputed in float32 for this many best tokens per row


def _resolve(dtype: str | torch.dtype, table: dict[str, torch.dtype], what: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in table.values():
        return dtype
    if dtype in table:
        return table[dtype]
    raise ValueError(f"{what}: unsupported {dtype!r}, expected one of {tuple(table)}")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return _resolve(dtype, DTYPES, "dtype")


KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_kv_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return _resolve(dtype, KV_CACHE_DTYPES, "kv_cache_dtype")


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, Weight | None], pack_weights: bool = True,
                 exact_products: bool = False, dense_above_rows: int | None = None):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.attn_norm = nn.Parameter(weights["attn_norm"], requires_grad=False)  # [E]
        linear = dict(pack=pack_weights, exact=exact_products, dense_above_rows=dense_above_rows)
        self.qkv_proj = Linear(weights["wqkv"], weights["bqkv"], **linear)  # [(H + 2 KH) D, E]
        self.o_proj = Linear(weights["wo"], weights["bo"], **linear)  # [E, H D]
        self.ffn_norm = nn.Parameter(weights["ffn_norm"], requires_grad=False)  # [E]
        self.gate_up_proj = Linear(weights["w_gate_up"], None, **linear)  # [2 I, E]
        self.down_proj = Linear(weights["w_down"], None, **linear)  # [E, I]
        self.norm_shape = (config.hidden_size,)
        self.intermediate_size = config.intermediate_size

    def forward(self, x, cos, sin, k_cache, v_cache, plan):
        num_rows = x.shape[0]  # x [T, E]
        h = F.rms_norm(x, self.norm_shape, self.attn_norm, self.eps)  # [T, E]
        qkv = self.qkv_proj(h)  # [T, (H + 2 KH) D]
        qk = qkv[:, : self.q_size + self.kv_size].view(num_rows, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, cos, sin)  # [T, H + KH, D]
        q = qk[:, : self.num_heads]  # [T, H, D]
        k = qk[:, self.num_heads:]  # [T, KH, D]
        v = qkv[:, self.q_size + self.kv_size:].view(num_rows, self.num_kv_heads, self.head_dim)  # [T, KH, D]
        k_cache.index_copy_(0, plan.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, plan.slot_mapping, v.to(v_cache.dtype))
        attn = paged_attention(q, k, v, k_cache, v_cache, plan)  # [T, H D]
        x = x + self.o_proj(attn)  # [T, E]
        h = F.rms_norm(x, self.norm_shape, self.ffn_norm, self.eps)
        gate_up = self.gate_up_proj(h)  # [T, 2 I]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [T, I] each
        return x + self.down_proj(F.silu(gate) * up)  # [T, E]

    def forward_fused(self, resid: torch.Tensor, delta: torch.Tensor | None, step: fused.FusedStep,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """resid [T, E] float32 += delta (the previous layer's output, None for the first layer),
        in place -> this layer's output [T, E] in the compute dtype (added by the next call)."""
        num_rows = resid.shape[0]
        h = step.norm(resid, delta, self.attn_norm)  # [T, E]
        qkv = self.qkv_proj(h)  # [T, (H + 2 KH) D]
        step.rope_kv(qkv, k_cache, v_cache)  # q, k rotated in place; k, v written to the cache
        if plan.prefills:
            H, KH, D = self.num_heads, self.num_kv_heads, self.head_dim
            q = qkv[:, : self.q_size].view(num_rows, H, D)  # [T, H, D]
            k = qkv[:, self.q_size: self.q_size + self.kv_size].view(num_rows, KH, D)  # [T, KH, D]
            v = qkv[:, self.q_size + self.kv_size:].view(num_rows, KH, D)  # [T, KH, D]
            attn = paged_attention(q, k, v, k_cache, v_cache, plan)  # [T, H D]
        else:
            attn = step.decode_attention(qkv, k_cache, v_cache)  # [T, H D]
        h = step.norm(resid, self.o_proj(attn), self.ffn_norm)  # [T, E]
        return self.down_proj(step.silu_mul(self.gate_up_proj(h)))  # [T, E]


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, state_dict: dict[str, Weight], dtype: str | torch.dtype = "float32",
                 rope_freq_factors: torch.Tensor | None = None, pack_weights: bool = True,
                 dense_above_rows: int | None = None, exact_products: bool = False,
                 kv_cache_dtype: str | torch.dtype | None = None):
        """state_dict: Hugging Face names -> dense tensors, or the quantized formats of
        engine.models.quant (Int4Weight / Int5Weight / Int8Weight for projections; Int8Weight
        also for the embedding and head), as the loader chose (engine.loader). Each entry is
        read once, layer by layer, so a lazy mapping (the GGUF loader's) converts one tensor at
        a time. pack_weights: lay dense projection weights out for oneDNN once.
        dense_above_rows: quantized projections also keep a dense copy for larger products.
        exact_products: quantized products are the float32 products of the dequantized weights
        (else the C kernels of cext.qgemm, whose decode-sized batches quantize the activations
        to int16 codes per block of 32: engine.models.linear), whatever the activation dtype."""
        super().__init__()
        self.config = config
        self.dtype = resolve_dtype(dtype)
        self.vocab_size = config.vocab_size
        self.max_model_len = config.max_position_embeddings
        weights = _WeightReader(state_dict, self.dtype)
        E, V = config.hidden_size, config.vocab_size
        self.layers = nn.ModuleList(
            DecoderLayer(config, _layer_weights(config, weights, i), pack_weights, exact_products, dense_above_rows)
            for i in range(config.num_layers))
        self.norm = nn.Parameter(weights.take("model.norm.weight", (E,)), requires_grad=False)  # [E]
        embed = weights.take("model.embed_tokens.weight", (V, E))
        head = embed if config.tie_word_embeddings else weights.take("lm_head.weight", (V, E))
        # The embedding: a dense table [V, E] (F.embedding), or rows looked up from a quantized
        # source (Int8Weight, or the loader's MappedRows: anything with .rows(ids, dtype)).
        self.embed_rows = None if isinstance(embed, torch.Tensor) else embed
        self.embed = None if self.embed_rows is not None else nn.Parameter(embed, requires_grad=False)  # [V, E]
        # The head: a packed copy for the product; the dense lm_head stays (bfloat16 refinement).
        self.lm_head = None if isinstance(head, Int8Weight) else (
            self.embed if config.tie_word_embeddings else nn.Parameter(head, requires_grad=False))  # [V, E]
        self.head_int8 = head if isinstance(head, Int8Weight) else None
        self.head_proj = Linear(self.head_int8 or self.lm_head, None, pack_weights, keep_dense=True,
                                exact=exact_products)
        self.rope = RotaryTable(config, self.dtype, rope_freq_factors)
        # The KV cache's dtype (None: the activations'). The loaders pick float16 beside float32
        # activations for quantized weights (as llama.cpp keeps K and V): a decode step reads
        # the whole context's K and V, so at long contexts their bytes rival the weights'.
        self.kv_cache_dtype = self.dtype if kv_cache_dtype is None else _resolve_kv_dtype(kv_cache_dtype)
        self.use_fused = fused.default_enabled()  # C kernels between the matmuls (else the torch reference)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, E] in the model dtype."""
        if self.embed_rows is not None:
            return self.embed_rows.rows(ids, self.dtype)
        return F.embedding(ids, self.embed)

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> the head's rows [..., E] in float32 (the weights the product used)."""
        if self.head_int8 is not None:
            return self.head_int8.rows(ids, torch.float32)
        return self.lm_head[ids].float()

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        c = self.config
        return PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.kv_cache_dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """-> logits [len(batch.logit_rows), vocab_size] float32."""
        return self.compute_logits(self.forward_hidden(batch, kv_cache))

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """-> the final-normed hidden states of batch.logit_rows [S, E] (the head's input;
        pooled embeddings read them, engine/embedding)."""
        self.rope.ensure(max(batch.context_lens_list))
        if self.use_fused:
            return self._forward_fused(batch, kv_cache)
        plan = plan_attention(batch, self.config.sliding_window, self.dtype)
        cos, sin = self.rope.lookup(batch.positions)  # [T, 1, D]
        x = self.embed_tokens(batch.input_ids)  # [T, E]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache.k[i], kv_cache.v[i], plan)
        x = x.index_select(0, batch.logit_rows)  # [S, E]
        return F.rms_norm(x, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)

    def _forward_fused(self, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        plan = plan_attention(batch, self.config.sliding_window, self.dtype, is_fused=True)
        positions = batch.positions  # [T]
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        c = self.config
        step = fused.FusedStep(positions.shape[0], self.dtype, c.hidden_size, c.intermediate_size, c.rms_norm_eps,
                               c.num_heads, c.num_kv_heads, c.head_dim, positions, self.rope.cos_half,
                               self.rope.sin_half, plan)
        resid = self.embed_tokens(batch.input_ids).float()  # [T, E] float32 residual stream
        delta = None
        for i, layer in enumerate(self.layers):
            delta = layer.forward_fused(resid, delta, step, kv_cache.k[i], kv_cache.v[i], plan)
        rows = batch.logit_rows
        return fused.add_rmsnorm(resid.index_select(0, rows), delta.index_select(0, rows), self.norm,
                                 self.config.rms_norm_eps)  # [S, E]

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [S, E] (final-normed) -> logits [S, V] float32.

        When the head's product is not a float32 product of the source's own weights (a
        bfloat16 head rounds logits to 8 mantissa bits, 0.06 at a logit of 15; a head
        re-quantized to int8 from another type moves them too), near-equal candidates can tie
        or swap. The top REFINE_TOP_K logits of each row are then recomputed with a float32
        product of the exact rows; the tail keeps the approximate values (its probability mass
        is negligible). A Q8_0 head in the C kernels needs none of this: its codes are the
        file's, and the kernels' int16 activation codes err by less than 2^-15 per element.
        """
        logits = self.head_proj(x).float()  # [S, V]
        is_exact_int8 = (self.head_int8 is not None and self.head_int8.is_exact
                         and not self.head_proj.exact)
        if self.head_proj.is_exact or is_exact_int8:
            return logits
        top_ids = logits.topk(min(REFINE_TOP_K, self.vocab_size), dim=-1).indices  # [S, k]
        rows = self.head_rows(top_ids)  # [S, k, E]
        exact = torch.bmm(rows, x.float().unsqueeze(-1)).squeeze(-1)  # [S, k]
        return logits.scatter_(1, top_ids, exact)


class _WeightReader:
    """Takes weights out of a state dict by name, checking shape; dense tensors are
    cast to the model dtype, quantized ones stay as they are."""

    def __init__(self, state_dict: dict[str, Weight], dtype: torch.dtype):
        self.state_dict = state_dict
        self.dtype = dtype

    def take(self, name: str, shape: tuple[int, ...], optional: bool = False) -> Weight | None:
        tensor = self.state_dict.get(name)
        if tensor is None:
            if optional:
                return None
            raise ValueError(f"missing weight {name!r} (expected shape {list(shape)})")
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"weight {name!r}: shape {list(tensor.shape)}, expected {list(shape)}")
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return tensor.to(self.dtype).contiguous()


def _layer_weights(config: ModelConfig, weights: _WeightReader, i: int) -> dict[str, Weight | None]:
    E, I = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    p = f"model.layers.{i}."
    take = weights.take
    wq = take(p + "self_attn.q_proj.weight", (q_size, E))
    wk = take(p + "self_attn.k_proj.weight", (kv_size, E))
    wv = take(p + "self_attn.v_proj.weight", (kv_size, E))
    biases = [take(p + f"self_attn.{n}_proj.bias", (size,), optional=not config.attention_bias)
              for n, size in (("q", q_size), ("k", kv_size), ("v", kv_size))]
    if any(b is not None for b in biases):
        biases = [torch.zeros(size, dtype=weights.dtype) if b is None else b
                  for b, size in zip(biases, (q_size, kv_size, kv_size))]
        bqkv = torch.cat(biases)  # [(H + 2 KH) D]
    else:
        bqkv = None
    return {
        "attn_norm": take(p + "input_layernorm.weight", (E,)),
        "wqkv": cat_rows([wq, wk, wv]),  # [(H + 2 KH) D, E]
        "bqkv": bqkv,
        "wo": take(p + "self_attn.o_proj.weight", (E, q_size)),
        "bo": take(p + "self_attn.o_proj.bias", (E,), optional=True),
        "ffn_norm": take(p + "post_attention_layernorm.weight", (E,)),
        "w_gate_up": cat_rows([take(p + "mlp.gate_proj.weight", (I, E)), take(p + "mlp.up_proj.weight", (I, E))]),
        "w_down": take(p + "mlp.down_proj.weight", (E, I)),
    }
