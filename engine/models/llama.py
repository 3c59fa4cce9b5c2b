"""One decoder for Llama / SmolLM2 (tied embeddings, GQA), Qwen2 (q/k/v bias) and Mistral.

RMSNorm, RoPE, SwiGLU; fused ``wqkv`` and ``w_gate_up`` projections; float32 or bfloat16.
Two forward paths with the same contract: the fused one (``use_fused``, the default where
cext.ops is built) keeps the residual stream in float32 and runs every op between the
matmuls in C kernels (engine.models.fused), decode attention included; the torch
reference path (``ENGINE_FUSED=0`` or ``model.use_fused = False``) is plain aten ops with
the residual in the compute dtype. Prefill attention is a C kernel over the paged cache
on the fused path (engine.models.attention) and torch's SDPA on the reference path.
Implements the model interface of ``engine.batch``: ``forward(batch, kv_cache)`` writes
each new row's K/V at ``batch.slot_mapping`` and attends through the paged cache.

Weights come in as a state dict with Hugging Face names (``model.layers.0.self_attn.q_proj.weight``,
...); the loaders translate GGUF names and layouts to these.
"""
from __future__ import annotations

import logging
import mmap
import os
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import ForwardBatch, LogitsBuffer, verify_rows_as_decodes, window_blocks
from engine.config import ACTIVATIONS
from engine.models import decode_program, fused, routes
from engine.models.attention import AttentionPlan, PagedKVCache, paged_attention, plan_attention
from engine.models.config import ModelConfig
from engine.models.families import hf_layer_name
from engine.models.linear import Linear, row_routes
from engine.models.moe import MixtureOfExperts
from engine.models.quant import Int8Weight, PackedInt8Weight, StripRows, Weight, cat_rows
from engine.models.rope import RotaryTable, apply_rope

log = logging.getLogger("engine")

# Architectures whose products keep the exact routes even when approximate (bfloat16) products are
# allowed: against llama.cpp (tests/test_parity_llamacpp.py, the AMX Xeon of 2026-12-05) Gemma 3
# 270M's max |dlogprob| is 0.326 on the float route and 0.308-0.356 on the amx route, depending on
# which layers take it (its fused layers in parts kept strip: 0.356, past the bound of 0.35, with
# one position's top-3 swapped). At the bound's edge, its products stay exact.
EXACT_ONLY_ARCHITECTURES = {"gemma3": "bfloat16 products reach the llama.cpp parity bound (up to 0.356 > 0.35)"}
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


