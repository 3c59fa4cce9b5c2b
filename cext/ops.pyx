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
                      float scale, intptr_t out, int64_t out_row_stride, int dtype, int cache_dtype):
    """Prompt rows (query_starts [B + 1] per sequence, positions [T]) over their paged contexts, in
    place (csrc/prefill_attention.h) -> out rows [H * D] at out_row_stride."""
    cdef int rc
    with nogil:
        rc = fk_prefill_attention(<const void*>q, q_row_stride, <const void*>k_cache, <const void*>v_cache,
                                  num_blocks, block_size, <const int64_t*>block_tables, table_stride,
                                  <const int64_t*>query_starts, <const int64_t*>context_lens,
                                  <const int64_t*>positions, num_seqs, num_rows, num_heads, num_kv_heads,
                                  head_dim, sliding_window, scale, <void*>out, out_row_stride, dtype,
                                  cache_dtype)
    _check(rc)


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
