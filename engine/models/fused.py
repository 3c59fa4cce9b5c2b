"""The small ops between the products (cext.ops) on torch tensors, and their torch references.

Each op has a kernel wrapper (checks dtypes, shapes and contiguity, then passes
``data_ptr()``s to C) and a ``*_reference`` twin in plain torch with the same contract,
which the tests compare against and which the model runs when the fused path is off.
Activations are float32 or bfloat16, KV caches float32, bfloat16 or float16; the residual
stream is float32; every kernel accumulates in float32 and rounds once on store.

The fused path is on by default where the compiled module exists; ``ENGINE_FUSED=0``
(read at model construction) or ``LlamaModel(..., use_fused=False)`` selects the
reference path.
"""
from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

try:
    from cext import ops
except ImportError:  # not built: the model falls back to the reference path
    ops = None

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_CACHE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # KV caches may also be float16


def is_available() -> bool:
    return ops is not None


def default_enabled() -> bool:
    """ENGINE_FUSED=0 turns the kernels off; otherwise on when the module is built."""
    return is_available() and os.environ.get("ENGINE_FUSED", "1") != "0"


def _code(t: torch.Tensor) -> int:
    code = _DTYPE_CODES.get(t.dtype)
    if code is None:
        raise ValueError(f"dtype: fused kernels take float32 or bfloat16, got {t.dtype}")
    return code


def _cache_code(t: torch.Tensor) -> int:
    code = _CACHE_CODES.get(t.dtype)
    if code is None:
        raise ValueError(f"k_cache/v_cache: float32, bfloat16 or float16, got {t.dtype}")
    return code


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


# ---- add + RMSNorm ----

def add_rmsnorm(resid: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """resid [T, E] float32 += delta [T, E] (in place); -> rmsnorm(resid) * weight [T, E] in weight's dtype."""
    num_rows, dim = resid.shape
    code = _code(weight)
    _require(resid.dtype == torch.float32 and resid.is_contiguous(), "resid: must be contiguous float32")
    _require(weight.shape == (dim,) and weight.is_contiguous(), "weight: must be contiguous [E]")
    if delta is not None:
        _require(delta.dtype == weight.dtype and delta.shape == resid.shape and delta.is_contiguous(),
                 "delta: must be contiguous [T, E] in the compute dtype")
    if out is None:
        out = torch.empty((num_rows, dim), dtype=weight.dtype)
    ops.add_rmsnorm(resid.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(),
                       out.data_ptr(), num_rows, dim, eps, code)
    return out


def add_rmsnorm_reference(resid: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                          eps: float) -> torch.Tensor:
    if delta is not None:
        resid += delta.float()
    return F.rms_norm(resid, (resid.shape[1],), weight.float(), eps).to(weight.dtype)


# ---- RoPE + KV write ----

def rope_kv_write(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, positions: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor) -> None:
    """qkv [T, >= (H + 2 KH) D] (rows contiguous): q and k rotated in place, k and v written to
    k_cache/v_cache [S, KH, D] at slots [T]. cos/sin [P, D/2] float32, positions [T] int64."""
    num_rows = qkv.shape[0]
    code = _code(qkv)
    _require(qkv.stride(1) == 1 and qkv.shape[1] >= (num_heads + 2 * num_kv_heads) * head_dim,
             "qkv: rows must be contiguous and hold q, k, v")
    cache_code = _cache_code(k_cache)
    _require(v_cache.dtype == k_cache.dtype, "k_cache/v_cache: must have one dtype")
    _require(k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
             and k_cache.shape[1:] == (num_kv_heads, head_dim), "k_cache/v_cache: must be contiguous [S, KH, D]")
    _require(cos.dtype == torch.float32 and sin.dtype == torch.float32 and cos.is_contiguous()
             and sin.is_contiguous() and cos.shape == sin.shape and cos.shape[1] == head_dim // 2,
             "cos/sin: must be contiguous float32 [P, D/2]")
    _require(positions.dtype == torch.int64 and slots.dtype == torch.int64 and positions.is_contiguous()
             and slots.is_contiguous() and positions.shape == (num_rows,) and slots.shape == (num_rows,),
             "positions/slots: must be contiguous int64 [T]")
    ops.rope_kv_write(qkv.data_ptr(), num_rows, qkv.stride(0), num_heads, num_kv_heads, head_dim,
                         positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], slots.data_ptr(),
                         k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], code, cache_code)


