"""Fused small ops of a decode step (add + RMSNorm, RoPE + KV write, paged decode attention,
SiLU * up) in C, for float32 or bfloat16 activations (KV caches also float16), accumulating in
float32.

Arguments are raw addresses (``tensor.data_ptr()``) and sizes: this module knows nothing
of torch. The caller (``engine.models.fused``) checks dtypes, shapes and contiguity; the
kernels check every index they follow (positions, slots, block ids, context lengths) and
raise ``IndexError`` instead of touching memory outside the tensors. The GIL is released
while a kernel runs. See cext/csrc/fused_kernels.h for the layouts.
"""
from libc.stdint cimport int64_t, intptr_t

FLOAT32 = FK_FLOAT32
BFLOAT16 = FK_BFLOAT16
FLOAT16 = FK_FLOAT16
ISA_NAMES = {FK_ISA_BASELINE: "baseline", FK_ISA_AVX2: "avx2", FK_ISA_AVX512: "avx512"}
_ISA_CODES = {name: code for code, name in ISA_NAMES.items()}

_ERRORS = {
    FK_BAD_BLOCK: "block table entry outside the cache (or -1) within a context",
    FK_BAD_SLOT: "slot outside the cache",
    FK_BAD_POSITION: "position outside the rotary table (prefill attention: outside its context, "
                     "or rows out of order)",
    FK_BAD_LENGTH: "context length < 1 or longer than the block table (or a product's K not a multiple of 32)",

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


def q4_matmul(intptr_t x, int64_t x_stride, int64_t num_rows, int64_t num_cols, intptr_t blocks, bint half,
              int64_t num_out, intptr_t bias, intptr_t y, int64_t y_stride, int dtype, bint high=False,
              bint no_mins=False):
    """y [M, N] = x [M, K] @ W.T (+ bias float32 [N], 0: none) for W in Q4 rows [N, K / 32 * (20 if half
    else 24)], or Q5 rows with ``high`` [N, K / 32 * (24 if half else 28)] (csrc/qgemm.h); x quantized
    to int16 codes per block of 32. ``no_mins``: every min is 0 (Q5_0): the rows hold no mins
    ([N, K / 32 * (22 if half else 24)] for Q5) and the m term is skipped."""
    cdef int rc, layout = (1 if high else 0) | (2 if no_mins else 0)
    with nogil:
        rc = fk_q4_matmul(<const void*>x, x_stride, num_rows, num_cols, <const unsigned char*>blocks, half, layout, num_out,
                          <const float*>bias, <void*>y, y_stride, dtype)
    _check(rc)


def q8_matmul(intptr_t x, int64_t x_stride, int64_t num_rows, int64_t num_cols, intptr_t q, intptr_t scales,
              int64_t num_out, intptr_t bias, intptr_t y, int64_t y_stride, int dtype, bint half=False):
    """y [M, N] = x [M, K] @ W.T (+ bias) for W = q [N, K] int8 * scales [N, K / 32] per block of 32
    (float16 scales with ``half``, else float32)."""
    cdef int rc
    with nogil:
        rc = fk_q8_matmul(<const void*>x, x_stride, num_rows, num_cols, <const signed char*>q, <const void*>scales,
                          half, num_out, <const float*>bias, <void*>y, y_stride, dtype)
    _check(rc)


def q5_pack(intptr_t packed, intptr_t high, int64_t num_rows, int64_t num_cols, intptr_t out, int64_t out_stride):
    """Q5 codes in ggml's order (nibbles [N, K / 2], fifth bits [N, K / 8]) -> the kernels' 40-byte
    pair records, row n at out + n * out_stride (csrc/qgemm.h)."""
    cdef int rc
    with nogil:
        rc = fk_q5_pack(<const unsigned char*>packed, <const unsigned char*>high, num_rows, num_cols,
                        <unsigned char*>out, out_stride)
    _check(rc)


def q4_dequantize(intptr_t blocks, bint half, int64_t num_out, int64_t num_cols, intptr_t w, bint high=False,
                  bint no_mins=False):
    """Q4 (or Q5: ``high``) rows -> float32 w [N, K]; ``no_mins``: rows without mins (as q4_matmul's)."""
    cdef int rc, layout = (1 if high else 0) | (2 if no_mins else 0)
    with nogil:
        rc = fk_q4_dequantize(<const unsigned char*>blocks, half, layout, num_out, num_cols, <float*>w)
    _check(rc)


def set_num_threads(int num_threads) -> int:
    """Threads of the kernels' pool, the caller included (clamped to 1..256)."""
    return fk_set_num_threads(num_threads)


def get_num_threads() -> int:
    return fk_get_num_threads()


def set_parallel_threshold(int64_t work):
    """Work (about multiply-adds) below which a call stays on the calling thread."""
    fk_set_parallel_threshold(work)


def get_parallel_threshold() -> int:
    return fk_get_parallel_threshold()


def set_float_rows(int64_t rows):
    """From how many activation rows the AVX2 quantized products run in float32 (each pass's
    weight rows decoded once, FMAs against the float32 activations) instead of int16 codes."""
    if rows < 1:
        raise ValueError(f"float_rows: must be >= 1, got {rows!r}")
    fk_qgemm_set_float_rows(rows)


def get_float_rows() -> int:
    return fk_qgemm_get_float_rows()


def set_spin_us(double us):
    """How long an idle worker polls for the next job (and the caller for its workers) before
    sleeping on a condition variable; 0 sleeps at once."""
    if not us >= 0:
        raise ValueError(f"spin_us: must be >= 0, got {us!r}")
    fk_set_spin_ns(<int64_t>(us * 1000))


def get_spin_us() -> float:
    return fk_get_spin_ns() / 1000.0


def set_isa(str name) -> str:
    """"auto", "baseline", "avx2" or "avx512" -> the variant now in use; ValueError if the CPU lacks it."""
    code = FK_ISA_AUTO if name == "auto" else _ISA_CODES.get(name)
    if code is None:
        raise ValueError(f"isa: unknown {name!r}, expected 'auto' or one of {tuple(_ISA_CODES)}")
    result = fk_set_isa(code)
    if result < 0:
        raise ValueError(f"isa: this CPU does not support {name!r}")
    return ISA_NAMES[result]


def get_isa() -> str:
    return ISA_NAMES[fk_get_isa()]
