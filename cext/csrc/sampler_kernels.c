/* The sampler kernel (see sampler_kernels.h): the stream, the selections, the choice, the
 * processing and the logprobs. The O(vocab) passes over a row are in sampler_rows.h. Scratch
 * buffers are per thread and grow to the largest vocabulary seen. */
#include "sampler_kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__unix__) || defined(__APPLE__)
#include <sys/mman.h>
#endif

#include "sampler_rows.h"

#define SK_BLOCK 1024   /* the dense draw's CDF is walked block by block */


/* ---- MT19937 (torch.Generator's CPU engine) ---- */

void sk_mt_seed(sk_mt19937 *mt, uint64_t seed) {
    mt->state[0] = (uint32_t)(seed & 0xffffffffu);
    for (int j = 1; j < 624; j++)
        mt->state[j] = 1812433253u * (mt->state[j - 1] ^ (mt->state[j - 1] >> 30)) + (uint32_t)j;
    mt->index = 624;
    mt->claim = 0;
}

static uint32_t mt_next(sk_mt19937 *mt) {
    if (mt->index >= 624) {
        uint32_t *s = mt->state;
        for (int i = 0; i < 624; i++) {
            uint32_t y = (s[i] & 0x80000000u) | (s[(i + 1) % 624] & 0x7fffffffu);
            s[i] = s[(i + 397) % 624] ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
        }
        mt->index = 0;
    }
    uint32_t y = mt->state[mt->index++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

double sk_mt_uniform(sk_mt19937 *mt) {
    uint64_t hi = mt_next(mt);
    uint64_t lo = mt_next(mt);
    uint64_t x = (hi << 32) | lo;
    return (double)(x & ((1ULL << 53) - 1)) * (1.0 / 9007199254740992.0);
}

/* ---- scratch ---- */

typedef struct { float w; int32_t id; } Pair;

typedef struct {
    int64_t capacity;
    void *region;   /* one anonymous map holding the arrays below */
    size_t region_bytes;
    float *w;       /* [V] sampling weights, or exp(raw - max) for the logprobs */
    float *copy;    /* [V] the raw row when it is processed and logprobs are wanted */
    float *vals;    /* [V] quickselect and saved allowed values */
    int32_t *cand;  /* [V] candidate ids, ascending */
    Pair *pairs;    /* [V] top-k heap, top-p candidates */
    float *bmax;    /* [V / SK_BLOCK_MAX + 1] the row's block maxima */
    uint8_t *dirty; /* [V / SK_BLOCK_MAX + 1] blocks whose max the processing may have lowered */
    int32_t *dirty_list; /* [V / SK_BLOCK_MAX + 1] those blocks, each once */
} Scratch;

static __thread Scratch scratch;

/* The scratch (24 bytes an id: 6.3 MB per thread at Gemma 3's 262,144 ids) lives in its own
 * anonymous map, so a page becomes resident only when a row's work touches it: a greedy row
 * touches the block maxima alone. From malloc it took heap pages other blocks had touched and
 * freed, resident from the start (up to ~20 MB over the engine's threads). */
static void *scratch_map(size_t bytes) {
#if defined(__unix__) || defined(__APPLE__)
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
#else
    return calloc(bytes, 1);
#endif
}

static void scratch_unmap(void *p, size_t bytes) {
    if (p == NULL) return;
#if defined(__unix__) || defined(__APPLE__)
    munmap(p, bytes);
#else
    (void)bytes;
    free(p);
#endif
}

static Scratch *scratch_for(int64_t vocab) {
    Scratch *s = &scratch;
    if (s->capacity >= vocab) return s;
    scratch_unmap(s->region, s->region_bytes);
    memset(s, 0, sizeof(*s));
    const size_t blocks = (size_t)(vocab / SK_BLOCK_MAX + 1), v = (size_t)vocab;
    const size_t sizes[8] = {v * sizeof(float), v * sizeof(float), v * sizeof(float), v * sizeof(int32_t),
                             v * sizeof(Pair), blocks * sizeof(float), blocks, blocks * sizeof(int32_t)};
    size_t offsets[8], total = 0;
    for (int i = 0; i < 8; i++) {
        offsets[i] = total;
        total += (sizes[i] + 63) & ~(size_t)63;  /* each array 64-byte aligned */
    }
    char *base = scratch_map(total);
    if (base == NULL) return NULL;
    s->region = base;
    s->region_bytes = total;
    s->w = (float *)(base + offsets[0]);
    s->copy = (float *)(base + offsets[1]);
    s->vals = (float *)(base + offsets[2]);
    s->cand = (int32_t *)(base + offsets[3]);
    s->pairs = (Pair *)(base + offsets[4]);
    s->bmax = (float *)(base + offsets[5]);
    s->dirty = (uint8_t *)(base + offsets[6]);  /* zero, as calloc gave it */
    s->dirty_list = (int32_t *)(base + offsets[7]);
    s->capacity = vocab;
    return s;
}

/* First index of the row's max (bmax from block_maxes). */
static int64_t argmax_blocks(const float *x, int64_t n, const float *bmax, float m) {
    for (int64_t b = 0, start = 0; start < n; b++, start += SK_BLOCK_MAX) {
        if (bmax[b] != m) continue;
        for (int64_t i = start; i < n && i < start + SK_BLOCK_MAX; i++)
            if (x[i] == m) return i;
    }
    return 0; /* NaN only */
}

/* ---- selection ---- */

#if SK_AVX2_PATH
/* Bit k set: p[k] > v. */
SK_AVX2 static uint32_t above_mask8(const float *p, float v) {
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_set1_ps(v), _CMP_GT_OQ));
}
#endif

