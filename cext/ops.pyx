"""The small ops of a forward step between the products (add + RMSNorm, RoPE + KV write, paged
decode attention, SiLU or GELU-tanh of gate times up, RMSNorm of row pieces: post-norms, q/k
norms) in C, for float32 or bfloat16 activations (KV caches also
float16), accumulating in float32, on cext.cpu's instruction set and thread pool.

Arguments are raw addresses (``tensor.data_ptr()``) and sizes: this module knows nothing
of torch. The caller (``engine.models.fused``) checks dtypes, shapes and contiguity; the
kernels check every index they follow (positions, slots, block ids, context lengths) and
raise ``IndexError`` instead of touching memory outside the tensors. The GIL is released
while a kernel runs. See cext/csrc/fused_kernels.h for the layouts.
"""
from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdint cimport int64_t, intptr_t

from cext import cpu as _cpu


cdef extern from "csrc/cpu.h":
    int cpu_client_bind(const void* api)


if cpu_client_bind(PyCapsule_GetPointer(_cpu._api, b"cext.cpu._api")) != 0:
    raise ImportError("cext.ops: cext.cpu was built from another cpu.h")

FLOAT32 = FK_FLOAT32
BFLOAT16 = FK_BFLOAT16
FLOAT16 = FK_FLOAT16
ACT_SILU = FK_ACT_SILU
ACT_GELU_TANH = FK_ACT_GELU_TANH

_ERRORS = {
    FK_BAD_BLOCK: "block table entry outside the cache (or -1) within a context",
    FK_BAD_SLOT: "slot outside the cache",
    FK_BAD_POSITION: "position outside the rotary table (prefill attention: outside its context, "
                     "or rows out of order)",
    FK_BAD_LENGTH: "context length < 1 or longer than the block table",
}


cdef inline int _check(int rc) except -1:
    if rc == FK_OK:
        return 0
    if rc == FK_NO_MEMORY:
        raise MemoryError("fused kernel scratch")
    raise IndexError(_ERRORS.get(rc, f"fused kernel error {rc}"))


def add_rmsnorm(intptr_t resid, intptr_t delta, intptr_t weight, intptr_t out, int64_t num_rows, int64_t dim,
                float eps, int dtype):
    """resid [T, E] float32 += delta [T, E] (0: none); out [T, E] = rmsnorm(resid) * weight [E]."""
    cdef int rc
    with nogil:
        rc = fk_add_rmsnorm(<float*>resid, <const void*>delta, <const void*>weight, <void*>out,
                            num_rows, dim, eps, dtype)
    _check(rc)


def rope_kv_write(intptr_t qkv, int64_t num_rows, int64_t row_stride, int num_heads, int num_kv_heads,
                  int head_dim, intptr_t positions, intptr_t cos, intptr_t sin, int64_t num_positions,
                  intptr_t slots, intptr_t k_cache, intptr_t v_cache, int64_t num_slots, int dtype,
                  int cache_dtype):
    """Rotates q and k of qkv [T, row_stride] in place; copies k, v to the caches (cache_dtype) at slots [T]."""
    cdef int rc
    with nogil:
        rc = fk_rope_kv_write(<void*>qkv, num_rows, row_stride, num_heads, num_kv_heads, head_dim,
                              <const int64_t*>positions, <const float*>cos, <const float*>sin, num_positions,
                              <const int64_t*>slots, <void*>k_cache, <void*>v_cache, num_slots, dtype, cache_dtype)
    _check(rc)


def decode_attention(intptr_t q, int64_t q_row_stride, intptr_t k_cache, intptr_t v_cache, int64_t num_blocks,
                     int block_size, intptr_t block_tables, int64_t table_stride, intptr_t context_lens,
                     int num_seqs, int num_heads, int num_kv_heads, int head_dim, int64_t sliding_window,
                     float scale, intptr_t out, int dtype, int cache_dtype):
    """One query row per sequence over its paged context (caches in cache_dtype) -> out [B, H * D]."""
    cdef int rc
    with nogil:
        rc = fk_decode_attention(<const void*>q, q_row_stride, <const void*>k_cache, <const void*>v_cache,
                                 num_blocks, block_size, <const int64_t*>block_tables, table_stride,
                                 <const int64_t*>context_lens, num_seqs, num_heads, num_kv_heads, head_dim,
                                 sliding_window, scale, <void*>out, dtype, cache_dtype)
    _check(rc)


