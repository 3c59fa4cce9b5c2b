/* Dispatch (cpu.h's instruction-set switch, per call), argument checks and the pool's jobs
 * for the kernels of fused_impl.h. See fused_kernels.h for the contract. */
#include "fused_kernels.h"
#include "cpu.h"
#include "dtype.h"

#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define FK_CHUNK 32         /* keys scored per step of the online softmax */
#define FK_SPAN 256         /* keys per online-softmax step of the 8-lane path (>= FK_CHUNK) */
#define FK_PREFETCH_KEYS 128 /* how far ahead the 8-lane path prefetches keys and values */
/* A decode row's keys are cut in ceil(keys / FK_SPLIT_KEYS) ranges (at most FK_MAX_SPLITS), merged
 * after (flash-decoding): a function of the row's own context alone, so a sequence's numbers are
 * the same whatever the batch beside it and however many threads run (fk_attention_splits). */
#define FK_SPLIT_KEYS 512
#define FK_MAX_SPLITS 32


#define FK_CHUNK_COLS 512   /* columns of silu_mul converted per step */

typedef struct {
    float *resid; const void *delta; const void *weight; void *out;
    int64_t dim; float eps; int dtype;
} AddNormArgs;

typedef struct {
    void *qkv; int64_t row_stride; int num_heads, num_kv_heads, head_dim;
    const int64_t *positions; const float *cos, *sin; const int64_t *slots;
    void *k_cache, *v_cache; int dtype, cache_dtype;
} RopeArgs;

typedef struct {
    const void *q; int64_t q_row_stride; const void *k_cache, *v_cache; int block_size;
    const int64_t *block_tables; int64_t table_stride; const int64_t *context_lens;
    int num_heads, num_kv_heads, head_dim; int64_t sliding_window; float scale; void *out; int dtype, cache_dtype;
    int num_splits;   /* the most key ranges of any sequence (item = pair * num_splits + range) */
    float *partials;  /* [B * KH * num_splits, G * (D + 2)] when num_splits > 1 */
} AttnArgs;

/* The keys row b attends: its context, or the sliding window's end of it. */
static inline int64_t fk_row_keys(const AttnArgs *a, int64_t b) {
    int64_t len = a->context_lens[b];
    return a->sliding_window > 0 && len > a->sliding_window ? a->sliding_window : len;
}

/* Key ranges of a row attending ``keys`` keys (FK_SPLIT_KEYS). */
static inline int fk_attention_splits(int64_t keys) {
    int64_t n = (keys + FK_SPLIT_KEYS - 1) / FK_SPLIT_KEYS;
    return n < 1 ? 1 : n > FK_MAX_SPLITS ? FK_MAX_SPLITS : (int)n;
}


typedef struct {
    const void *gate_up; void *out; int64_t inter; int dtype; int act;
} SiluArgs;

typedef struct {
    const void *x; void *out; const void *weight;
    int64_t heads, dim, row_stride, out_row_stride; float eps; int dtype;
} NormArgs;

typedef struct {
    void (*add_rmsnorm)(const AddNormArgs *, int64_t, int64_t, float *);
    void (*rope_kv)(const RopeArgs *, int64_t, int64_t, float *);
    void (*attention)(const AttnArgs *, int64_t, int64_t, float *);
    void (*silu_mul)(const SiluArgs *, int64_t, int64_t, float *);
    void (*rmsnorm)(const NormArgs *, int64_t, int64_t, float *);
} KernelTable;

#define FK_SUFFIX baseline
#include "fused_impl.h"
#undef FK_SUFFIX

#if defined(__x86_64__) && defined(__GNUC__)
#define FK_HAVE_X86 1
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define FK_SUFFIX avx2
#define FK_VEC8 1
#include "fused_impl.h"
#undef FK_VEC8
#undef FK_SUFFIX
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define FK_SUFFIX avx512
#define FK_VEC8 1
#include "fused_impl.h"
#undef FK_VEC8
#undef FK_SUFFIX
#pragma GCC pop_options
#endif