def rope_kv_write_reference(qkv, num_heads, num_kv_heads, head_dim, positions, cos, sin, slots, k_cache,
                            v_cache) -> None:
    num_rows, half = qkv.shape[0], head_dim // 2
    num_rot = num_heads + num_kv_heads
    x = qkv[:, : num_rot * head_dim].view(num_rows, num_rot, head_dim).float()  # [T, H + KH, D]
    c = cos[positions].unsqueeze(1)  # [T, 1, D/2]
    s = sin[positions].unsqueeze(1)
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)  # [T, H + KH, D]
    qkv[:, : num_rot * head_dim] = rotated.reshape(num_rows, -1).to(qkv.dtype)
    kv = qkv[:, num_heads * head_dim: (num_rot + num_kv_heads) * head_dim]
    k_cache[slots] = kv[:, : num_kv_heads * head_dim].reshape(num_rows, num_kv_heads, head_dim).to(k_cache.dtype)
    v_cache[slots] = kv[:, num_kv_heads * head_dim:].reshape(num_rows, num_kv_heads, head_dim).to(v_cache.dtype)


def _check_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> tuple[int, int]:
    """The checks paged decode and prefill attention share -> (q's dtype code, the cache's)."""
    head_dim = q.shape[2]
    _require(q.stride(2) == 1 and q.stride(1) == head_dim, "q: heads of a row must be contiguous")
    _require(v_cache.dtype == k_cache.dtype and k_cache.is_contiguous()
             and v_cache.is_contiguous() and k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim,
             "k_cache/v_cache: must be contiguous [S, KH, D] of one dtype")
    _require(q.shape[1] % k_cache.shape[1] == 0, "num_kv_heads: must divide num_heads")
    _require(k_cache.shape[0] % block_size == 0, "block_size: must divide the cache's slot count")
    return _code(q), _cache_code(k_cache)


# ---- paged decode attention ----

def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, sliding_window: int | None = None,
                     out: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """q [B, H, D] (rows may be strided, heads contiguous), caches [S, KH, D], block_tables
    [>= B, max_blocks] int64, context_lens [>= B] int64 -> [B, H * D] (softmax scale: 1/sqrt(D) if None)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    code, cache_code = _check_paged(q, k_cache, v_cache, block_size)
    _require(block_tables.dtype == torch.int64 and block_tables.is_contiguous() and block_tables.shape[0] >= num_seqs,
             "block_tables: contiguous int64 [>= B, max_blocks]")
    _require(context_lens.dtype == torch.int64 and context_lens.is_contiguous() and context_lens.shape[0] >= num_seqs,
             "context_lens: contiguous int64, one per sequence")
    if out is None:
        out = torch.empty((num_seqs, num_heads * head_dim), dtype=q.dtype)
    ops.decode_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                            k_cache.shape[0] // block_size, block_size, block_tables.data_ptr(),
                            block_tables.shape[1], context_lens.data_ptr(), num_seqs, num_heads, num_kv_heads,
                            head_dim, sliding_window or 0, scale or 1.0 / math.sqrt(head_dim), out.data_ptr(),
                            code, cache_code)
    return out


def decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, block_size,
                               sliding_window=None) -> torch.Tensor:
    """Per sequence: gather its keys through the block table, float32 softmax attention."""
    num_seqs, num_heads, head_dim = q.shape
    groups = num_heads // k_cache.shape[1]
    outs = []
    for b in range(num_seqs):
        length = int(context_lens[b])
        first = max(0, length - sliding_window) if sliding_window else 0
        pos = torch.arange(first, length)
        slots = block_tables[b, pos // block_size] * block_size + pos % block_size  # [L]
        k = k_cache[slots].float().repeat_interleave(groups, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(groups, dim=1)  # [L, H, D]
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) / math.sqrt(head_dim)  # [H, L]
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v).reshape(-1))
    return torch.stack(outs).to(q.dtype)  # [B, H * D]


# ---- paged prefill attention (prompt chunks, in place) ----

def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, query_starts: torch.Tensor, context_lens: torch.Tensor,
                      positions: torch.Tensor,
                      block_size: int, sliding_window: int | None = None,
                      out: torch.Tensor | None = None, scale: float | None = None,
                      tiles: bool = True) -> torch.Tensor:
    """q [T, H, D] (rows may be strided, heads contiguous); sequence b owns rows
    query_starts[b]:query_starts[b + 1] ([B + 1] int64) and attends through block_tables[b]; row t
    sees keys (positions[t] - sliding_window, positions[t]] of its sequence, positions[t] <
    context_lens[b]. -> out [T, H * D] (rows outside every sequence are left as they were; softmax
    scale: 1/sqrt(D) if None). tiles: the products may run on AMX-BF16 tiles where the CPU has them
    (cext/csrc/prefill_attention_amx.h: each operand split into two bfloat16, 16 significant bits,
    scores within 2^-15 of |q|.|k|); False: float32 products (the models whose own products are
    float32: dense weights, exact_products)."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    num_seqs = query_starts.shape[0] - 1
    code, cache_code = _check_paged(q, k_cache, v_cache, block_size)
    for name, t, size in (("block_tables", block_tables, num_seqs), ("context_lens", context_lens, num_seqs),
                          ("positions", positions, num_rows)):
        _require(t.dtype == torch.int64 and t.is_contiguous() and t.shape[0] >= size,
                 f"{name}: contiguous int64 with >= {size} rows")
    _require(query_starts.dtype == torch.int64 and query_starts.is_contiguous() and query_starts.dim() == 1,
             "query_starts: contiguous int64 [B + 1]")
    _require(block_tables.dim() == 2, "block_tables: [B, max_blocks]")
    if out is None:
        out = torch.empty((num_rows, num_heads * head_dim), dtype=q.dtype)
    _require(out.dtype == q.dtype and out.stride(1) == 1 and out.shape == (num_rows, num_heads * head_dim),
             "out: [T, H * D] in q's dtype, rows contiguous")
    ops.prefill_attention(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                          k_cache.shape[0] // block_size, block_size, block_tables.data_ptr(),
                          block_tables.shape[1], query_starts.data_ptr(), context_lens.data_ptr(),
                          positions.data_ptr(), num_seqs, num_rows, num_heads, num_kv_heads, head_dim,
                          sliding_window or 0, scale or 1.0 / math.sqrt(head_dim), out.data_ptr(), out.stride(0),
                          code, cache_code, tiles)
    return out