def prefill_attention(intptr_t q, int64_t q_row_stride, intptr_t k_cache, intptr_t v_cache,
                      int64_t num_blocks, int block_size, intptr_t block_tables, int64_t table_stride,
                      intptr_t query_starts, intptr_t context_lens, intptr_t positions, int num_seqs,
                      int64_t num_rows, int num_heads, int num_kv_heads, int head_dim, int64_t sliding_window,
                      float scale, intptr_t out, int64_t out_row_stride, int dtype, int cache_dtype,
                      bint tiles=False):
    """Prompt rows (query_starts [B + 1] per sequence, positions [T]) over their paged contexts, in
    place (csrc/prefill_attention.h) -> out rows [H * D] at out_row_stride. tiles: the products
    may run on AMX-BF16 tiles (16 bits of each operand) where the CPU has them."""
    cdef int rc
    with nogil:
        rc = fk_prefill_attention(<const void*>q, q_row_stride, <const void*>k_cache, <const void*>v_cache,
                                  num_blocks, block_size, <const int64_t*>block_tables, table_stride,
                                  <const int64_t*>query_starts, <const int64_t*>context_lens,
                                  <const int64_t*>positions, num_seqs, num_rows, num_heads, num_kv_heads,
                                  head_dim, sliding_window, scale, <void*>out, out_row_stride, dtype,
                                  cache_dtype, tiles)
    _check(rc)


def set_prefill_amx(bint enabled) -> bool:
    """Whether prefill_attention calls with tiles=True take the AMX-BF16 variant where the CPU has
    it (the default) or the AVX-512 one; returns the previous setting."""
    return fk_set_prefill_amx(enabled) != 0


def silu_mul(intptr_t gate_up, intptr_t out, int64_t num_rows, int64_t inter, int dtype):
    """gate_up [T, 2 I] -> out [T, I] = silu(gate) * up."""
    cdef int rc
    with nogil:
        rc = fk_silu_mul(<const void*>gate_up, <void*>out, num_rows, inter, dtype)
    _check(rc)


def glu_mul(intptr_t gate_up, intptr_t out, int64_t num_rows, int64_t inter, int dtype, int act):
    """gate_up [T, 2 I] -> out [T, I] = act(gate) * up (act: ACT_SILU or ACT_GELU_TANH)."""
    cdef int rc
    if act != FK_ACT_SILU and act != FK_ACT_GELU_TANH:
        raise ValueError(f"act: ACT_SILU or ACT_GELU_TANH, got {act}")
    with nogil:
        rc = fk_glu_mul(<const void*>gate_up, <void*>out, num_rows, inter, dtype, act)
    _check(rc)


def rmsnorm_rows(intptr_t x, int64_t row_stride, intptr_t out, int64_t out_row_stride, intptr_t weight,
                 int64_t num_rows, int64_t heads, int64_t dim, float eps, int dtype):
    """RMSNorm of heads vectors of dim values per row of x -> out (may be x); see fused_kernels.h."""
    cdef int rc
    with nogil:
        rc = fk_rmsnorm_rows(<const void*>x, row_stride, <void*>out, out_row_stride, <const void*>weight,
                             num_rows, heads, dim, eps, dtype)
    _check(rc)


# ---- a decode forward's layers in one call (engine.models.decode_program) ----

ctypedef int (*matmul_fn)(int layout, const void* x, int64_t x_stride, int64_t num_rows, int64_t num_cols,
                          const void* w, const void* scales, int64_t num_out, const float* bias, void* y,
                          int64_t y_stride, int dtype) noexcept nogil

cdef matmul_fn _matmul = NULL