/* Min-heap of (value, id) by value, then by higher id first: the root is the worst kept. */
static inline int worse(Pair a, Pair b) { return a.w < b.w || (a.w == b.w && a.id > b.id); }

static void sift_down(Pair *heap, int64_t count, int64_t i) {
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, w = i;
        if (l < count && worse(heap[l], heap[w])) w = l;
        if (r < count && worse(heap[r], heap[w])) w = r;
        if (w == i) return;
        Pair t = heap[i]; heap[i] = heap[w]; heap[w] = t;
        i = w;
    }
}

/* The k largest of x[0..n) (ties: lower id) as a min-heap in heap[0..k); returns how many
 * (min(k, n)). Visits only blocks whose max can enter. */
static int64_t top_heap(const float *x, int64_t n, const float *bmax, int64_t k, Pair *heap) {
    int64_t count = 0;
#if SK_AVX2_PATH
    int is_avx2 = sk_has_avx2();
#endif
    for (int64_t b = 0, start = 0; start < n; b++, start += SK_BLOCK_MAX) {
        if (count == k && !(bmax[b] > heap[0].w)) continue;
        int64_t end = start + SK_BLOCK_MAX <= n ? start + SK_BLOCK_MAX : n, i = start;
#if SK_AVX2_PATH
        if (count == k && is_avx2) { /* full heap: only the values above its root matter, 8 compared at once */
            for (; i + 8 <= end; i += 8) {
                uint32_t mask = above_mask8(x + i, heap[0].w);
                for (; mask != 0; mask &= mask - 1) {
                    int64_t id = i + __builtin_ctz(mask);
                    if (x[id] > heap[0].w) { /* the root rose since the mask was taken */
                        heap[0] = (Pair){x[id], (int32_t)id};
                        sift_down(heap, k, 0);
                    }
                }
            }
        }
#endif
        for (; i < end; i++) {
            if (count < k) {
                heap[count] = (Pair){x[i], (int32_t)i};
                count++;
                if (count == k)
                    for (int64_t j = k / 2; j-- > 0;) sift_down(heap, k, j);
            } else if (x[i] > heap[0].w) {
                heap[0] = (Pair){x[i], (int32_t)i};
                sift_down(heap, k, 0);
            }
        }
    }
    if (count < k)
        for (int64_t j = count / 2; j-- > 0;) sift_down(heap, count, j);
    return count;
}

