# The small ops of a forward step (cext/csrc/fused_kernels.h): plain C over raw pointers.
from libc.stdint cimport int64_t


cdef extern from "csrc/fused_kernels.h" nogil:
    enum:
        FK_FLOAT32
        FK_BFLOAT16
        FK_FLOAT16
        FK_OK
        FK_BAD_BLOCK
        FK_BAD_SLOT
        FK_BAD_POSITION
        FK_BAD_LENGTH
        FK_NO_MEMORY

    int fk_add_rmsnorm(float* resid, const void* delta, const void* weight, void* out,
                       int64_t num_rows, int64_t dim, float eps, int dtype)
    int fk_rope_kv_write(void* qkv, int64_t num_rows, int64_t row_stride, int num_heads, int num_kv_heads,
                         int head_dim, const int64_t* positions, const float* cos, const float* sin,
                         int64_t num_positions, const int64_t* slots, void* k_cache, void* v_cache,
                         int64_t num_slots, int dtype, int cache_dtype)
    int fk_decode_attention(const void* q, int64_t q_row_stride, const void* k_cache, const void* v_cache,
                            int64_t num_blocks, int block_size, const int64_t* block_tables, int64_t table_stride,
                            const int64_t* context_lens, int num_seqs, int num_heads, int num_kv_heads,
                            int head_dim, int64_t sliding_window, float scale, void* out, int dtype,
                            int cache_dtype)
    int fk_silu_mul(const void* gate_up, void* out, int64_t num_rows, int64_t inter, int dtype)
    int fk_glu_mul(const void* gate_up, void* out, int64_t num_rows, int64_t inter, int dtype, int act)
    int fk_rmsnorm_rows(const void* x, int64_t row_stride, void* out, int64_t out_row_stride, const void* weight,
                        int64_t num_rows, int64_t heads, int64_t dim, float eps, int dtype)
    enum:
        FK_ACT_SILU
        FK_ACT_GELU_TANH


cdef extern from "csrc/prefill_attention.h" nogil:
    int fk_prefill_attention(const void* q, int64_t q_row_stride, const void* k_cache, const void* v_cache,
                             int64_t num_blocks, int block_size, const int64_t* block_tables,
                             int64_t table_stride, const int64_t* query_starts, const int64_t* context_lens,
                             const int64_t* positions, int num_seqs, int64_t num_rows, int num_heads,
                             int num_kv_heads, int head_dim, int64_t sliding_window, float scale, void* out,
                             int64_t out_row_stride, int dtype, int cache_dtype, int tiles)
    int fk_set_prefill_amx(int enabled)
