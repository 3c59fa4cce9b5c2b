"""A decode forward's decoder layers in one C call (cext.ops.decode_layers).

The fused forward (LlamaModel._forward_fused) calls ~10 C kernels per layer through Python:
FusedStep's wrappers and Linear's route choice, ~35 us of interpreter per layer, 1.1 ms of a
5 ms SmolLM2 decode step (a fifth of it) and 1 ms of Qwen2.5-0.5B's 14.6 ms. A decode forward's
layers make the same calls with the same arguments every step but for the rows' positions,
slots and block tables, so those arguments are gathered once per batch size into a program
(one int64 row per layer: weight, norm and cache addresses, the products' layouts with their
routes) and ``decode_layers`` runs it with the GIL released once. Same kernels, same arguments,
same order: the same bits as the per-layer path (tests/test_decode_program.py).

Only the common block runs here: pre-norms, optional q/k norms and post-norms, SiLU or
GELU-tanh gating, no residual scale, no mixture of experts, every product on a C kernel route,
every row a decode row (or a verification row planned as one) and at most KERNEL_BLOCK_ROWS
rows. Anything else (a prompt chunk, Granite's multipliers, MoE, OLMo 2's missing pre-norms, a
dense or exact product) takes the per-layer path.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from . import linear
from .fused import _CACHE_CODES, _DTYPE_CODES

try:
    from cext import cpu, ops, qgemm
except ImportError:  # no C extensions: the per-layer path (which then needs none of this)
    ops = None


class DecodeBuffers:
    """The activations a program's calls write, one set per model shared by its programs:
    [capacity, width] tensors whose first T rows serve a forward of T rows (rows are contiguous,
    so the addresses do not depend on T). They grow to the largest decode batch seen (at most
    KERNEL_BLOCK_ROWS rows: Qwen2.5-0.5B's widths take 77 KB a row) and stay."""

    __slots__ = ("capacity", "tensors", "pointers", "lock")

    def __init__(self):
        self.lock = threading.Lock()  # the buffers serve one forward at a time (else: the per-layer path)
        self.capacity = 0
        self.tensors: list[torch.Tensor] = []
        self.pointers: np.ndarray | None = None

    def ensure(self, model, num_rows: int) -> np.ndarray:
        """The buffers' addresses for num_rows rows (made anew when they hold fewer)."""
        if num_rows > self.capacity:
            c = model.config
            widths = {ops.B_H: c.hidden_size, ops.B_QKV: (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                      ops.B_ATTN: c.num_heads * c.head_dim, ops.B_O: c.hidden_size,
                      ops.B_GATE_UP: 2 * c.intermediate_size, ops.B_ACT: c.intermediate_size,
                      ops.B_DOWN: c.hidden_size}
            self.tensors = [torch.empty((num_rows, widths[b]), dtype=model.dtype) for b in range(ops.BUFFERS)]
            self.pointers = np.array([t.data_ptr() for t in self.tensors], dtype=np.int64)
            self.capacity = num_rows
        return self.pointers


class Programs(dict):
    """A model's programs (None: that key runs per layer), by batch size and routes, for one KV
    cache at a time: they hold its addresses and keep it alive, so another cache drops them."""

    __slots__ = ("kv_cache",)

    def __init__(self):
        super().__init__()
        self.kv_cache = None

    def use_cache(self, kv_cache) -> None:
        if self.kv_cache is not kv_cache:
            self.clear()
            self.kv_cache = kv_cache


class DecodeProgram:
    """The layers' constant arguments for one batch size (the products' routes depend on it)."""

    __slots__ = ("num_rows", "kv_cache", "table", "scales")

    def __init__(self, model, kv_cache, num_rows: int, route_rows: int):
        self.num_rows = num_rows
        self.kv_cache = kv_cache  # kept: the program holds its addresses
        table = np.zeros((len(model.layers), ops.LAYER_FIELDS), dtype=np.int64)
        for i, layer in enumerate(model.layers):
            row = table[i]
            row[ops.L_ATTN_NORM] = layer.attn_norm.data_ptr()
            row[ops.L_FFN_NORM] = layer.ffn_norm.data_ptr()
            row[ops.L_POST_ATTN_NORM] = 0 if layer.post_attn_norm is None else layer.post_attn_norm.data_ptr()
            row[ops.L_POST_FFN_NORM] = 0 if layer.post_ffn_norm is None else layer.post_ffn_norm.data_ptr()
            if layer.qk_norm is not None:  # DecoderLayer._norm_qk's calls
                per_head = layer.qk_norm == "head"
                row[ops.L_Q_NORM], row[ops.L_K_NORM] = layer.q_norm.data_ptr(), layer.k_norm.data_ptr()
                row[ops.L_Q_HEADS] = layer.num_heads if per_head else 1
                row[ops.L_K_HEADS] = layer.num_kv_heads if per_head else 1
                row[ops.L_QK_DIM] = layer.q_norm.shape[0]  # layers_fit: k's norm has its width
            k_cache, v_cache = kv_cache.k[i], kv_cache.v[i]
            row[ops.L_K_CACHE], row[ops.L_V_CACHE] = k_cache.data_ptr(), v_cache.data_ptr()
            row[ops.L_NUM_SLOTS] = k_cache.shape[0]
            row[ops.L_CACHE_DTYPE] = _CACHE_CODES[k_cache.dtype]
            row[ops.L_ROPE] = layer.rope_index
            row[ops.L_PLAN] = int(layer.window is not None)
            row[ops.L_ACT] = ops.ACT_SILU if layer.hidden_act == "silu" else ops.ACT_GELU_TANH
            qkv = layer.qkv_proj.parts or [layer.qkv_proj]  # a second part: products' fifth slot
            products = (qkv[0], layer.o_proj, layer.gate_up_proj, layer.down_proj, *qkv[1:])
            for k, lin in enumerate(products):
                at = ops.PRODUCTS + k * ops.PRODUCT_FIELDS
                row[at + ops.P_LAYOUT] = lin.kernel_layout(lin._way(route_rows))  # as Linear.run
                row[at + ops.P_ROWS] = lin._rows.data_ptr()
                row[at + ops.P_SCALES] = 0 if lin._scales is None else lin._scales.data_ptr()
                row[at + ops.P_BIAS] = 0 if lin.bias is None else lin.bias.data_ptr()
                row[at + ops.P_OUT], row[at + ops.P_IN] = lin.out_features, lin.in_features
        self.table = table
        self.scales = np.array([layer.scale for layer in model.layers], dtype=np.float64)

    def run(self, model, resid: torch.Tensor, positions: torch.Tensor, plans, ropes) -> torch.Tensor:
        """resid [T, E] float32 (updated in place) -> the last layer's output [T, E] (the model's
        buffer: valid until its next decode forward)."""
        c = model.config
        plan_args = np.zeros(2 * ops.PLAN_FIELDS, dtype=np.int64)
        for k, plan in enumerate(plans):
            if plan is not None:
                plan_args[k * ops.PLAN_FIELDS: (k + 1) * ops.PLAN_FIELDS] = (
                    plan.block_tables.data_ptr(), plan.block_tables.shape[1], plan.context_lens.data_ptr(),
                    plan.num_decode_seqs, plan.block_size, plan.sliding_window or 0)
        rope_args = np.zeros(2 * ops.ROPE_FIELDS, dtype=np.int64)
        for k, (cos, sin) in enumerate(ropes):
            rope_args[k * ops.ROPE_FIELDS: (k + 1) * ops.ROPE_FIELDS] = cos.data_ptr(), sin.data_ptr(), cos.shape[0]
        slots = (plans[0] or plans[1]).slot_mapping
        buffers = model.decode_buffers
        pointers = buffers.ensure(model, self.num_rows)
        ops.decode_layers(self.table, self.scales, resid.data_ptr(), self.num_rows, c.hidden_size, c.rms_norm_eps,
                          _DTYPE_CODES[model.dtype], c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                          positions.data_ptr(), slots.data_ptr(), rope_args, plan_args, pointers)
        return buffers.tensors[ops.B_DOWN][: self.num_rows]


def layers_fit(model) -> bool:
    """Whether every layer is the block decode_layers runs (checked as a program is made)."""
    if ops is None or model.dtype not in _DTYPE_CODES:
        return False
    for layer in model.layers:
        if (layer.attn_norm is None or layer.ffn_norm is None or layer.moe is not None
                or layer.residual_scale != 1.0 or layer.softcap is not None
                or layer.qk_norm not in (None, "head", "all")
                or (layer.qk_norm is not None and layer.q_norm.shape[0] != layer.k_norm.shape[0])):
            return False
        if layer.qkv_proj.parts is not None and len(layer.qkv_proj.parts) != 2:
            return False
        for lin in _products(layer):
            if lin.format == "dense" or lin.exact or lin.layout is None or lin._rows is None:
                return False
    return True


def program_for(model, batch, kv_cache, plans) -> DecodeProgram | None:
    """The model's program for this forward, or None: this forward takes the per-layer path.
    Programs are made on first use per batch size and route (the model's layers are taken as
    they are then: a model's structure does not change after load)."""
    num_rows = batch.num_tokens
    if not model.use_decode_program or num_rows > linear.KERNEL_BLOCK_ROWS:
        return None
    for plan in plans:
        if plan is not None and (not plan.is_fused or plan.has_prefill or plan.num_decode_seqs != num_rows):
            return None
    route_rows = linear.one_class_route_rows(num_rows)
    if route_rows is None:
        return None
    programs = model.decode_programs
    programs.use_cache(kv_cache)
    key = (num_rows, route_rows, cpu.get_isa(), qgemm.get_float_rows(), linear.route_epoch())
    program = programs.get(key, False)
    if program is False:
        if len(programs) >= MAX_PROGRAMS:
            programs.clear()
        program = programs[key] = (DecodeProgram(model, kv_cache, num_rows, route_rows)
                                   if _fits(model, route_rows) else None)
    return program


def _fits(model, route_rows: int) -> bool:
    """layers_fit, and every product on a C kernel route at route_rows rows."""
    return layers_fit(model) and all(
        linear.is_kernel_route(lin._way(route_rows)) for layer in model.layers for lin in _products(layer))


def _products(layer) -> list:
    """A layer's product layers: qkv (or its parts), o, gate_up, down."""
    return [*(layer.qkv_proj.parts or [layer.qkv_proj]), layer.o_proj, layer.gate_up_proj, layer.down_proj]


MAX_PROGRAMS = 64  # programs kept per model (one per batch size seen, for its one KV cache)