/* ---- instruction set (cpu.h's switch) ---- */

static void kernel_store(int dtype, void *dst, const float *src, int64_t n) { store_row_baseline(dst, src, n, dtype); }

static const KernelTable *kernels(void) {
#ifdef FK_HAVE_X86
    const int isa = cpu_isa();
    return isa >= CPU_ISA_AVX512 ? &kernel_table_avx512 : isa >= CPU_ISA_AVX2 ? &kernel_table_avx2
                                                                               : &kernel_table_baseline;
#else
    return &kernel_table_baseline;
#endif
}

/* ---- entry points ---- */

static void add_rmsnorm_range(const void *a, int64_t b, int64_t e, float *s) { kernels()->add_rmsnorm(a, b, e, s); }
static void rope_kv_range(const void *a, int64_t b, int64_t e, float *s) { kernels()->rope_kv(a, b, e, s); }
static void attention_range(const void *a, int64_t b, int64_t e, float *s) { kernels()->attention(a, b, e, s); }
static void silu_mul_range(const void *a, int64_t b, int64_t e, float *s) { kernels()->silu_mul(a, b, e, s); }
static void rmsnorm_range(const void *a, int64_t b, int64_t e, float *s) { kernels()->rmsnorm(a, b, e, s); }

int fk_add_rmsnorm(float *resid, const void *delta, const void *weight, void *out,
                   int64_t num_rows, int64_t dim, float eps, int dtype) {
    AddNormArgs args = {resid, delta, weight, out, dim, eps, dtype};
    return cpu_parallel_for(add_rmsnorm_range, &args, num_rows, num_rows * dim * 4, (size_t)dim * 2);
}

int fk_rope_kv_write(void *qkv, int64_t num_rows, int64_t row_stride, int num_heads, int num_kv_heads,
                     int head_dim, const int64_t *positions, const float *cos, const float *sin,
                     int64_t num_positions, const int64_t *slots, void *k_cache, void *v_cache,
                     int64_t num_slots, int dtype, int cache_dtype) {
    for (int64_t t = 0; t < num_rows; t++) {
        if (positions[t] < 0 || positions[t] >= num_positions) return FK_BAD_POSITION;
        if (slots[t] < 0 || slots[t] >= num_slots) return FK_BAD_SLOT;
    }
    RopeArgs args = {qkv, row_stride, num_heads, num_kv_heads, head_dim, positions, cos, sin, slots,
                     k_cache, v_cache, dtype, cache_dtype};
    int64_t work = num_rows * (num_heads + num_kv_heads) * head_dim * 4;
    return cpu_parallel_for(rope_kv_range, &args, num_rows, work, (size_t)head_dim * 2);
}

/* Combines the partial softmaxes of each (sequence, kv head) cut in more than one range into out. */
static int merge_partials(const AttnArgs *a, int64_t num_pairs) {
    const int groups = a->num_heads / a->num_kv_heads, dim = a->head_dim, stride = a->num_splits;
    const size_t part_len = (size_t)groups * (dim + 2);
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    float *row = cpu_scratch((size_t)dim);
    if (row == NULL) return FK_NO_MEMORY;
    for (int64_t pair = 0; pair < num_pairs; pair++) {
        const int64_t b = pair / a->num_kv_heads;
        const int kvh = (int)(pair % a->num_kv_heads);
        const int splits = fk_attention_splits(fk_row_keys(a, b));
        if (splits == 1) continue;  /* written by its item */
        const float *parts = a->partials + (size_t)pair * stride * part_len;
        for (int g = 0; g < groups; g++) {
            float m = -1e30f;
            for (int s = 0; s < splits; s++) {
                float ms = parts[s * part_len + g];
                m = ms > m ? ms : m;
            }
            float total = 0.0f;
            for (int i = 0; i < dim; i++) row[i] = 0.0f;
            for (int s = 0; s < splits; s++) {
                const float *p = parts + s * part_len;
                float w = p[g] <= -1e30f ? 0.0f : expf(p[g] - m);
                total += w * p[groups + g];
                const float *acc = p + 2 * groups + (size_t)g * dim;
                for (int i = 0; i < dim; i++) row[i] += w * acc[i];
            }
            const float inv = 1.0f / total;
            for (int i = 0; i < dim; i++) row[i] *= inv;
            kernel_store(a->dtype, (char *)a->out + ((size_t)b * a->num_heads + (size_t)kvh * groups + g) * dim * esize,
                         row, dim);
        }
    }
    return FK_OK;
}

