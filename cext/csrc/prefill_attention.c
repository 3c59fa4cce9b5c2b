/* Prefill attention over the paged KV cache (prefill_attention.h): argument checks, work
 * items and the per-ISA variants of prefill_attention_impl.h, chosen per call from cpu.h's
 * switch (cpu_isa; cext.cpu.set_isa forces a lower route in tests) and run on its pool.
 *
 * A prompt chunk of T rows attends its sequence's whole context in place: the work is cut
 * into items of (sequence, kv head, up to PA_TILE_ROWS rows), run in parallel on the fused
 * kernels' pool. Each item walks its keys once, PA_SPAN at a time straight from the blocks,
 * for all of its rows x G query heads together (float32 accumulation, online softmax), so a
 * chunk's attention costs what the same rows cost inside a whole-prompt forward. Where the CPU
 * has AMX-BF16 (and fk_set_prefill_amx has not turned it off) the items run
 * prefill_attention_amx.h's variant: the same items and spans, the products on tiles. */
#include "prefill_attention.h"
#include "cpu.h"
#include "dtype.h"
#include "fused_kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PA_TILE_ROWS 64  /* query rows per item */
#define PA_SPAN 64       /* keys per online-softmax step */

typedef struct {
    int64_t seq, row0;
    int num_rows, kv_head;
} PaItem;

typedef struct PaArgs PaArgs;

struct PaArgs {
    const void *q; int64_t q_row_stride; const void *k_cache, *v_cache; int block_size;
    const int64_t *block_tables; int64_t table_stride; const int64_t *positions;
    int num_heads, num_kv_heads, head_dim; int64_t sliding_window; float scale;
    void *out; int64_t out_row_stride; int dtype, cache_dtype;
    int64_t mp;             /* lanes of Qt / Ot: PA_TILE_ROWS x G rounded up to the variant's block */
    const PaItem *items;
    void (*fn)(const PaArgs *args, int64_t begin, int64_t end, float *scratch);  /* the variant */
};

/* The query lanes m = g * rows + r of an item: last[m] the key its row sits at, first[m] the first
 * key its window keeps; lanes m_real .. m_pad - 1 are padding (last -1, first pad_first). -> the
 * item's keys lo .. hi, the least last and the greatest first over its real lanes. */
static void pa_item_lanes(const PaArgs *a, const PaItem *it, int groups, int64_t m_pad, int32_t pad_first,
                          int32_t *last, int32_t *first, int64_t *lo, int64_t *hi, int64_t *min_last,
                          int64_t *max_first) {
    const int rows = it->num_rows;
    *lo = INT64_MAX; *hi = -1; *min_last = INT64_MAX; *max_first = -1;
    for (int r = 0; r < rows; r++) {
        const int64_t pos = a->positions[it->row0 + r];
        const int64_t window = a->sliding_window;
        const int64_t f = window > 0 && pos >= window ? pos - window + 1 : 0;
        *lo = f < *lo ? f : *lo;
        *hi = pos > *hi ? pos : *hi;
        *min_last = pos < *min_last ? pos : *min_last;
        *max_first = f > *max_first ? f : *max_first;
        for (int g = 0; g < groups; g++) {
            last[g * rows + r] = (int32_t)pos;
            first[g * rows + r] = (int32_t)f;
        }
    }
    for (int64_t m = (int64_t)rows * groups; m < m_pad; m++) {
        last[m] = -1;
        first[m] = pad_first;
    }
}

#define PA_SUFFIX baseline
#define PA_VW 4
#define PA_MV 2
#include "prefill_attention_impl.h"
#undef PA_MV
#undef PA_VW
#undef PA_SUFFIX

#if defined(__x86_64__) && defined(__GNUC__)
#define PA_HAVE_X86 1
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define PA_SUFFIX avx2
#define PA_VW 8
#define PA_MV 2
#define PA_F16C 1
#include "prefill_attention_impl.h"
#undef PA_F16C
#undef PA_MV
#undef PA_VW
#undef PA_SUFFIX
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define PA_SUFFIX avx512
#define PA_VW 16
#define PA_MV 4
#define PA_F16C 1
#include "prefill_attention_impl.h"
#undef PA_F16C
#undef PA_MV
#undef PA_VW
#undef PA_SUFFIX
#pragma GCC pop_options

#if defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#define PA_HAVE_AMX 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
#include "amx_tiles.h"
#include "prefill_attention_amx.h"
#pragma GCC pop_options
#endif
#endif

static int pa_amx = 1;  /* fk_set_prefill_amx */

int fk_set_prefill_amx(int enabled) {
    const int old = pa_amx;
    pa_amx = enabled != 0;
    return old;
}

typedef void (*PaItemsFn)(const PaArgs *, int64_t, int64_t, float *);