def prefill_attention_reference(q, k_cache, v_cache, block_tables, query_starts, context_lens, positions,
                                block_size, sliding_window=None, dtype=torch.float64) -> torch.Tensor:
    """The same contract by gathering each sequence's keys and a masked softmax in `dtype`
    (float64: the exact reference the kernel is tested against) -> [T, H * D] in `dtype`."""
    num_rows, num_heads, head_dim = q.shape
    groups = num_heads // k_cache.shape[1]
    out = torch.zeros((num_rows, num_heads * head_dim), dtype=dtype)
    for b in range(query_starts.shape[0] - 1):
        start, stop, length = int(query_starts[b]), int(query_starts[b + 1]), int(context_lens[b])
        if stop == start:
            continue
        pos = torch.arange(length)
        slots = block_tables[b, pos // block_size] * block_size + pos % block_size  # [C]
        k = k_cache[slots].to(dtype).repeat_interleave(groups, dim=1)  # [C, H, D]
        v = v_cache[slots].to(dtype).repeat_interleave(groups, dim=1)  # [C, H, D]
        rows = positions[start:stop, None]  # [R, 1]
        allowed = pos[None, :] <= rows  # [R, C]
        if sliding_window:
            allowed &= pos[None, :] > rows - sliding_window
        scores = torch.einsum("rhd,chd->hrc", q[start:stop].to(dtype), k) / math.sqrt(head_dim)  # [H, R, C]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[start:stop] = torch.einsum("hrc,chd->rhd", scores.softmax(-1), v).reshape(stop - start, -1)
    return out


# ---- SiLU(gate) * up ----

def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2 I] -> silu(gate) * up [T, I]."""
    num_rows, width = gate_up.shape
    code = _code(gate_up)
    _require(gate_up.is_contiguous() and width % 2 == 0, "gate_up: must be contiguous [T, 2 I]")
    if out is None:
        out = torch.empty((num_rows, width // 2), dtype=gate_up.dtype)
    ops.silu_mul(gate_up.data_ptr(), out.data_ptr(), num_rows, width // 2, code)
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


# ---- act(gate) * up, GELU's tanh form (Gemma's GeGLU) beside SiLU ----

_ACTS = {"silu": 0, "gelu_tanh": 1}  # cext.ops.ACT_SILU, ACT_GELU_TANH


def glu_mul(gate_up: torch.Tensor, act: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2 I] -> act(gate) * up [T, I], act "silu" or "gelu_tanh"."""
    num_rows, width = gate_up.shape
    code = _code(gate_up)
    _require(act in _ACTS, f"act: one of {sorted(_ACTS)}, got {act!r}")
    _require(gate_up.is_contiguous() and width % 2 == 0, "gate_up: must be contiguous [T, 2 I]")
    if out is None:
        out = torch.empty((num_rows, width // 2), dtype=gate_up.dtype)
    ops.glu_mul(gate_up.data_ptr(), out.data_ptr(), num_rows, width // 2, code, _ACTS[act])
    return out


def glu_mul_reference(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    a = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    return (a * up).to(gate_up.dtype)


# ---- RMSNorm of row pieces (post-norms, per-head q/k norms) ----

def rmsnorm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int = 1,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, >= heads * D] (each row's first heads * D values contiguous; other columns are left
    alone) -> out [T, heads * D] (or x itself, in place): each D-vector rmsnorm'ed, times weight [D]."""
    num_rows = x.shape[0]
    code = _code(x)
    _require(weight.dtype == x.dtype and weight.dim() == 1 and weight.is_contiguous(),
             "weight: must be contiguous [D] in x's dtype")
    dim = weight.shape[0]
    _require(x.dim() == 2 and x.stride(1) == 1 and x.shape[1] >= heads * dim,
             "x: rows of >= heads * D contiguous values")
    if out is None:
        out = torch.empty((num_rows, heads * dim), dtype=x.dtype)
    _require(out.dtype == x.dtype and out.dim() == 2 and out.stride(1) == 1 and out.shape[0] == num_rows
             and out.shape[1] >= heads * dim, "out: rows of >= heads * D contiguous values in x's dtype")
    ops.rmsnorm_rows(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), weight.data_ptr(), num_rows, heads,
                     dim, eps, code)
    return out


def rmsnorm_rows_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int = 1) -> torch.Tensor:
    dim = weight.shape[0]
    v = x[:, : heads * dim].float().reshape(x.shape[0], heads, dim)
    return F.rms_norm(v, (dim,), weight.float(), eps).reshape(x.shape[0], -1).to(x.dtype)


# ---- one forward's worth of kernel calls, with the per-call checks hoisted ----

class FusedStep:
    """The kernel calls of one model forward over T rows: constants and output buffers are
    set up once here and reused by every layer (the wrappers above re-check everything on
    each call, ~1 us each, x 150 calls per token).

    Buffers are overwritten by the next call of the same kind: ``norm`` returns the same
    [T, E] tensor each time, which the caller consumes (a projection) before the next norm.
    """

    __slots__ = ("num_rows", "dtype", "code", "hidden", "eps", "num_heads", "num_kv_heads", "head_dim",
                 "positions", "slots", "cos", "sin", "h", "attn", "act", "plan")

    def __init__(self, num_rows: int, dtype: torch.dtype, hidden: int, intermediate: int, eps: float,
                 num_heads: int, num_kv_heads: int, head_dim: int, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, plan):
        self.num_rows, self.dtype, self.code = num_rows, dtype, _code(torch.empty(0, dtype=dtype))
        self.hidden, self.eps = hidden, eps
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        _require(positions.dtype == torch.int64 and positions.is_contiguous() and positions.shape == (num_rows,),
                 "positions: must be contiguous int64 [T]")
        _require(cos.dtype == torch.float32 and cos.is_contiguous() and cos.shape == sin.shape
                 and sin.is_contiguous() and cos.shape[1] == head_dim // 2, "cos/sin: contiguous float32 [P, D/2]")
        self.positions, self.cos, self.sin, self.plan = positions, cos, sin, plan
        self.slots = plan.slot_mapping  # [T] int64 contiguous (plan_attention makes it so)
        self.h = torch.empty((num_rows, hidden), dtype=dtype)  # [T, E]
        self.attn = torch.empty((plan.num_decode_seqs, num_heads * head_dim), dtype=dtype)  # [B, H D]
        self.act = torch.empty((num_rows, intermediate), dtype=dtype)  # [T, I]

    def _check_rows(self, t: torch.Tensor, width: int, name: str) -> None:
        if t.dtype != self.dtype or not t.is_contiguous() or t.shape != (self.num_rows, width):
            raise ValueError(f"{name}: expected contiguous [{self.num_rows}, {width}] {self.dtype}, "
                             f"got {tuple(t.shape)} {t.dtype}")

    def norm(self, resid: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        """resid [T, E] float32 += delta; -> rmsnorm(resid) * weight in the step's buffer."""
        if delta is not None:
            self._check_rows(delta, self.hidden, "delta")
        if weight.dtype != self.dtype or not weight.is_contiguous() or weight.shape[0] != self.hidden:
            raise ValueError(f"weight: expected contiguous [{self.hidden}] {self.dtype}, got {weight.dtype}")
        ops.add_rmsnorm(resid.data_ptr(), 0 if delta is None else delta.data_ptr(), weight.data_ptr(),
                           self.h.data_ptr(), self.num_rows, self.hidden, self.eps, self.code)
        return self.h

    def rope_kv(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cos: torch.Tensor | None = None, sin: torch.Tensor | None = None) -> None:
        """cos/sin: another table of the step's shape [P, D/2] (Gemma 3's sliding layers), else the step's."""
        self._check_rows(qkv, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, "qkv")
        if cos is None:
            cos, sin = self.cos, self.sin
        elif not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
                  and cos.shape == sin.shape and cos.shape[1] == self.head_dim // 2):
            raise ValueError("cos/sin: contiguous float32 [P, D/2]")
        ops.rope_kv_write(qkv.data_ptr(), self.num_rows, qkv.shape[1], self.num_heads, self.num_kv_heads,
                             self.head_dim, self.positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                             cos.shape[0], self.slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                             k_cache.shape[0], self.code, _CACHE_CODES[k_cache.dtype])

    def decode_attention(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         plan=None, scale: float | None = None) -> torch.Tensor:
        """The decode rows (the first B of qkv, already roped) -> [B, H D] in the step's buffer.
        plan: another plan of the same batch (a sliding-window layer's), else the step's."""
        plan = plan or self.plan
        ops.decode_attention(qkv.data_ptr(), qkv.shape[1], k_cache.data_ptr(), v_cache.data_ptr(),
                                k_cache.shape[0] // plan.block_size, plan.block_size, plan.block_tables.data_ptr(),
                                plan.block_tables.shape[1], plan.context_lens.data_ptr(), plan.num_decode_seqs,
                                self.num_heads, self.num_kv_heads, self.head_dim, plan.sliding_window or 0,
                                scale or 1.0 / math.sqrt(self.head_dim), self.attn.data_ptr(), self.code,
                                _CACHE_CODES[k_cache.dtype])
        return self.attn

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.glu_mul(gate_up, 0)

    def glu_mul(self, gate_up: torch.Tensor, act: int) -> torch.Tensor:
        """act(gate) * up in the step's buffer; act: 0 SiLU, 1 GELU's tanh form."""
        inter = self.act.shape[1]
        self._check_rows(gate_up, 2 * inter, "gate_up")
        ops.glu_mul(gate_up.data_ptr(), self.act.data_ptr(), self.num_rows, inter, self.code, act)
        return self.act

    def norm_pieces(self, x: torch.Tensor, weight: torch.Tensor, heads: int, offset: int = 0) -> None:
        """In place: the heads D-vectors of each row of x [T, W] (contiguous) from column offset,
        rmsnorm'ed times weight [D] (q/k norms; post-norms with heads 1 and D = E)."""
        dim = weight.shape[0]
        if (x.dtype != self.dtype or not x.is_contiguous() or x.shape[0] != self.num_rows
                or x.shape[1] < offset + heads * dim):
            raise ValueError(f"x: expected contiguous [{self.num_rows}, >= {offset + heads * dim}] {self.dtype}")
        if weight.dtype != self.dtype or not weight.is_contiguous():
            raise ValueError(f"weight: expected contiguous [D] {self.dtype}, got {weight.dtype}")
        ptr = x.data_ptr() + offset * x.element_size()
        ops.rmsnorm_rows(ptr, x.shape[1], ptr, x.shape[1], weight.data_ptr(), self.num_rows, heads, dim,
                         self.eps, self.code)
