/* Fused small ops of a decode step, for float32 or bfloat16 activations.
 *
 * Plain C on raw pointers (no torch headers): the Cython module cext/ops.pyx passes
 * tensor.data_ptr() values. Every kernel accumulates in float32. Tensors are row-major and
 * contiguous unless a stride is given; strides count elements, not bytes.
 *
 * One source (fused_impl.h) is compiled once per instruction set (baseline x86-64 or any
 * other target, AVX2+FMA, AVX-512); each call runs the variant of cpu.h's switch
 * (cext.cpu.set_isa forces a lower one for tests) on cpu.h's thread pool.
 */
#ifndef FUSED_KERNELS_H
#define FUSED_KERNELS_H

#include <stdint.h>

#include "dtype.h"

/* Activations are float32 or bfloat16; KV caches also float16 (cache_dtype). */
enum { FK_FLOAT32 = DT_FLOAT32, FK_BFLOAT16 = DT_BFLOAT16, FK_FLOAT16 = DT_FLOAT16 };

/* Error codes (0 = success). */
enum { FK_OK = 0, FK_BAD_BLOCK = 1, FK_BAD_SLOT = 2, FK_BAD_POSITION = 3, FK_BAD_LENGTH = 4, FK_NO_MEMORY = 5 };

/* resid [T, E] float32 += delta [T, E] (compute dtype; NULL: nothing to add);
 * out [T, E] (compute dtype) = resid * rsqrt(mean(resid^2) + eps) * weight [E]. */
int fk_add_rmsnorm(float *resid, const void *delta, const void *weight, void *out,
                   int64_t num_rows, int64_t dim, float eps, int dtype);

/* qkv [T, row_stride]: row t holds q [H, D], k [KH, D], v [KH, D] from column 0.
 * Rotates q and k in place (rotate-half: dims [0, D/2) pair with [D/2, D)) with
 * cos/sin [num_positions, D/2] float32 at positions[t], then copies k and v to
 * k_cache/v_cache [num_slots, KH, D] (cache_dtype) at slot slots[t]. */
int fk_rope_kv_write(void *qkv, int64_t num_rows, int64_t row_stride, int num_heads, int num_kv_heads,
                     int head_dim, const int64_t *positions, const float *cos, const float *sin,
                     int64_t num_positions, const int64_t *slots, void *k_cache, void *v_cache,
                     int64_t num_slots, int dtype, int cache_dtype);

/* Decode attention, one query row per sequence: q [B, q_row_stride] (heads [H, D] from
 * column 0), caches [num_blocks * block_size, KH, D], block_tables [B, table_stride] int64,
 * context_lens [B] int64; sliding_window 0 = none, else the last sliding_window keys.
 * out [B, H * D]; the caches in cache_dtype, q and out in dtype. GQA: query head h reads kv head h / (H / KH). */
int fk_decode_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                        int64_t num_blocks, int block_size, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *context_lens, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int64_t sliding_window, float scale, void *out, int dtype,
                        int cache_dtype);

/* gate_up [T, 2 I] -> out [T, I] = silu(gate) * up. */
int fk_silu_mul(const void *gate_up, void *out, int64_t num_rows, int64_t inter, int dtype);

/* The gated activations: act(gate) * up with act silu or GELU's tanh form (Gemma's GeGLU). */
enum { FK_ACT_SILU = 0, FK_ACT_GELU_TANH = 1 };
int fk_glu_mul(const void *gate_up, void *out, int64_t num_rows, int64_t inter, int dtype, int act);

/* RMSNorm of vectors of dim values, heads of them per row: vector (t, h) starts at element
 * t * row_stride + h * dim of x (dtype) and goes to the same place of out (out_row_stride;
 * out may be x) as x * rsqrt(mean(x^2) + eps) * weight [dim] (dtype), float32 sums.
 * Post-norms (heads = 1) and per-head q/k norms (heads = H, rows of qkv). */
int fk_rmsnorm_rows(const void *x, int64_t row_stride, void *out, int64_t out_row_stride, const void *weight,
                    int64_t num_rows, int64_t heads, int64_t dim, float eps, int dtype);

#endif