def kv_cache_bytes(config: ModelConfig, num_tokens: int, dtype: torch.dtype, engine_config=None) -> int:
    """The K and V the cache of num_tokens slots keeps resident at most: 2 x [num_tokens, KH, D]
    in dtype per full-attention layer, and per sliding-window layer (engine_config given: its
    max_num_seqs, max_num_batched_tokens, block_size and num_speculative_tokens) only what the
    block manager lets it hold: each running sequence's window, the tick's prefill rows, and the
    finished windows kept for prefix matches (engine.core.block_manager), capped at num_tokens.
    Without engine_config, or with blocks smaller than a page (their pages are not given back),
    every layer counts num_tokens."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    token_bytes = 2 * config.num_kv_heads * config.head_dim * itemsize
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    total = 0
    for window in windows:
        tokens = num_tokens
        if window is not None and engine_config is not None:
            bs = engine_config.block_size
            if bs * token_bytes // 2 >= mmap.PAGESIZE:
                per_seq = window_blocks(window, bs) + -(-engine_config.num_speculative_tokens // bs)
                blocks = 2 * engine_config.max_num_seqs * per_seq + -(-engine_config.max_num_batched_tokens // bs)
                tokens = min(num_tokens, blocks * bs)
        total += tokens * token_bytes
    return total


class DecoderLayer(nn.Module):
    """One block of every family: [pre-norm] attention [post-norm] + residual, then [pre-norm]
    FFN (dense SwiGLU/GeGLU, or mixture of experts) [post-norm] + residual. Which norms exist,
    the q/k norms, the activation, attention scale, soft-cap, window and RoPE table come from
    the config (engine.models.families); weights a family lacks are None."""

    def __init__(self, config: ModelConfig, weights: dict[str, Weight | None], layer_index: int,
                 pack_weights: bool = True, exact_products: bool = False,
                 dense_above_rows: int | None = None):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.window = config.layer_window(layer_index)
        self.rope_index = 1 if config.rope_local_theta is not None and self.window is not None else 0
        self.scale = config.attention_scale or config.head_dim ** -0.5
        self.softcap = config.attn_logit_softcap
        self.qk_norm = config.qk_norm
        self.residual_scale = config.residual_scale
        self.hidden_act = config.hidden_act
        def norm(name: str) -> nn.Parameter | None:
            return None if weights[name] is None else nn.Parameter(weights[name], requires_grad=False)

        self.attn_norm, self.ffn_norm = norm("attn_norm"), norm("ffn_norm")  # [E] (None: no pre-norm)
        self.post_attn_norm, self.post_ffn_norm = norm("post_attn_norm"), norm("post_ffn_norm")  # [E]
        self.q_norm, self.k_norm = norm("q_norm"), norm("k_norm")  # [D] ("head") or [H D] / [KH D] ("all")
        linear = dict(pack=pack_weights, exact=exact_products, dense_above_rows=dense_above_rows)
        self.qkv_proj = Linear(weights["wqkv"], weights["bqkv"], **linear)  # [(H + 2 KH) D, E]
        self.o_proj = Linear(weights["wo"], weights["bo"], **linear)  # [E, H D]
        if weights.get("experts") is not None:
            self.moe = MixtureOfExperts(weights["router"], weights["experts"], config.num_experts_per_tok,
                                        config.norm_topk_prob, self._act_mul, linear)
            self.gate_up_proj = self.down_proj = None
        else:
            self.moe = None
            self.gate_up_proj = Linear(weights["w_gate_up"], None, **linear)  # [2 I, E]
            self.down_proj = Linear(weights["w_down"], None, **linear)  # [E, I]
        self.norm_shape = (config.hidden_size,)
        self.intermediate_size = config.intermediate_size

    def _act_mul(self, gate_up: torch.Tensor, step: fused.FusedStep | None = None) -> torch.Tensor:
        """gate_up [T, 2 I] -> act(gate) * up [T, I]."""
        if step is not None:
            return step.glu_mul(gate_up, 0 if self.hidden_act == "silu" else 1)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.hidden_act == "silu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh") * up

    def _ffn(self, h: torch.Tensor, step: fused.FusedStep | None = None) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(h)
        return self.down_proj(self._act_mul(self.gate_up_proj(h), step))  # [T, E]

    def _norm_qk(self, qkv: torch.Tensor, step: fused.FusedStep | None = None) -> None:
        """q and k RMSNorm in place in qkv [T, (H + 2 KH) D] (before RoPE)."""
        num_rows, D = qkv.shape[0], self.head_dim
        if step is not None:  # the C kernel: per head ("head") or over all of q and all of k
            per_head = self.qk_norm == "head"
            step.norm_pieces(qkv, self.q_norm, self.num_heads if per_head else 1)
            step.norm_pieces(qkv, self.k_norm, self.num_kv_heads if per_head else 1, self.q_size)
            return
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size: self.q_size + self.kv_size]
        if self.qk_norm == "head":
            q.copy_(F.rms_norm(q.view(num_rows, -1, D), (D,), self.q_norm, self.eps).view(num_rows, -1))
            k.copy_(F.rms_norm(k.view(num_rows, -1, D), (D,), self.k_norm, self.eps).view(num_rows, -1))
        else:
            q.copy_(F.rms_norm(q, (self.q_size,), self.q_norm, self.eps))
            k.copy_(F.rms_norm(k, (self.kv_size,), self.k_norm, self.eps))

    def _out(self, y: torch.Tensor, post_norm: torch.Tensor | None,
             step: fused.FusedStep | None = None) -> torch.Tensor:
        """A block's output before the residual add, with the family's post-norm and residual scale."""
        if (post_norm is not None and step is not None and y.is_contiguous() and y.dtype == step.dtype
                and y.shape[0] == step.num_rows):
            step.norm_pieces(y, post_norm, 1)  # in place: y is this block's own product output
        elif post_norm is not None:
            y = F.rms_norm(y.float(), self.norm_shape, post_norm.float(), self.eps).to(y.dtype)
        if self.residual_scale != 1.0:
            y = y * self.residual_scale
        return y

    def _pre(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else F.rms_norm(x, self.norm_shape, weight, self.eps)

    def forward(self, x, ropes, k_cache, v_cache, plans):
        num_rows = x.shape[0]  # x [T, E]
        cos, sin = ropes[self.rope_index]
        plan = plans[self.window is not None]
        qkv = self.qkv_proj(self._pre(x, self.attn_norm))  # [T, (H + 2 KH) D]
        if self.qk_norm is not None:
            self._norm_qk(qkv)
        qk = qkv[:, : self.q_size + self.kv_size].view(num_rows, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, cos, sin)  # [T, H + KH, D]
        q = qk[:, : self.num_heads]  # [T, H, D]
        k = qk[:, self.num_heads:]  # [T, KH, D]
        v = qkv[:, self.q_size + self.kv_size:].view(num_rows, self.num_kv_heads, self.head_dim)  # [T, KH, D]
        k_cache.index_copy_(0, plan.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, plan.slot_mapping, v.to(v_cache.dtype))
        attn = paged_attention(q, k, v, k_cache, v_cache, plan, self.scale, self.softcap)  # [T, H D]
        x = x + self._out(self.o_proj(attn), self.post_attn_norm)  # [T, E]
        return x + self._out(self._ffn(self._pre(x, self.ffn_norm)), self.post_ffn_norm)  # [T, E]

    def forward_fused(self, resid: torch.Tensor, delta: torch.Tensor | None, step: fused.FusedStep,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, ropes, plans) -> torch.Tensor:
        """resid [T, E] float32 += delta (the previous layer's output, None for the first layer),
        in place -> this layer's output [T, E] in the compute dtype (added by the next call)."""
        num_rows = resid.shape[0]
        plan = plans[self.window is not None]
        h = self._fused_pre(step, resid, delta, self.attn_norm)  # [T, E]
        qkv = self.qkv_proj(h)  # [T, (H + 2 KH) D]
        if self.qk_norm is not None:
            self._norm_qk(qkv, step)
        step.rope_kv(qkv, k_cache, v_cache, *ropes[self.rope_index])  # q, k rotated; k, v cached
        if plan.has_prefill or not plan.is_fused:
            H, KH, D = self.num_heads, self.num_kv_heads, self.head_dim
            q = qkv[:, : self.q_size].view(num_rows, H, D)  # [T, H, D]
            k = qkv[:, self.q_size: self.q_size + self.kv_size].view(num_rows, KH, D)  # [T, KH, D]
            v = qkv[:, self.q_size + self.kv_size:].view(num_rows, KH, D)  # [T, KH, D]
            attn = paged_attention(q, k, v, k_cache, v_cache, plan, self.scale, self.softcap)  # [T, H D]
        else:
            attn = step.decode_attention(qkv, k_cache, v_cache, plan, self.scale)  # [T, H D]
        h = self._fused_pre(step, resid, self._out(self.o_proj(attn), self.post_attn_norm, step), self.ffn_norm)
        return self._out(self._ffn(h, step), self.post_ffn_norm, step)  # [T, E]

    def _fused_pre(self, step: fused.FusedStep, resid: torch.Tensor, delta: torch.Tensor | None,
                   weight: torch.Tensor | None) -> torch.Tensor:
        """resid += delta; -> the pre-norm of resid (OLMo 2 has none: resid in the compute dtype)."""
        if weight is not None:
            return step.norm(resid, delta, weight)
        if delta is not None:
            resid += delta.float()
        return resid.to(step.dtype, copy=True)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, state_dict: dict[str, Weight], dtype: str | torch.dtype = "float32",
                 rope_freq_factors: torch.Tensor | None = None, pack_weights: bool = True,
                 dense_above_rows: int | None = None, exact_products: bool = False,
                 approximate_products: bool | None = None,
                 kv_cache_dtype: str | torch.dtype | None = None, activations: str = "int16"):
        """state_dict: Hugging Face names -> dense tensors, or the quantized formats of
        engine.models.quant (Int4Weight / Int5Weight / Int8Weight for projections; Int8Weight
        also for the embedding and head), as the loader chose (engine.loader). Each entry is
        read once, layer by layer, so a lazy mapping (the GGUF loader's) converts one tensor at
        a time. pack_weights: lay dense projection weights out for oneDNN once.
        dense_above_rows: quantized projections also keep a dense copy for larger products.
        exact_products: quantized products are the float32 products of the dequantized weights
        (else the C kernels of cext.qgemm, whose decode-sized batches quantize the activations
        to int16 codes per block of 32: engine.models.linear), whatever the activation dtype.
        approximate_products: the decoder layers' quantized products may take the amx route
        (bfloat16 weights, activations and outputs on AMX tiles) at the row counts where it
        measured fastest (engine.models.routes); the head's never do. None (the default): only
        with ``ENGINE_AMX=1`` in the environment (opt-in: at a near-tie its rounding can swap
        llama.cpp's 3rd and 4th token, tests/test_parity_engine.py). The routes chosen are in
        ``product_routes``. Never for the architectures in EXACT_ONLY_ARCHITECTURES (Gemma 3):
        True raises ValueError, ``ENGINE_AMX=1`` logs and keeps them exact.
        activations: "int16" (the default) or "int8": the integer codes the
        packed (AVX2 and up) projections and head quantize their activations to (engine.config's
        ACTIVATIONS; int8 is llama.cpp's precision at about 1.6x the multi-row products' speed with
        AVX-512 VNNI, int16's speed on AVX2);
        ``int8_layers`` counts the layers that took int8."""
        super().__init__()
        self.config = config
        self.dtype = resolve_dtype(dtype)
        self.vocab_size = config.vocab_size
        self.max_model_len = config.max_position_embeddings
        weights = _WeightReader(state_dict, self.dtype)
        E, V = config.hidden_size, config.vocab_size
        self.layers = nn.ModuleList(
            DecoderLayer(config, _layer_weights(config, weights, i), i, pack_weights, exact_products,
                         dense_above_rows)
            for i in range(config.num_layers))
        self.norm = nn.Parameter(weights.take("model.norm.weight", (E,)), requires_grad=False)  # [E]
        embed = weights.take("model.embed_tokens.weight", (V, E))
        head = embed if config.tie_word_embeddings else weights.take("lm_head.weight", (V, E))
        # The embedding: a dense table [V, E] (F.embedding), or rows looked up from a quantized
        # source (Int8Weight, or the loader's MappedRows: anything with .rows(ids, dtype)).
        self.embed_rows = None if isinstance(embed, torch.Tensor) else embed
        self.embed = None if self.embed_rows is not None else nn.Parameter(embed, requires_grad=False)  # [V, E]
        # The head: a packed copy for the product; the dense lm_head stays (bfloat16 refinement).
        is_int8 = isinstance(head, (Int8Weight, PackedInt8Weight))
        self.lm_head = None if is_int8 else (
            self.embed if config.tie_word_embeddings else nn.Parameter(head, requires_grad=False))  # [V, E]
        self.head_int8 = head if is_int8 else None
        self.head_proj = Linear(self.head_int8 or self.lm_head, None, pack_weights, keep_dense=True,
                                exact=exact_products)
        if self.head_int8 is not None and self.head_proj.is_packed_strips:
            # the product's strips hold the codes: lookups read them there (one copy of a tied head)
            rows = StripRows(self.head_proj, self.head_int8)
            if self.embed_rows is self.head_int8:
                self.embed_rows = rows
            self.head_int8 = rows
        self.rope = RotaryTable(config, self.dtype, rope_freq_factors)
        # Gemma 3's sliding layers rotate with a base of their own (and no scaling).
        self.local_rope = None if config.rope_local_theta is None else RotaryTable(
            replace(config, rope_theta=config.rope_local_theta, rope_scaling=None), self.dtype)
        self.ropes = [self.rope] if self.local_rope is None else [self.rope, self.local_rope]
        windows = {config.layer_window(i) for i in range(config.num_layers)} - {None}
        if len(windows) > 1:
            raise ValueError(f"sliding windows: one size for every sliding layer, got {sorted(windows)}")
        self.window = windows.pop() if windows else None
        # Soft-capped attention scores (Gemma 2) have no fused decode kernel: the torch path's.
        self.fused_decode = config.attn_logit_softcap is None
        # The KV cache's dtype (None: the activations'). The loaders pick float16 beside float32
        # activations for quantized weights (as llama.cpp keeps K and V): a decode step reads
        # the whole context's K and V, so at long contexts their bytes rival the weights'.
        self.kv_cache_dtype = self.dtype if kv_cache_dtype is None else _resolve_kv_dtype(kv_cache_dtype)
        self.use_fused = fused.default_enabled()  # C kernels between the matmuls (else the torch reference)
        # A decode forward's layers in one C call (engine.models.decode_program), made per batch
        # size on first use; off: the per-layer calls (ENGINE_DECODE_PROGRAM=0, or this attribute)
        self.use_decode_program = os.environ.get("ENGINE_DECODE_PROGRAM", "1") != "0"
        self.decode_programs = decode_program.Programs()
        self.decode_buffers = decode_program.DecodeBuffers()
        num_threads = torch.get_num_threads()
        layers = [part for layer in self.layers
                  for proj in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
                  if proj is not None  # MoE layers: no dense gate/up
                  for part in (proj.parts or [proj])]  # a fused layer in parts: each calibrated, each int8
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.activations = activations
        experts = [proj for layer in self.layers if layer.moe is not None
                   for pair in layer.moe.experts for proj in pair]
        self.int8_layers = 0 if activations == "int16" else sum(
            proj.use_int8_activations() for proj in (*layers, *experts, self.head_proj))
        if self.head_is_refined:
            # Its REFINE_TOP_K best logits a row are recomputed from the exact rows whatever the
            # product's codes, so int8 codes change only the tail's values (already re-quantized
            # weights'): Qwen2.5-Coder-1.5B's head at 16 rows 22.7 -> ~13 ms of a ~170 ms step.
            self.head_proj.use_int8_activations()
        # Prompt attention's products on AMX tiles where the CPU has them (16 significant bits of each
        # operand, as the amx3 route keeps: engine.models.fused.prefill_attention) when this model's
        # own products round (the quantized kernels', bfloat16 weights); float32 attention beside
        # float32 products (dense float32 weights, exact_products).
        self.tile_attention = any(not p.is_exact for p in layers)
        allow_amx = self._allows_approximate(approximate_products) and not exact_products
        self.product_routes = routes.calibrate(layers, allow_amx, num_threads)
        self.product_routes.update(routes.calibrate([self.head_proj], False, num_threads))
        if self.product_routes:
            log.info("product routes (rows: route): %s", routes.describe(self.product_routes))

    def _allows_approximate(self, asked: bool | None) -> bool:
        """Whether the amx route may run this model's products: ``asked`` (None: ``ENGINE_AMX=1``
        in the environment), never for EXACT_ONLY_ARCHITECTURES (asked by argument: ValueError;
        by the environment, which covers every model a process loads: logged, kept exact)."""
        why = EXACT_ONLY_ARCHITECTURES.get(self.config.architecture)
        if asked is None:
            asked = os.environ.get("ENGINE_AMX") == "1"
            if asked and why:
                log.warning("ENGINE_AMX=1: %s keeps its exact routes (%s)", self.config.architecture, why)
                return False
        elif asked and why:
            raise ValueError(f"approximate_products: not for {self.config.architecture} models ({why})")
        return asked

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, E] in the model dtype."""
        if self.embed_rows is not None:
            x = self.embed_rows.rows(ids, self.dtype)
        else:
            x = F.embedding(ids, self.embed)
        if self.config.embedding_scale != 1.0:
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        return x

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> the head's rows [..., E] in float32 (the weights the product used)."""
        if self.head_int8 is not None:
            return self.head_int8.rows(ids, torch.float32)
        return self.lm_head[ids].float()

    def kv_cache_bytes(self, num_tokens: int, engine_config=None) -> int:
        """Bytes of K and V the cache of num_tokens slots keeps resident at most (checked before it is
        allocated; see kv_cache_bytes)."""
        return kv_cache_bytes(self.config, num_tokens, self.kv_cache_dtype, engine_config)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        c = self.config
        sliding = tuple(i for i, layer in enumerate(self.layers) if layer.window is not None)
        return PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, self.kv_cache_dtype,
                            sliding)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """-> logits [len(batch.logit_rows), vocab_size] float32."""
        return self._logits(batch, self.forward_hidden(batch, kv_cache))

    def _logits(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The head over hidden [S, E] of the logit rows: a tick of decode and verification rows
        only (batch.route_spans) by the route of plain decoding's batch, else by S."""
        spans = batch.route_spans()
        decoding = batch.gen_rows > 0 and spans[:1] == ((batch.gen_rows, batch.gen_seqs),)
        with row_routes(((hidden.shape[0], batch.gen_seqs),) if decoding else ()):
            return self.finish_logits(self.compute_logits(hidden, batch.logits_out))

    @torch.inference_mode()
    def forward_with_hidden(self, batch: ForwardBatch, kv_cache: PagedKVCache,
                            hidden_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward -> (logits [S, V] of batch.logit_rows, final-normed hidden states [R, E] of
        ``hidden_rows``): a generation tick that carries pooled embedding rows (engine/embedding/tick_rows.py)."""
        logit_rows = batch.logit_rows
        num_logits = logit_rows.shape[0]
        batch.logit_rows = torch.cat([logit_rows, hidden_rows])
        try:
            hidden = self.forward_hidden(batch, kv_cache)  # [S + R, E]
        finally:
            batch.logit_rows = logit_rows
        if num_logits:
            logits = self._logits(batch, hidden[:num_logits])
        else:
            logits = torch.empty((0, self.vocab_size), dtype=torch.float32)
        return logits, hidden[num_logits:]

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """-> the final-normed hidden states of batch.logit_rows [S, E] (the head's input;
        pooled embeddings read them, engine/embedding)."""
        for rope in self.ropes:
            rope.ensure(max(batch.context_lens_list))
        with row_routes(batch.route_spans()):
            if self.use_fused:
                return self._forward_fused(batch, kv_cache)
            return self._forward_plain(batch, kv_cache)

    def _forward_plain(self, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        plans = self._plans(batch, is_fused=False)
        ropes = [rope.lookup(batch.positions) for rope in self.ropes]  # cos, sin [T, 1, D]
        x = self.embed_tokens(batch.input_ids)  # [T, E]
        for i, layer in enumerate(self.layers):
            x = layer(x, ropes, kv_cache.k[i], kv_cache.v[i], plans)
        x = x.index_select(0, batch.logit_rows)  # [S, E]
        return F.rms_norm(x, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)

    def _plans(self, batch: ForwardBatch, is_fused: bool) -> tuple[AttentionPlan, AttentionPlan]:
        """(full-attention plan, sliding-window plan): one plan when every layer is one kind.
        Verification rows attend as decode rows (engine.batch.verify_rows_as_decodes)."""
        if batch.gen_rows > batch.num_decode_seqs:
            batch = verify_rows_as_decodes(batch)
        has_full = any(layer.window is None for layer in self.layers)
        full = plan_attention(batch, None, self.dtype, is_fused, self.tile_attention) if has_full else None
        if self.window is None:
            return full, full
        return full, plan_attention(batch, self.window, self.dtype, is_fused, self.tile_attention)

    def _forward_fused(self, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        plans = self._plans(batch, is_fused=self.fused_decode)
        positions = batch.positions  # [T]
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        ropes = [(rope.cos_half, rope.sin_half) for rope in self.ropes]  # [P, D/2] float32
        resid = self.embed_tokens(batch.input_ids).float()  # [T, E] float32 residual stream
        program = decode_program.program_for(self, batch, kv_cache, plans)
        if program is not None and self.decode_buffers.lock.acquire(blocking=False):
            try:  # every layer in one C call: the loop's calls below, with their arguments
                return self._final_norm(batch, resid, program.run(self, resid, positions, plans, ropes))
            finally:
                self.decode_buffers.lock.release()
        c = self.config
        step = fused.FusedStep(positions.shape[0], self.dtype, c.hidden_size, c.intermediate_size, c.rms_norm_eps,
                               c.num_heads, c.num_kv_heads, c.head_dim, positions, self.rope.cos_half,
                               self.rope.sin_half, plans[0] or plans[1])
        delta = None
        for i, layer in enumerate(self.layers):
            delta = layer.forward_fused(resid, delta, step, kv_cache.k[i], kv_cache.v[i], ropes, plans)
        return self._final_norm(batch, resid, delta)

    def _final_norm(self, batch: ForwardBatch, resid: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The last residual add and the final norm, for the logit rows -> [S, E]."""
        rows = batch.logit_rows
        return fused.add_rmsnorm(resid.index_select(0, rows), delta.index_select(0, rows), self.norm,
                                 self.config.rms_norm_eps)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The family's last step on the logits [S, V]: Granite's scale, Gemma 2's soft-cap."""
        c = self.config
        if c.logit_scale != 1.0:
            logits.mul_(c.logit_scale)
        if c.final_logit_softcap is not None:
            logits.div_(c.final_logit_softcap).tanh_().mul_(c.final_logit_softcap)
        return logits

    @property
    def head_is_refined(self) -> bool:
        """Whether compute_logits recomputes each row's best logits from the exact rows: the head's
        product is not the source's own weights (a re-quantized or bfloat16 head)."""
        is_exact_int8 = self.head_int8 is not None and self.head_int8.is_exact and not self.head_proj.exact
        return not (self.head_proj.is_exact or is_exact_int8)

    def compute_logits(self, x: torch.Tensor, buffer: LogitsBuffer | None = None) -> torch.Tensor:
        """x [S, E] (final-normed) -> logits [S, V] float32, written into ``buffer`` when one is given
        (the engine's, reused across ticks: engine.batch.LogitsBuffer).

        When the head's product is not a float32 product of the source's own weights (a
        bfloat16 head rounds logits to 8 mantissa bits, 0.06 at a logit of 15; a head
        re-quantized to int8 from another type moves them too), near-equal candidates can tie
        or swap. The top REFINE_TOP_K logits of each row are then recomputed with a float32
        product of the exact rows; the tail keeps the approximate values (its probability mass
        is negligible). A Q8_0 head in the C kernels needs none of this: its codes are the
        file's, and the kernels' int16 activation codes err by less than 2^-15 per element.
        """
        # A quantized head takes float32 in, so gives float32 out: a bfloat16 model's logits keep
        # their float32 sums (bfloat16 ones tie at a step of 0.06 near 15: on a Zen 4 that put a
        # wrong top-1 against llama.cpp's). A dense head multiplies in its own dtype (refined below).
        dense = self.head_proj.format == "dense"  # oneDNN makes its own output: the buffer would be a copy
        out = None if buffer is None or dense else buffer.take(x.shape[0], self.head_proj.out_features)
        logits = self.head_proj(x if dense else x.float(), out).float()  # [S, V]
        if not self.head_is_refined or logits.shape[0] == 0:
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
    """Layer i's weights by the family's names (engine.models.families), q/k/v and gate/up fused."""
    E, I, D = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_heads * D, config.num_kv_heads * D

    def take(role: str, shape: tuple[int, ...], optional: bool = False, expert: int | None = None):
        name = hf_layer_name(config.architecture, role, i, expert)
        return None if name is None else weights.take(name, shape, optional)

    if hf_layer_name(config.architecture, "qkv", i):
        wqkv = take("qkv", (q_size + 2 * kv_size, E))  # Phi-3: fused in the file
    else:
        wqkv = cat_rows([take("q", (q_size, E)), take("k", (kv_size, E)), take("v", (kv_size, E))])
    biases = [take(f"{n}_bias", (size,), optional=not config.attention_bias)
              for n, size in (("q", q_size), ("k", kv_size), ("v", kv_size))]
    if any(b is not None for b in biases):
        biases = [torch.zeros(size, dtype=weights.dtype) if b is None else b
                  for b, size in zip(biases, (q_size, kv_size, kv_size))]
        bqkv = torch.cat(biases)  # [(H + 2 KH) D]
    else:
        bqkv = None
    qk_shapes = ((D,), (D,)) if config.qk_norm == "head" else ((q_size,), (kv_size,))
    out = {
        "attn_norm": take("attn_norm", (E,)) if config.pre_norms else None,
        "ffn_norm": take("ffn_norm", (E,)) if config.pre_norms else None,
        "post_attn_norm": take("post_attn_norm", (E,)) if config.post_norms else None,
        "post_ffn_norm": take("post_ffn_norm", (E,)) if config.post_norms else None,
        "q_norm": take("q_norm", qk_shapes[0]) if config.qk_norm else None,
        "k_norm": take("k_norm", qk_shapes[1]) if config.qk_norm else None,
        "wqkv": wqkv,  # [(H + 2 KH) D, E]
        "bqkv": bqkv,
        "wo": take("o", (E, q_size)),
        "bo": take("o_bias", (E,), optional=True),
    }
    if config.is_moe_layer(i):
        X, MI = config.num_experts, config.moe_intermediate_size
        out["router"] = take("router", (X, E))  # [X, E]
        out["experts"] = [(cat_rows([take("expert_gate", (MI, E), expert=j),
                                     take("expert_up", (MI, E), expert=j)]),  # [2 MI, E]
                           take("expert_down", (E, MI), expert=j)) for j in range(X)]  # [E, MI]
    elif hf_layer_name(config.architecture, "gate_up", i):
        out["w_gate_up"] = take("gate_up", (2 * I, E))  # Phi-3: fused in the file
        out["w_down"] = take("down", (E, I))
    else:
        out["w_gate_up"] = cat_rows([take("gate", (I, E)), take("up", (I, E))])  # [2 I, E]
        out["w_down"] = take("down", (E, I))
    if config.rotary_dim is not None and config.rotary_dim < D:
        _interleave_partial_rotary(out, config)
    return out


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A head's dims reordered so the "rotate half" of all D dims rotates just the first
    rotary_dim ones (Phi's partial rotary): [r0, pass0, r1, pass1], where r0 and r1 are the two
    halves of the rotated dims and pass0, pass1 the two halves of the rest; the RoPE table's
    frequencies for the pass pairs are 0 (cos 1, sin 0). q and k reordered alike keep q . k."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(0, half), torch.arange(rotary_dim, rotary_dim + rest),
                      torch.arange(half, rotary_dim), torch.arange(rotary_dim + rest, head_dim)])


def _interleave_partial_rotary(weights: dict, config: ModelConfig) -> None:
    D = config.head_dim
    order = partial_rotary_order(D, config.rotary_dim)
    num_rot = config.num_heads + config.num_kv_heads
    rows = torch.cat([h * D + order for h in range(num_rot)]
                     + [torch.arange(num_rot * D, (num_rot + config.num_kv_heads) * D)])  # v rows stay
    weights["wqkv"] = _map_rows(weights["wqkv"], rows)
    if weights["bqkv"] is not None:
        weights["bqkv"] = weights["bqkv"][rows]
    if config.qk_norm == "head":
        weights["q_norm"], weights["k_norm"] = weights["q_norm"][order], weights["k_norm"][order]
    elif config.qk_norm == "all":  # over all heads: the same reorder per head
        q_size = config.num_heads * D
        weights["q_norm"] = weights["q_norm"][rows[:q_size]]
        weights["k_norm"] = weights["k_norm"][rows[q_size: num_rot * D] - q_size]


def _map_rows(weight: Weight, rows: torch.Tensor) -> Weight:
    if isinstance(weight, torch.Tensor):
        return weight[rows].contiguous()
    if not hasattr(weight, "map_rows"):  # Q6_K strips (or parts with them) keep whole strips: int8, reordered
        weight = Int8Weight.from_dense(weight.dequantize())
    return weight.map_rows(lambda t: t[rows].contiguous())