#if SK_AVX2_PATH
/* collect_at_least with movemask: 8 block maxima compared at once pick the blocks to scan, and
 * in a block each 8 values give their bit mask in one instruction (with penalties and min_p,
 * a few hundred blocks hold candidates; the portable mask reduction was most of their cost). */
SK_AVX2 static int64_t collect_at_least_avx2(const float *x, int64_t n, const float *bmax, float floor, int32_t *out) {
    const __m256 fl = _mm256_set1_ps(floor);
    int64_t count = 0, num_blocks = (n + SK_BLOCK_MAX - 1) / SK_BLOCK_MAX;
    for (int64_t g = 0; g < num_blocks; g += 8) {
        uint32_t blocks = 0;
        if (g + 8 <= num_blocks)
            blocks = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(bmax + g), fl, _CMP_GE_OQ));
        else
            for (int64_t k = 0; g + k < num_blocks; k++) blocks |= (uint32_t)(bmax[g + k] >= floor) << k;
        for (; blocks != 0; blocks &= blocks - 1) {
            int64_t start = (g + __builtin_ctz(blocks)) * SK_BLOCK_MAX;
            int64_t end = start + SK_BLOCK_MAX <= n ? start + SK_BLOCK_MAX : n, i = start;
            for (; i + 8 <= end; i += 8)
                for (uint32_t mask = (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), fl, _CMP_GE_OQ));
                     mask != 0; mask &= mask - 1)
                    out[count++] = (int32_t)(i + __builtin_ctz(mask));
            for (; i < end; i++)
                if (x[i] >= floor) out[count++] = (int32_t)i;
        }
    }
    return count;
}
#endif

/* Ids with x >= floor, ascending; blocks whose max is below floor are skipped, and within a
 * block 8 values are compared at once into a bit mask walked with ctz (a branch per value
 * mispredicted whenever the candidates are many, as with penalties and min_p). */
SK_CLONES static int64_t collect_at_least(const float *x, int64_t n, const float *bmax, float floor, int32_t *out) {
#if SK_AVX2_PATH
    if (sk_has_avx2()) return collect_at_least_avx2(x, n, bmax, floor, out);
#endif
    int64_t count = 0;
    const vf8 fl = {floor, floor, floor, floor, floor, floor, floor, floor};
    const vi8 lane_bits = {1, 2, 4, 8, 16, 32, 64, 128};
    for (int64_t b = 0, start = 0; start < n; b++, start += SK_BLOCK_MAX) {
        if (!(bmax[b] >= floor)) continue;
        int64_t end = start + SK_BLOCK_MAX <= n ? start + SK_BLOCK_MAX : n;
        int64_t i = start;
        for (; i + 8 <= end; i += 8) {
            vi8 bits = (load8(x + i) >= fl) & lane_bits;  /* bit k set: x[i + k] >= floor */
            bits |= __builtin_shufflevector(bits, bits, 4, 5, 6, 7, 0, 1, 2, 3);
            bits |= __builtin_shufflevector(bits, bits, 2, 3, 0, 1, 6, 7, 4, 5);
            bits |= __builtin_shufflevector(bits, bits, 1, 0, 3, 2, 5, 4, 7, 6);
            for (uint32_t mask = (uint32_t)bits[0]; mask != 0; mask &= mask - 1)
                out[count++] = (int32_t)(i + __builtin_ctz(mask));
        }
        for (; i < end; i++)
            if (x[i] >= floor) out[count++] = (int32_t)i;
    }
    return count;
}

static int by_weight_then_id(const void *pa, const void *pb) {
    const Pair *a = pa, *b = pb;
    if (a->w != b->w) return a->w > b->w ? -1 : 1;
    return (a->id > b->id) - (a->id < b->id);
}