# The columns of a layer's row of the program (int64), one row per layer; the products' five
# (qkv, o, gate_up, down, and a second part of qkv: rows 0 when it has none) take PRODUCT_FIELDS
# columns each from PRODUCTS. A qkv in two parts (engine.models.quant.RowParts: a Q4_K_M file's Q4_K
# q/k beside its Q6_K v) writes the second's outputs after the first's, in the same row of the buffer. The forward's rotary
# tables (cos, sin, positions) x 2, its plans (block tables, their row stride, context lengths,
# sequences, block size, sliding window) x 2 and its buffers.
cdef enum:
    C_ATTN_NORM, C_FFN_NORM, C_POST_ATTN_NORM, C_POST_FFN_NORM, C_Q_NORM, C_K_NORM, C_Q_HEADS, C_K_HEADS
    C_QK_DIM, C_K_CACHE, C_V_CACHE, C_NUM_SLOTS, C_CACHE_DTYPE, C_ROPE, C_PLAN, C_ACT, C_PRODUCTS
cdef enum:
    C_P_LAYOUT, C_P_ROWS, C_P_SCALES, C_P_BIAS, C_P_OUT, C_P_IN, C_PRODUCT_FIELDS
cdef enum:
    C_ROPE_FIELDS = 3
    C_PLAN_FIELDS = 6
    C_LAYER_FIELDS = C_PRODUCTS + 5 * C_PRODUCT_FIELDS
cdef enum:
    C_B_H, C_B_QKV, C_B_ATTN, C_B_O, C_B_GATE_UP, C_B_ACT, C_B_DOWN, C_BUFFERS

L_ATTN_NORM, L_FFN_NORM, L_POST_ATTN_NORM, L_POST_FFN_NORM = C_ATTN_NORM, C_FFN_NORM, C_POST_ATTN_NORM, C_POST_FFN_NORM
L_Q_NORM, L_K_NORM, L_Q_HEADS, L_K_HEADS, L_QK_DIM = C_Q_NORM, C_K_NORM, C_Q_HEADS, C_K_HEADS, C_QK_DIM
L_K_CACHE, L_V_CACHE, L_NUM_SLOTS, L_CACHE_DTYPE = C_K_CACHE, C_V_CACHE, C_NUM_SLOTS, C_CACHE_DTYPE
L_ROPE, L_PLAN, L_ACT, PRODUCTS = C_ROPE, C_PLAN, C_ACT, C_PRODUCTS
P_LAYOUT, P_ROWS, P_SCALES, P_BIAS, P_OUT, P_IN = C_P_LAYOUT, C_P_ROWS, C_P_SCALES, C_P_BIAS, C_P_OUT, C_P_IN
PRODUCT_FIELDS, LAYER_FIELDS, ROPE_FIELDS, PLAN_FIELDS = C_PRODUCT_FIELDS, C_LAYER_FIELDS, C_ROPE_FIELDS, C_PLAN_FIELDS
B_H, B_QKV, B_ATTN, B_O, B_GATE_UP, B_ACT, B_DOWN, BUFFERS = (C_B_H, C_B_QKV, C_B_ATTN, C_B_O, C_B_GATE_UP, C_B_ACT,
                                                              C_B_DOWN, C_BUFFERS)


cdef inline int _product(const int64_t* p, const void* x, int64_t num_rows, void* y, int dtype,
                         int* layout, int64_t y_stride=0) noexcept nogil:
    """y [T, N] (row stride y_stride, 0: N) = x @ W.T + bias for the product at p."""
    layout[0] = <int>p[C_P_LAYOUT]
    return _matmul(<int>p[C_P_LAYOUT], x, p[C_P_IN], num_rows, p[C_P_IN], <const void*>p[C_P_ROWS],
                   <const void*>p[C_P_SCALES], p[C_P_OUT], <const float*>p[C_P_BIAS], y,
                   y_stride if y_stride else p[C_P_OUT], dtype)


cdef inline int _norm_in_place(int64_t at, int64_t width, int64_t weight, int64_t num_rows, int64_t heads,
                               int64_t dim, float eps, int dtype) noexcept nogil:
    """heads dim-vectors of each row of [T, width] at address ``at``, rmsnorm'ed times weight, in place
    (FusedStep.norm_pieces' call: the q/k norms and the post-norms)."""
    return fk_rmsnorm_rows(<const void*>at, width, <void*>at, width, <const void*>weight, num_rows, heads, dim,
                           eps, dtype)


