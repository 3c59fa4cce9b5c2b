/* Prefill attention in place over a paged KV cache: a blocked flash attention (online
 * softmax over spans of keys) that reads each key and value straight from its block, with
 * no gathered copy of the context. See prefill_attention.c for the scheme.
 *
 * Layouts as fused_kernels.h: caches [num_blocks * block_size, KH, D] in cache_dtype
 * (FK_FLOAT32 / FK_BFLOAT16 / FK_FLOAT16), q and out in dtype (FK_FLOAT32 / FK_BFLOAT16).
 */
#ifndef PREFILL_ATTENTION_H
#define PREFILL_ATTENTION_H

#include <stdint.h>

/* Rows query_starts[b] .. query_starts[b + 1] - 1 belong to sequence b (block_tables row b,
 * int64 [num_seqs, table_stride]; context_lens[b] its KV length). Row t (query
 * q + t * q_row_stride: heads [H, D] from column 0) attends keys
 * max(0, positions[t] - sliding_window + 1) .. positions[t] of its sequence (sliding_window 0:
 * from key 0), softmax scale `scale`; positions[t] < context_lens[b]. GQA: query head h reads
 * kv head h / (H / KH). Writes out + t * out_row_stride ([H * D], dtype) for every row t of
 * the sequences, and nothing else. 0, or FK_BAD_* / FK_NO_MEMORY (nothing written then).
 * tiles: the products may run on AMX-BF16 tiles (prefill_attention_amx.h: 16 significant bits of
 * each operand) where the CPU has them and fk_set_prefill_amx allows; 0: float32 products. */
int fk_prefill_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                         int64_t num_blocks, int block_size, const int64_t *block_tables,
                         int64_t table_stride, const int64_t *query_starts, const int64_t *context_lens,
                         const int64_t *positions, int num_seqs, int64_t num_rows, int num_heads,
                         int num_kv_heads, int head_dim, int64_t sliding_window, float scale, void *out,
                         int64_t out_row_stride, int dtype, int cache_dtype, int tiles);

/* Whether calls asking for tiles take the AMX variant where the CPU has AMX-BF16 and cpu.h's
 * switch is at AVX-512 (1, the default) or keep the AVX-512 one (0); returns the previous setting. */
int fk_set_prefill_amx(int enabled);

#endif