static PaItemsFn pa_kernel(int64_t *lanes_per_block, int tiles) {
    const int isa = cpu_isa();
#ifdef PA_HAVE_X86
    if (isa == CPU_ISA_AVX512) {
        *lanes_per_block = 16 * 4;
#ifdef PA_HAVE_AMX
        if (tiles && pa_amx && cpu_allows(CPU_HAS_AMX_BF16)) return prefill_items_amx;
#endif
        return prefill_items_avx512;
    }
    if (isa == CPU_ISA_AVX2) {
        *lanes_per_block = 8 * 2;
        return prefill_items_avx2;
    }
#endif
    (void)isa;
    (void)tiles;
    *lanes_per_block = 4 * 2;
    return prefill_items_baseline;
}

static void pa_range(const void *args, int64_t begin, int64_t end, float *scratch) {
    const PaArgs *a = (const PaArgs *)args;
    a->fn(a, begin, end, scratch);
}

int fk_prefill_attention(const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
                         int64_t num_blocks, int block_size, const int64_t *block_tables,
                         int64_t table_stride, const int64_t *query_starts, const int64_t *context_lens,
                         const int64_t *positions, int num_seqs, int64_t num_rows, int num_heads,
                         int num_kv_heads, int head_dim, int64_t sliding_window, float scale, void *out,
                         int64_t out_row_stride, int dtype, int cache_dtype, int tiles) {
    if (num_seqs < 0 || num_kv_heads < 1 || num_heads % num_kv_heads != 0 || head_dim < 1 || block_size < 1)
        return FK_BAD_LENGTH;
    if (sliding_window < 0) return FK_BAD_LENGTH;
    int64_t num_items = 0, work = 0, prev_stop = 0;
    for (int b = 0; b < num_seqs; b++) {
        const int64_t start = query_starts[b], stop = query_starts[b + 1], len = context_lens[b];
        if (start < prev_stop || stop < start || stop > num_rows) return FK_BAD_POSITION;  /* rows in order */
        prev_stop = stop;
        if (len < 1 || len > INT32_MAX || (len + block_size - 1) / block_size > table_stride)
            return FK_BAD_LENGTH;
        if (stop == start) continue;
        int64_t lo = INT64_MAX, hi = -1;
        for (int64_t t = start; t < stop; t++) {
            const int64_t pos = positions[t];
            if (pos < 0 || pos >= len) return FK_BAD_POSITION;
            const int64_t first = sliding_window > 0 && pos >= sliding_window ? pos - sliding_window + 1 : 0;
            lo = first < lo ? first : lo;
            hi = pos > hi ? pos : hi;
            work += pos + 1 - first;
        }
        const int64_t *table = block_tables + (int64_t)b * table_stride;
        for (int64_t j = lo / block_size; j <= hi / block_size; j++)
            if (table[j] < 0 || table[j] >= num_blocks) return FK_BAD_BLOCK;
        num_items += (stop - start + PA_TILE_ROWS - 1) / PA_TILE_ROWS * num_kv_heads;
    }
    if (num_items == 0) return FK_OK;
    PaItem *items = (PaItem *)malloc(sizeof(PaItem) * (size_t)num_items);
    if (items == NULL) return FK_NO_MEMORY;
    int64_t n = 0;
    for (int b = 0; b < num_seqs; b++) {
        const int64_t start = query_starts[b], stop = query_starts[b + 1];
        /* Last tiles first: in a causal chunk they see the most keys (the pool's later,
         * smaller claims then even out the threads). */
        if (stop == start) continue;
        for (int64_t row0 = start + (stop - start - 1) / PA_TILE_ROWS * PA_TILE_ROWS; row0 >= start;
             row0 -= PA_TILE_ROWS) {
            const int rows = (int)(stop - row0 < PA_TILE_ROWS ? stop - row0 : PA_TILE_ROWS);
            for (int h = 0; h < num_kv_heads; h++) items[n++] = (PaItem){b, row0, rows, h};
        }
    }
    int64_t lanes = 0;
    const PaItemsFn fn = pa_kernel(&lanes, tiles);
    const int groups = num_heads / num_kv_heads;
    const int64_t dp = (head_dim + 3) & ~3;
    const int64_t mp = ((int64_t)PA_TILE_ROWS * groups + lanes - 1) / lanes * lanes;
    const PaArgs args = {q, q_row_stride, k_cache, v_cache, block_size, block_tables, table_stride, positions,
                         num_heads, num_kv_heads, head_dim, sliding_window, scale, out, out_row_stride, dtype,
                         cache_dtype, mp, items, fn};
    size_t floats = (size_t)(2 * dp * mp + 2 * PA_SPAN * dp + PA_SPAN * lanes + 4 * mp + dp);
#ifdef PA_HAVE_AMX
    if (fn == prefill_items_amx) floats = px_scratch_floats(mp, (head_dim + 31) & ~31);
#endif
    const int rc = cpu_parallel_for(pa_range, &args, num_items, work * num_heads * head_dim * 2, floats);
    free(items);
    return rc;
}