int fk_decode_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                        int64_t num_blocks, int block_size, const int64_t *block_tables, int64_t table_stride,
                        const int64_t *context_lens, int num_seqs, int num_heads, int num_kv_heads,
                        int head_dim, int64_t sliding_window, float scale, void *out, int dtype,
                        int cache_dtype) {
    int64_t total_keys = 0;
    int max_splits = 1;
    for (int b = 0; b < num_seqs; b++) {
        int64_t len = context_lens[b];
        if (len < 1 || (len + block_size - 1) / block_size > table_stride) return FK_BAD_LENGTH;
        int64_t first = sliding_window > 0 && len > sliding_window ? len - sliding_window : 0;
        const int64_t *table = block_tables + (int64_t)b * table_stride;
        for (int64_t j = first / block_size; j <= (len - 1) / block_size; j++) {
            if (table[j] < 0 || table[j] >= num_blocks) return FK_BAD_BLOCK;
        }
        total_keys += len - first;
        int splits = fk_attention_splits(len - first);
        if (splits > max_splits) max_splits = splits;
    }
    int groups = num_heads / num_kv_heads;
    int64_t work = total_keys * num_heads * head_dim * 2;
    int64_t num_pairs = (int64_t)num_seqs * num_kv_heads;
    float *partials = NULL;
    if (max_splits > 1) {
        partials = (float *)malloc(sizeof(float) * (size_t)num_pairs * max_splits * groups * (head_dim + 2));
        if (partials == NULL) return FK_NO_MEMORY;
    }
    AttnArgs args = {q, q_row_stride, k_cache, v_cache, block_size, block_tables, table_stride, context_lens,
                     num_heads, num_kv_heads, head_dim, sliding_window, scale, out, dtype, cache_dtype, max_splits,
                     partials};
    size_t floats = (size_t)groups * head_dim * 2 + (size_t)head_dim * 2 + (size_t)groups * FK_SPAN + 2 * (size_t)groups
                    + (size_t)groups * 64;  /* the 8-lane path's lane partials */
    int rc = cpu_parallel_for(attention_range, &args, num_pairs * max_splits, work, floats);
    if (rc == FK_OK && partials != NULL) rc = merge_partials(&args, num_pairs);
    free(partials);
    return rc;
}

int fk_glu_mul(const void *gate_up, void *out, int64_t num_rows, int64_t inter, int dtype, int act) {
    SiluArgs args = {gate_up, out, inter, dtype, act};
    return cpu_parallel_for(silu_mul_range, &args, num_rows, num_rows * inter * 8, FK_CHUNK_COLS * 2);
}

int fk_silu_mul(const void *gate_up, void *out, int64_t num_rows, int64_t inter, int dtype) {
    return fk_glu_mul(gate_up, out, num_rows, inter, dtype, FK_ACT_SILU);
}

int fk_rmsnorm_rows(const void *x, int64_t row_stride, void *out, int64_t out_row_stride, const void *weight,
                    int64_t num_rows, int64_t heads, int64_t dim, float eps, int dtype) {
    NormArgs args = {x, out, weight, heads, dim, row_stride, out_row_stride, eps, dtype};
    return cpu_parallel_for(rmsnorm_range, &args, num_rows * heads, num_rows * heads * dim * 4, (size_t)dim * 2);
}