static int by_id(const void *pa, const void *pb) {
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    return (a > b) - (a < b);
}

/* ---- the choice ---- */

/* First i (in id order over w[0..n)) where the running sum passes target; the dense CDF. */
static int64_t draw_dense(const float *w, int64_t n, double u) {
    double block_sums[(n + SK_BLOCK - 1) / SK_BLOCK];
    int64_t num_blocks = (n + SK_BLOCK - 1) / SK_BLOCK;
    double total = 0.0;
    for (int64_t b = 0; b < num_blocks; b++) {
        int64_t len = (b + 1) * SK_BLOCK <= n ? SK_BLOCK : n - b * SK_BLOCK;
        block_sums[b] = row_sum(w + b * SK_BLOCK, len);
        total += block_sums[b];
    }
    double target = u * total, cum = 0.0;
    for (int64_t b = 0; b < num_blocks; b++) {
        if (cum + block_sums[b] <= target && b + 1 < num_blocks) {
            cum += block_sums[b];
            continue;
        }
        int64_t end = (b + 1) * SK_BLOCK <= n ? (b + 1) * SK_BLOCK : n;
        for (int64_t i = b * SK_BLOCK; i < end; i++) {
            cum += w[i];
            if (cum > target) return i;
        }
    }
    for (int64_t i = n - 1; i > 0; i--) /* rounding at the very end: the last kept id */
        if (w[i] > 0.0f) return i;
    return 0;
}

static int64_t draw_sparse(const float *w, const int32_t *cand, int64_t n, double u) {
    double total = 0.0;
    for (int64_t j = 0; j < n; j++) total += w[cand[j]];
    double target = u * total, cum = 0.0;
    for (int64_t j = 0; j < n; j++) {
        cum += w[cand[j]];
        if (cum > target) return cand[j];
    }
    return cand[n - 1];
}

/* Top-p over the candidates cand[0..n) (ascending ids, weights w, total mass z of every kept
 * id): keeps the smallest prefix by weight (ties: lower id) whose mass reaches top_p * z, the
 * first always; cand is rewritten (ascending). An id with w <= cut = (1 - top_p) * z / (number
 * of kept ids) has at least top_p * z before it, so only ids above cut are sorted. */
static int64_t apply_top_p(const float *w, int32_t *cand, int64_t n, double z, double cut, float top_p, Pair *pairs) {
    int64_t num_pairs = 0;
    for (int64_t j = 0; j < n; j++)
        if (w[cand[j]] > cut) pairs[num_pairs++] = (Pair){w[cand[j]], cand[j]};
    qsort(pairs, num_pairs, sizeof(Pair), by_weight_then_id);
    double mass = (double)top_p * z, cum = 0.0;
    int64_t kept = 0;
    while (kept < num_pairs && (kept == 0 || cum < mass)) cum += pairs[kept++].w;
    for (int64_t j = 0; j < kept; j++) cand[j] = pairs[j].id;
    qsort(cand, kept, sizeof(int32_t), by_id);
    return kept;
}