cdef inline int _product_post_norm(const int64_t* p, const void* x, int64_t num_rows, int64_t y, int64_t hidden,
                                   int64_t post_norm, float eps, int dtype, int* layout,
                                   int* failed_product) noexcept nogil:
    """A layer's output product (o or down) into y [T, hidden], then its post-norm in place where the
    layer has one (Gemma's). failed_product: set when the product failed (rc is then qgemm's code)."""
    cdef int rc = _product(p, x, num_rows, <void*>y, dtype, layout)
    if rc != 0:
        failed_product[0] = 1
        return rc
    if post_norm:
        return _norm_in_place(y, hidden, post_norm, num_rows, 1, hidden, eps, dtype)
    return FK_OK


def bind_matmul(capsule) -> None:
    """Take cext.qgemm's product (its ``_matmul_capsule``) for decode_layers."""
    global _matmul
    _matmul = <matmul_fn>PyCapsule_GetPointer(capsule, b"cext.qgemm.qg_matmul")


def decode_layers(const int64_t[:, ::1] program, const double[::1] scales, intptr_t resid, int64_t num_rows,
                  int64_t hidden, float eps, int dtype, int num_heads, int num_kv_heads, int head_dim,
                  int64_t inter, intptr_t positions, intptr_t slots, const int64_t[::1] ropes,
                  const int64_t[::1] plans, const int64_t[::1] buffers) -> None:
    """Every decoder layer of a decode forward over num_rows rows (each row its own sequence's
    query: plan_attention's fused decode), in order, with the GIL released once: per layer
    add_rmsnorm, the qkv product, the q/k norms, rope_kv_write, decode_attention, the o product
    (its post-norm), add_rmsnorm, the gate_up product, glu_mul, the down product (its post-norm):
    the calls engine.models.llama.DecoderLayer.forward_fused makes through fused.FusedStep and
    Linear, with the same arguments, so the same bits. The last layer's output (the next add's
    delta) is left in buffers[B_DOWN]; resid [T, E] float32 holds the residual stream before it.
    Raises as the single calls do (IndexError for a bad block, slot or position, MemoryError,
    ValueError for a product's layout)."""
    cdef Py_ssize_t num_layers = program.shape[0], i
    cdef int rc = 0, layout = 0, failed_product = 0
    cdef const int64_t* row
    cdef const int64_t* plan
    cdef const int64_t* rope
    cdef const int64_t* buf = &buffers[0]
    cdef int64_t qkv_width = (num_heads + 2 * num_kv_heads) * head_dim, elsize = 4 if dtype == FK_FLOAT32 else 2
    cdef void* delta = NULL
    if _matmul == NULL:
        from cext import qgemm
        bind_matmul(qgemm._matmul_capsule)
    if program.shape[1] != C_LAYER_FIELDS or scales.shape[0] != num_layers:
        raise ValueError(f"program: [layers, {C_LAYER_FIELDS}] with one scale per layer")
    if ropes.shape[0] != 2 * C_ROPE_FIELDS or plans.shape[0] != 2 * C_PLAN_FIELDS or buffers.shape[0] != C_BUFFERS:
        raise ValueError("ropes, plans, buffers: 2 x 3, 2 x 6 and 7 values")
    for i in range(num_layers):  # the rotary table and the plan each layer names must be given
        if not (0 <= program[i, C_ROPE] <= 1 and 0 <= program[i, C_PLAN] <= 1
                and ropes[C_ROPE_FIELDS * program[i, C_ROPE]] != 0 and plans[C_PLAN_FIELDS * program[i, C_PLAN]] != 0
                and plans[C_PLAN_FIELDS * program[i, C_PLAN] + 4] > 0):
            raise ValueError(f"layer {i}: its rotary table or attention plan is missing")
    with nogil:
        for i in range(num_layers):
            row = &program[i, 0]
            rope = &ropes[C_ROPE_FIELDS * row[C_ROPE]]
            plan = &plans[C_PLAN_FIELDS * row[C_PLAN]]
            rc = fk_add_rmsnorm(<float*>resid, delta, <const void*>row[C_ATTN_NORM], <void*>buf[C_B_H],
                                num_rows, hidden, eps, dtype)
            if rc != FK_OK:
                break
            rc = _product(row + C_PRODUCTS, <const void*>buf[C_B_H], num_rows, <void*>buf[C_B_QKV], dtype, &layout,
                          qkv_width)
            if rc == 0 and row[C_PRODUCTS + 4 * C_PRODUCT_FIELDS + C_P_ROWS]:  # qkv's second part
                rc = _product(row + C_PRODUCTS + 4 * C_PRODUCT_FIELDS, <const void*>buf[C_B_H], num_rows,
                              <void*>(buf[C_B_QKV] + row[C_PRODUCTS + C_P_OUT] * elsize), dtype, &layout, qkv_width)
            if rc != 0:
                failed_product = 1
                break
            if row[C_Q_NORM]:
                rc = _norm_in_place(buf[C_B_QKV], qkv_width, row[C_Q_NORM], num_rows, row[C_Q_HEADS], row[C_QK_DIM],
                                    eps, dtype)
                if rc == FK_OK:
                    rc = _norm_in_place(buf[C_B_QKV] + num_heads * head_dim * elsize, qkv_width, row[C_K_NORM],
                                        num_rows, row[C_K_HEADS], row[C_QK_DIM], eps, dtype)
                if rc != FK_OK:
                    break
            rc = fk_rope_kv_write(<void*>buf[C_B_QKV], num_rows, qkv_width, num_heads, num_kv_heads, head_dim,
                                  <const int64_t*>positions, <const float*>rope[0], <const float*>rope[1], rope[2],
                                  <const int64_t*>slots, <void*>row[C_K_CACHE], <void*>row[C_V_CACHE],
                                  row[C_NUM_SLOTS], dtype, <int>row[C_CACHE_DTYPE])
            if rc != FK_OK:
                break
            rc = fk_decode_attention(<const void*>buf[C_B_QKV], qkv_width, <const void*>row[C_K_CACHE],
                                     <const void*>row[C_V_CACHE], row[C_NUM_SLOTS] // plan[4], <int>plan[4],
                                     <const int64_t*>plan[0], plan[1], <const int64_t*>plan[2], <int>plan[3],
                                     num_heads, num_kv_heads, head_dim, plan[5], <float>scales[i],
                                     <void*>buf[C_B_ATTN], dtype, <int>row[C_CACHE_DTYPE])
            if rc != FK_OK:
                break
            rc = _product_post_norm(row + C_PRODUCTS + C_PRODUCT_FIELDS, <const void*>buf[C_B_ATTN], num_rows,
                                    buf[C_B_O], hidden, row[C_POST_ATTN_NORM], eps, dtype, &layout, &failed_product)
            if rc != FK_OK:
                break
            rc = fk_add_rmsnorm(<float*>resid, <const void*>buf[C_B_O], <const void*>row[C_FFN_NORM],
                                <void*>buf[C_B_H], num_rows, hidden, eps, dtype)
            if rc != FK_OK:
                break
            rc = _product(row + C_PRODUCTS + 2 * C_PRODUCT_FIELDS, <const void*>buf[C_B_H], num_rows,
                          <void*>buf[C_B_GATE_UP], dtype, &layout)
            if rc != 0:
                failed_product = 1
                break
            rc = fk_glu_mul(<const void*>buf[C_B_GATE_UP], <void*>buf[C_B_ACT], num_rows, inter, dtype, <int>row[C_ACT])
            if rc != FK_OK:
                break
            rc = _product_post_norm(row + C_PRODUCTS + 3 * C_PRODUCT_FIELDS, <const void*>buf[C_B_ACT], num_rows,
                                    buf[C_B_DOWN], hidden, row[C_POST_FFN_NORM], eps, dtype, &layout, &failed_product)
            if rc != FK_OK:
                break
            delta = <void*>buf[C_B_DOWN]
    if failed_product:
        from cext import qgemm
        qgemm.check(rc, layout)
    _check(rc)