/* m and s->bmax: the row's max and block maxima. */
static int64_t choose_random(const float *row, int64_t vocab, const sk_row *r, Scratch *s, float m) {
    if (!(m > -INFINITY)) return argmax_blocks(row, vocab, s->bmax, m); /* everything masked */
    float inv_t = 1.0f / r->temperature, shift = m * inv_t;
    float *w = s->w;
    int32_t *cand = s->cand;
    double u = sk_mt_uniform(r->rng);
    int is_top_k = r->top_k > 0 && r->top_k < vocab;
    int is_top_p = r->top_p < 1.0f;
    float floor = -INFINITY; /* logits below it cannot be kept */
    if (is_top_k && top_heap(row, vocab, s->bmax, r->top_k, s->pairs) == r->top_k) floor = s->pairs[0].w;
    if (r->min_p > 0.0f) { /* w >= min_p <=> l >= m + T log(min_p), up to rounding: a margin, then the exact test */
        float at_min_p = m + logf(r->min_p) * r->temperature;
        at_min_p -= 1e-3f * (1.0f + fabsf(at_min_p));
        floor = at_min_p > floor ? at_min_p : floor;
    }
    int64_t n;
    double z = 0.0, cut = 0.0;
    if (floor > -INFINITY) { /* sparse: weights of the candidates only */
        int64_t num_found = collect_at_least(row, vocab, s->bmax, floor, cand);
        float min_w = r->min_p > 0.0f ? r->min_p : 0.0f;
        n = 0;
        for (int64_t j = 0; j < num_found; j++) {
            float v = fast_exp(row[cand[j]] * inv_t - shift);
            w[cand[j]] = v;
            if (v > 0.0f && v >= min_w) {
                cand[n++] = cand[j];
                z += v;
            }
        }
        if (n == 0) return argmax_blocks(row, vocab, s->bmax, m);
        if (!is_top_p || n == 1) return draw_sparse(w, cand, n, u);
        cut = (1.0 - r->top_p) * z / (double)n;
    } else { /* dense: every id has a weight */
        exp_into(row, vocab, inv_t, shift, 0.0f, w);
        if (!is_top_p) return draw_dense(w, vocab, u);
        z = row_sum(w, vocab);
        cut = (1.0 - r->top_p) * z / (double)vocab;
        n = 0;
        for (int64_t i = 0; i < vocab; i++)
            if (w[i] > cut) cand[n++] = (int32_t)i;
    }
    n = apply_top_p(w, cand, n, z, cut, r->top_p, s->pairs);
    return draw_sparse(w, cand, n, u);
}

/* ---- processing and logprobs ---- */

/* is_a ? a : b without a branch (the condition is a coin flip per id: a branch mispredicts). */
static inline float select_f(int is_a, float a, float b) {
    uint32_t ua, ub, mask = (uint32_t)0 - (uint32_t)(is_a != 0);
    memcpy(&ua, &a, sizeof(ua));
    memcpy(&ub, &b, sizeof(ub));
    uint32_t out = (ua & mask) | (ub & ~mask);
    float f;
    memcpy(&f, &out, sizeof(f));
    return f;
}

/* Applies the row's processing in place after block_maxes (the row is in cache by then) and
 * keeps s->bmax exact: a raised value raises its block's max, a lowered one that was its block's
 * max puts the block on a list for a rescan (a walk over every block's flag cost more than
 * the touched ids). The touched ids are prefetched 16 ahead (they are scattered over the row).
 * Returns SK_OK or SK_BAD_ID; *m becomes the new row max. Cloned for AVX2. */
SK_CLONES static int process_row(float *row, int64_t vocab, const sk_row *r, Scratch *s, float *m) {
    float *bmax = s->bmax;
    uint8_t *dirty = s->dirty;
    int32_t *dirty_list = s->dirty_list;
    int64_t num_dirty = 0;
    if (r->allowed_ids != NULL) {
        for (int64_t j = 0; j < r->num_allowed; j++) {
            int64_t id = r->allowed_ids[j];
            if (id < 0 || id >= vocab) return SK_BAD_ID;
            s->vals[j] = row[id];
        }
        for (int64_t i = 0; i < vocab; i++) row[i] = -INFINITY;
        for (int64_t j = 0; j < r->num_allowed; j++) row[r->allowed_ids[j]] = s->vals[j];
        block_maxes(row, vocab, bmax);
    }
    for (int64_t j = 0; j < r->num_masked; j++) {
        int64_t id = r->masked_ids[j], b = id / SK_BLOCK_MAX;
        if (id < 0 || id >= vocab) return SK_BAD_ID;
        if (row[id] == bmax[b] && !dirty[b]) {
            dirty[b] = 1;
            dirty_list[num_dirty++] = (int32_t)b;
        }
        row[id] = -INFINITY;
    }
    const int64_t *ids = r->ids;
    const float *bias = r->bias, *scale = r->scale, *sub = r->sub;
    int64_t num_touched = r->num_touched;
    for (int64_t j = 0; j < num_touched; j++) {
        int64_t id = ids[j], b = id / SK_BLOCK_MAX;
        if (id < 0 || id >= vocab) return SK_BAD_ID;
        if (j + 16 < num_touched) __builtin_prefetch(row + ids[j + 16], 1); /* a hint: never faults */
        float old = row[id], v = old + bias[j];
        v = select_f(v > 0.0f, v / scale[j], v * scale[j]) - sub[j];
        row[id] = v;
        float block_max = bmax[b];
        bmax[b] = v > block_max ? v : block_max;
        if (old == block_max && v < old && !dirty[b]) {
            dirty[b] = 1;
            dirty_list[num_dirty++] = (int32_t)b;
        }
    }
    int64_t num_blocks = (vocab + SK_BLOCK_MAX - 1) / SK_BLOCK_MAX;
    for (int64_t k = 0; k < num_dirty; k++) {
        int64_t b = dirty_list[k], start = b * SK_BLOCK_MAX;
        dirty[b] = 0;
        bmax[b] = max_of(row + start, start + SK_BLOCK_MAX <= vocab ? SK_BLOCK_MAX : vocab - start);
    }
    *m = max_of(bmax, num_blocks);
    return SK_OK;
}

/* logprob, rank and top-k of target under log_softmax(raw). */
static void row_logprobs(const float *raw, int64_t vocab, int64_t target, int32_t num_top, Scratch *s,
                         float *logprob, int64_t *rank, int64_t *top_ids, float *top_logprobs) {
    float m = block_maxes(raw, vocab, s->bmax);
    exp_into(raw, vocab, 1.0f, m, 0.0f, s->w);
    double lse = (double)m + log(row_sum(s->w, vocab));
    *logprob = (float)((double)raw[target] - lse);
    *rank = count_at_least(raw, vocab, raw[target]);
    if (num_top <= 0) return;
    Pair heap[num_top];
    int64_t count = top_heap(raw, vocab, s->bmax, num_top, heap);
    qsort(heap, count, sizeof(Pair), by_weight_then_id);
    for (int64_t j = 0; j < count; j++) {
        top_ids[j] = heap[j].id;
        top_logprobs[j] = (float)((double)heap[j].w - lse);
    }
}

/* One row of sk_sample_rows. */
static int sample_row(float *row, int64_t vocab, const sk_row *r, sk_result *out, Scratch *s, int process_only) {
    const float *raw = row;
    int is_processed = r->allowed_ids != NULL || r->num_masked > 0 || r->num_touched > 0;
    if (is_processed && r->num_top >= 0 && !process_only) {
        memcpy(s->copy, row, vocab * sizeof(float));
        raw = s->copy;
    }
    float m = block_maxes(row, vocab, s->bmax);
    if (is_processed) {
        int rc = process_row(row, vocab, r, s, &m);
        if (rc != SK_OK) return rc;
    }
    if (process_only) return SK_OK;
    if (r->temperature > 0.0f && r->rng != NULL)
        out->token_id = choose_random(row, vocab, r, s, m);
    else
        out->token_id = argmax_blocks(row, vocab, s->bmax, m);
    if (r->num_top >= 0)
        row_logprobs(raw, vocab, out->token_id, r->num_top, s, &out->logprob, &out->rank, out->top_ids,
                     out->top_logprobs);
    return SK_OK;
}

typedef struct {
    float *logits;
    int64_t vocab;
    const sk_row *rows;
    sk_result *results;
    int process_only;
    int rc;  /* the first error any thread met (SK_OK: none) */
    const int64_t *run_starts;  /* items are runs of rows [run_starts[i], run_starts[i + 1]); NULL: rows */
} SampleJob;

/* Items [begin, end) on this thread, with this thread's scratch (cpu_parallel_for's range function). */
static void sample_range(const void *args, int64_t begin, int64_t end, float *unused) {
    (void)unused;
    SampleJob *job = (SampleJob *)args;
    Scratch *s = scratch_for(job->vocab);
    int rc = s == NULL ? SK_NO_MEMORY : SK_OK;
    if (job->run_starts != NULL) {
        begin = job->run_starts[begin];
        end = job->run_starts[end];
    }
    for (int64_t i = begin; i < end && rc == SK_OK; i++)
        rc = sample_row(job->logits + i * job->vocab, job->vocab, &job->rows[i], &job->results[i], s,
                        job->process_only);
    if (rc != SK_OK) {
        int expected = SK_OK;
        __atomic_compare_exchange_n(&job->rc, &expected, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
}

/* A batch of at least this many rows is shared with the thread pool: a row is an O(vocab) read of
 * memory (196 KB at a 49k vocabulary, ~15 us from L3 at batch 64). Rows of different streams are
 * independent; rows drawing from one stream (a speculative proposal's verification rows) must
 * draw in row order on one thread: the pool's items are then runs of consecutive rows of one
 * stream, so the result is the same on any number of threads. */
#define SK_PARALLEL_ROWS 4

/* Runs of consecutive rows with one stream (a row without a stream is a run of its own) into
 * starts[0..R] (R + 1 entries) -> R; -1 when a stream reappears after another (the rows run
 * serially then). Each run stamps its stream with this call's number, so a reappearance shows in
 * one pass. */
static int64_t stream_runs(const sk_row *rows, int64_t num_rows, int64_t *starts) {
    static uint64_t calls;
    const uint64_t call = __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
    int64_t num_runs = 0, result = 0;
    for (int64_t i = 0; i < num_rows; i++) {
        sk_mt19937 *rng = rows[i].rng;
        if (i > 0 && rng != NULL && rng == rows[i - 1].rng) continue;
        starts[num_runs++] = i;
        if (rng != NULL) {
            if (rng->claim == call) result = -1;
            rng->claim = call;
        }
    }
    starts[num_runs] = num_rows;
    return result < 0 ? result : num_runs;
}

int sk_sample_rows(float *logits, int64_t num_rows, int64_t vocab, const sk_row *rows, sk_result *results,
                   int process_only) {
    SampleJob job = {logits, vocab, rows, results, process_only, SK_OK, NULL};
    if (num_rows < SK_PARALLEL_ROWS) {
        sample_range(&job, 0, num_rows, NULL);
        return job.rc;
    }
    int64_t *starts = malloc((size_t)(num_rows + 1) * sizeof(int64_t));
    if (starts == NULL) return SK_NO_MEMORY;
    int64_t num_runs = stream_runs(rows, num_rows, starts);
    int rc = CPU_OK;
    if (num_runs < 0) {
        sample_range(&job, 0, num_rows, NULL);
    } else if (num_runs == num_rows) {
        rc = cpu_parallel_for(sample_range, &job, num_rows, num_rows * vocab, 0);
    } else {
        job.run_starts = starts;
        rc = cpu_parallel_for(sample_range, &job, num_runs, num_rows * vocab, 0);
    }
    free(starts);
    return rc != CPU_OK ? SK_NO_MEMORY : job.rc;
}

int sk_logprob_rows(const float *logits, int64_t num_rows, int64_t vocab, const int64_t *target_ids,
                    int32_t num_top, float *logprobs, int64_t *ranks, int64_t *top_ids, float *top_logprobs) {
    Scratch *s = scratch_for(vocab);
    if (s == NULL) return SK_NO_MEMORY;
    for (int64_t i = 0; i < num_rows; i++) {
        if (target_ids[i] < 0 || target_ids[i] >= vocab) return SK_BAD_ID;
        row_logprobs(logits + i * vocab, vocab, target_ids[i], num_top, s, &logprobs[i], &ranks[i],
                     top_ids + i * num_top, top_logprobs + i * num_top);
    }
    return SK_OK;
}
