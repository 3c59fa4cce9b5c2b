/* The AMX variant of prefill_attention_impl.h (included once by prefill_attention.c, inside a
 * `#pragma GCC target` region with AVX-512 BF16 and AMX-BF16): the same items, spans and online
 * softmax, with the two products of each span on bfloat16 tiles, as exact as the float32 kernel
 * to 2^-16 (the amx3 product route's split, cext/csrc/qgemm_amx3.h):
 *
 * - every operand is split into two bfloat16, v = vh + vl (vh = v rounded, vl = the rest rounded):
 *   16 significant bits; float16 and bfloat16 cache values split exactly (11 and 8 bits);
 * - scores S = Q K^T as qh.kh + ql.kh + qh.kl on `tdpbf16ps` (float32 sums; ql.kl, below 2^-16 of
 *   each term, dropped); then the online softmax in float32 on AVX-512, row by row (a row is a
 *   query vector, its 16 x 4 lanes the span's keys); then O += P V as ph.vh + pl.vh + ph.vl.
 *
 * Layouts, queries in tile rows (lane m = g * rows + r as the vector kernel): per item the scaled
 * queries' A tiles Qa [Mp / 16][Dq / 32][h, l] (16 query rows x 32 bfloat16 of a 32-wide d chunk);
 * per span the keys' B tiles Kb [4 key tiles][Dq / 32][h, l] (row p: inputs d = 2p, 2p + 1 of the
 * 16 keys, so one 16 x 16 transpose of 32-bit pairs per tile) and the values' B tiles
 * Vb [2 key chunks][Dq / 16][h, l] (row p: keys 2p, 2p + 1 of 16 values of d: two value rows
 * interleaved). O [Mp, Dq] float32 stays in memory: each span scales its rows by the softmax
 * correction (AVX-512), then loads them into C tiles, adds P V and stores them. Per q tile the
 * spans past its last key (or before its window) are skipped: they would add nothing. */

#define PX_T 16
#define PX_KT (PA_SPAN / PX_T)  /* key tiles of a span */

/* 16 values of a cache or activation row at src (dtype) as float32; n < 16: the rest zero. */
static inline __m512 px_load16(const void *src, int n, int dtype) {
    const __mmask16 k = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    if (dtype == FK_FLOAT32) return _mm512_maskz_loadu_ps(k, src);
    const __m256i w = _mm256_maskz_loadu_epi16(k, src);
    if (dtype == FK_FLOAT16) return _mm512_cvtph_ps(w);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
}

/* 16 x 16 transpose of 32-bit elements: rows r[0..15] in, columns out in place. */
static inline void px_transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int b = 0; b < 16; b += 4) {  /* per 128-bit lane L: u[b + j] = column 4 L + j of rows b .. b + 3 */
        t[b] = _mm512_unpacklo_epi32(r[b], r[b + 1]);
        t[b + 1] = _mm512_unpackhi_epi32(r[b], r[b + 1]);
        t[b + 2] = _mm512_unpacklo_epi32(r[b + 2], r[b + 3]);
        t[b + 3] = _mm512_unpackhi_epi32(r[b + 2], r[b + 3]);
        u[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]);
        u[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
        u[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]);
        u[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
    }
    for (int j = 0; j < 4; j++) {  /* column 4 L + j: lane L of u[j], u[4 + j], u[8 + j], u[12 + j] */
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
        r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[4 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* The vector kernel's exp (prefill_attention_impl.h's, AVX-512 variant) on a __m512. */
static inline __m512 px_exp(__m512 x) { return (__m512)vexp_avx512((vf_avx512)x); }

#define PX_TAU 8.0f  /* a row's reference max moves only when a score passes it by this (e^8 fits) */

/* Scratch floats of one thread (prefill_attention.c's scratch for this variant). */
static inline size_t px_scratch_floats(int64_t mp, int dq) {
    return 16 + (size_t)mp * dq                 /* Qa: Mp x Dq x 2 bfloat16 */
           + (size_t)mp * dq                    /* O */
           + (size_t)PA_SPAN * dq               /* Kb: 64 keys x Dq x 2 bfloat16 */
           + (size_t)PA_SPAN * dq               /* Vb */
           + 2 * (size_t)PX_T * PA_SPAN         /* S, two q tiles' (16 x 64) */
           + 2 * (size_t)PX_T * PA_SPAN         /* P, two q tiles' (2 key chunks x h, l: 16 x 32 bfloat16) */
           + (size_t)mp * 16                    /* running sums, a vector a row */
           + 3 * (size_t)mp                     /* running max, first, last */
           + (size_t)mp / PX_T * 2              /* the q tiles a span reaches (int64) */
           + (size_t)mp / PX_T * 4;             /* each q tile's key bounds (PX_BOUNDS) */
}

/* A q tile's key bounds over its real rows, set once per item: the last key any row sees, the
 * first, the least last and the greatest first (spans between the last two need no mask). */
enum { PX_Q_LAST, PX_Q_FIRST, PX_MIN_LAST, PX_MAX_FIRST, PX_BOUNDS };

/* One span of one item: what the three stages of a q tile read. */
typedef struct {
    const uint16_t *qa, *kb, *vb;
    float *o, *run_max, *run_sum;
    const int32_t *first, *last, *bounds;  /* bounds: [Mp / 16][PX_BOUNDS] */
    int64_t k0;
    int n, dq, nd;
} PxSpan;

/* S = Q K^T of the q tile at q0 (16 query rows x the span's 64 keys) -> s [16][64]. */
static inline void px_scores(const PxSpan *sp, int64_t q0, float *s) {
    const int nd = sp->nd;
    const uint16_t *qt = sp->qa + (size_t)(q0 / PX_T) * nd * 2 * 512, *kb = sp->kb;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int dc = 0; dc < nd; dc++) {
        _tile_loadd(4, qt + (size_t)dc * 1024, 64);
        _tile_loadd(5, qt + (size_t)dc * 1024 + 512, 64);
#define PX_SCORES(c, kt)                                                  \
    _tile_loadd(6, kb + ((size_t)((kt) * nd + dc) * 2) * 512, 64);       \
    _tile_loadd(7, kb + ((size_t)((kt) * nd + dc) * 2) * 512 + 512, 64); \
    _tile_dpbf16ps(c, 4, 6); _tile_dpbf16ps(c, 5, 6); _tile_dpbf16ps(c, 4, 7);
        PX_SCORES(0, 0) PX_SCORES(1, 1) PX_SCORES(2, 2) PX_SCORES(3, 3)
#undef PX_SCORES
    }
    _tile_stored(0, s, PA_SPAN * 4);
    _tile_stored(1, s + 16, PA_SPAN * 4);
    _tile_stored(2, s + 32, PA_SPAN * 4);
    _tile_stored(3, s + 48, PA_SPAN * 4);
}

/* The online softmax of the q tile's rows over s: masked keys -inf; a row whose scores pass its
 * reference max by PX_TAU takes their max as the new reference, its O row and sums scaled by
 * exp(old - new) (else the reference stays: probabilities up to e^PX_TAU, the same quotient);
 * P = exp(s - reference) split into pa's two key chunks' h and l tiles; sums per lane. */
static inline void px_softmax(const PxSpan *sp, int64_t q0, const float *s, uint16_t *pa) {
    const int64_t k0 = sp->k0;
    const int n = sp->n, dq = sp->dq;
    const int32_t *b = sp->bounds + (q0 / PX_T) * PX_BOUNDS;
    const int is_masked = k0 + n - 1 > b[PX_MIN_LAST] || k0 < b[PX_MAX_FIRST] || n < PA_SPAN;  /* n: keys past hi */
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
    for (int i = 0; i < PX_T; i++) {
        const int64_t m = q0 + i;
        const float *srow = s + i * PA_SPAN;
        uint16_t *prow = pa + i * 32;
        if (sp->last[m] < 0) {  /* a padding row: P zero */
            for (int t = 0; t < 4; t++) _mm512_store_si512((void *)(prow + t * 512), _mm512_setzero_si512());
            continue;
        }
        __m512 x[PX_KT];
        for (int v = 0; v < PX_KT; v++) {
            x[v] = _mm512_loadu_ps(srow + 16 * v);
            if (is_masked) {
                const __m512i keys = _mm512_add_epi32(iota, _mm512_set1_epi32((int32_t)(k0 + 16 * v)));
                const __mmask16 ok = _mm512_cmp_epi32_mask(keys, _mm512_set1_epi32(sp->last[m]), _MM_CMPINT_LE)
                                     & _mm512_cmp_epi32_mask(keys, _mm512_set1_epi32(sp->first[m]), _MM_CMPINT_NLT);
                x[v] = _mm512_mask_blend_ps(ok, ninf, x[v]);
            }
        }
        const __m512 top = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
        float ref = sp->run_max[m];
        float *sum_row = sp->run_sum + m * 16;
        if (_mm512_cmp_ps_mask(top, _mm512_set1_ps(ref + PX_TAU), _CMP_GT_OQ)) {
            const float mx = _mm512_reduce_max_ps(top);
            const __m512 corr = px_exp(_mm512_set1_ps(ref - mx));
            float *orow = sp->o + m * dq;
            for (int d = 0; d < dq; d += 16) _mm512_store_ps(orow + d, _mm512_mul_ps(_mm512_load_ps(orow + d), corr));
            _mm512_store_ps(sum_row, _mm512_mul_ps(_mm512_load_ps(sum_row), corr));
            ref = sp->run_max[m] = mx;
        }
        const __m512 refv = _mm512_set1_ps(ref);
        __m512 sum = _mm512_load_ps(sum_row);
        for (int v = 0; v < PX_KT; v++) {
            x[v] = px_exp(_mm512_sub_ps(x[v], refv));
            sum = _mm512_add_ps(sum, x[v]);
        }
        _mm512_store_ps(sum_row, sum);
        for (int kc = 0; kc < 2; kc++) {
            __m512i h, l;
            amx_split32(x[2 * kc], x[2 * kc + 1], &h, &l);
            _mm512_store_si512((void *)(prow + kc * 1024), h);
            _mm512_store_si512((void *)(prow + kc * 1024 + 512), l);
        }
    }
}

/* O rows q0 .. q0 + 15 += P V (pa: the tile's P), four d tiles at a time. */
static inline void px_values(const PxSpan *sp, int64_t q0, const uint16_t *pa) {
    const int dq = sp->dq;
    const size_t ostride = (size_t)dq * 4;
    for (int d0 = 0; d0 < dq; d0 += 64) {
        const int ntiles = (dq - d0) / 16 < 4 ? (dq - d0) / 16 : 4;
        float *oq = sp->o + q0 * dq + d0;
        _tile_loadd(0, oq, ostride);
        if (ntiles > 1) _tile_loadd(1, oq + 16, ostride);
        if (ntiles > 2) _tile_loadd(2, oq + 32, ostride);
        if (ntiles > 3) _tile_loadd(3, oq + 48, ostride);
        for (int kc = 0; kc < 2; kc++) {
            _tile_loadd(4, pa + kc * 1024, 64);
            _tile_loadd(5, pa + kc * 1024 + 512, 64);
#define PX_VALUES(c, t)                                                                      \
    if ((t) < ntiles) {                                                                      \
        const uint16_t *vt = sp->vb + ((size_t)(kc * (dq / 16) + d0 / 16 + (t)) * 2) * 512;  \
        _tile_loadd(6, vt, 64);                                                              \
        _tile_loadd(7, vt + 512, 64);                                                        \
        _tile_dpbf16ps(c, 4, 6); _tile_dpbf16ps(c, 5, 6); _tile_dpbf16ps(c, 4, 7);           \
    }
            PX_VALUES(0, 0) PX_VALUES(1, 1) PX_VALUES(2, 2) PX_VALUES(3, 3)
#undef PX_VALUES
        }
        _tile_stored(0, oq, ostride);
        if (ntiles > 1) _tile_stored(1, oq + 16, ostride);
        if (ntiles > 2) _tile_stored(2, oq + 32, ostride);
        if (ntiles > 3) _tile_stored(3, oq + 48, ostride);
    }
}

static void prefill_items_amx(const PaArgs *a, int64_t begin, int64_t end, float *scratch) {
    const int dim = a->head_dim, num_kv = a->num_kv_heads, groups = a->num_heads / num_kv;
    const int dq = (dim + 31) & ~31, nd = dq / 32, bs = a->block_size;
    const int64_t mp = a->mp;
    const size_t cache_esize = a->cache_dtype == FK_FLOAT32 ? 4 : 2;
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    uint16_t *qa = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);  /* [Mp/16][nd][2][512] */
    float *o = (float *)(qa + (size_t)mp * dq * 2);                           /* [Mp][Dq] */
    uint16_t *kb = (uint16_t *)(o + (size_t)mp * dq);                         /* [4][nd][2][512] */
    uint16_t *vb = kb + (size_t)PA_SPAN * dq * 2;                             /* [2][Dq/16][2][512] */
    float *s = (float *)(vb + (size_t)PA_SPAN * dq * 2);                      /* [2][16][64] */
    uint16_t *pa = (uint16_t *)(s + 2 * PX_T * PA_SPAN);                      /* [2][2][2][512] */
    float *run_sum = (float *)(pa + 4 * PX_T * PA_SPAN);                      /* [Mp][16] */
    float *run_max = run_sum + mp * 16;
    int32_t *last = (int32_t *)(run_max + mp), *first = last + mp;
    int64_t *active = (int64_t *)(first + mp);  /* [Mp / 16] */
    int32_t *bounds = (int32_t *)(active + mp / PX_T);  /* [Mp / 16][PX_BOUNDS] */
    amx_configure_square();
    for (int64_t item = begin; item < end; item++) {
        const PaItem it = a->items[item];
        const int64_t *table = a->block_tables + it.seq * a->table_stride;
        const int rows = it.num_rows, kvh = it.kv_head;
        const int m_real = rows * groups;
        const int64_t m_pad = (m_real + PX_T - 1) / PX_T * PX_T;
        int64_t lo, hi, min_last, max_first;  /* the q tiles take their own bounds */
        pa_item_lanes(a, &it, groups, m_pad, INT32_MAX, last, first, &lo, &hi, &min_last, &max_first);
        for (int64_t q0 = 0; q0 < m_pad; q0 += PX_T) {
            int32_t *b = bounds + (q0 / PX_T) * PX_BOUNDS;
            b[PX_Q_LAST] = -1; b[PX_Q_FIRST] = INT32_MAX; b[PX_MIN_LAST] = INT32_MAX; b[PX_MAX_FIRST] = -1;
            for (int i = 0; i < PX_T; i++) {
                const int32_t la = last[q0 + i], fi = first[q0 + i];
                if (la < 0) continue;  /* padding */
                b[PX_Q_LAST] = la > b[PX_Q_LAST] ? la : b[PX_Q_LAST];
                b[PX_Q_FIRST] = fi < b[PX_Q_FIRST] ? fi : b[PX_Q_FIRST];
                b[PX_MIN_LAST] = la < b[PX_MIN_LAST] ? la : b[PX_MIN_LAST];
                b[PX_MAX_FIRST] = fi > b[PX_MAX_FIRST] ? fi : b[PX_MAX_FIRST];
            }
        }
        /* Qa: the scaled queries split, rows past m_real and d past dim zero. */
        const __m512 scale = _mm512_set1_ps(a->scale);
        for (int64_t m = 0; m < m_pad; m++) {
            const int r = (int)(m % rows), g = (int)(m / rows);
            const char *q_row = m < m_real ? (const char *)a->q + (size_t)((it.row0 + r) * a->q_row_stride) * esize
                                              + (size_t)(kvh * groups + g) * dim * esize
                                           : NULL;
            for (int dc = 0; dc < nd; dc++) {
                __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
                if (q_row != NULL) {
                    const int d0 = dc * 32;
                    x0 = _mm512_mul_ps(px_load16(q_row + (size_t)d0 * esize, dim - d0, a->dtype), scale);
                    if (dim - d0 > 16)
                        x1 = _mm512_mul_ps(px_load16(q_row + (size_t)(d0 + 16) * esize, dim - d0 - 16, a->dtype), scale);
                }
                __m512i h, l;
                amx_split32(x0, x1, &h, &l);
                uint16_t *t = qa + ((size_t)((m / PX_T) * nd + dc) * 2) * 512 + (m % PX_T) * 32;
                _mm512_store_si512((void *)t, h);
                _mm512_store_si512((void *)(t + 512), l);
            }
            run_max[m] = -1e30f;
            _mm512_store_ps(run_sum + m * 16, _mm512_setzero_ps());
            for (int d = 0; d < dq; d += 16) _mm512_store_ps(o + m * dq + d, _mm512_setzero_ps());
        }
        for (int64_t k0 = lo; k0 <= hi; k0 += PA_SPAN) {
            const int n = hi + 1 - k0 < PA_SPAN ? (int)(hi + 1 - k0) : PA_SPAN;
            /* Kb: per key tile and d chunk, the 16 keys' pairs transposed into the tile's rows. */
            for (int kt = 0; kt < PX_KT; kt++) {
                for (int dc = 0; dc < nd; dc++) {
                    __m512i th[16], tl[16];
                    for (int j = 0; j < 16; j++) {
                        const int key_j = kt * 16 + j;
                        __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
                        if (key_j < n) {
                            const int64_t key = k0 + key_j;
                            const int64_t slot = table[key / bs] * bs + key % bs;
                            const char *kr = (const char *)a->k_cache + (size_t)((slot * num_kv + kvh) * dim) * cache_esize;
                            const int d0 = dc * 32;
                            x0 = px_load16(kr + (size_t)d0 * cache_esize, dim - d0, a->cache_dtype);
                            if (dim - d0 > 16) x1 = px_load16(kr + (size_t)(d0 + 16) * cache_esize, dim - d0 - 16, a->cache_dtype);
                        }
                        amx_split32(x0, x1, &th[j], &tl[j]);  /* key j's 16 pairs (32-bit) of h, of l */
                    }
                    px_transpose16(th);
                    px_transpose16(tl);
                    uint16_t *t = kb + ((size_t)(kt * nd + dc) * 2) * 512;
                    for (int p = 0; p < 16; p++) {
                        _mm512_store_si512((void *)(t + p * 32), th[p]);
                        _mm512_store_si512((void *)(t + 512 + p * 32), tl[p]);
                    }
                }
            }
            /* Vb: per chunk of 32 keys and 16 values of d, keys 2p and 2p + 1 interleaved in row p. */
            const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                   23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
            for (int j = 0; j < PA_SPAN; j += 2) {
                const char *vr[2] = {NULL, NULL};
                for (int e = 0; e < 2; e++) {
                    if (j + e < n) {
                        const int64_t key = k0 + j + e;
                        const int64_t slot = table[key / bs] * bs + key % bs;
                        vr[e] = (const char *)a->v_cache + (size_t)((slot * num_kv + kvh) * dim) * cache_esize;
                    }
                }
                for (int dt = 0; dt < dq / 16; dt++) {
                    const int d0 = dt * 16;
                    const __m512 v0 = vr[0] != NULL && d0 < dim ? px_load16(vr[0] + (size_t)d0 * cache_esize, dim - d0, a->cache_dtype)
                                                                 : _mm512_setzero_ps();
                    const __m512 v1 = vr[1] != NULL && d0 < dim ? px_load16(vr[1] + (size_t)d0 * cache_esize, dim - d0, a->cache_dtype)
                                                                 : _mm512_setzero_ps();
                    __m512i h, l;
                    amx_split32(v0, v1, &h, &l);  /* [key 2p: 16 d | key 2p + 1: 16 d] */
                    uint16_t *t = vb + ((size_t)((j / 32) * (dq / 16) + dt) * 2) * 512 + ((j % 32) / 2) * 32;
                    _mm512_store_si512((void *)t, _mm512_permutexvar_epi16(order, h));
                    _mm512_store_si512((void *)(t + 512), _mm512_permutexvar_epi16(order, l));
                }
            }
            /* the q tiles this span reaches (a q tile wholly past its keys or before its window
             * would add nothing), then a pipeline over them: the scores of one, the softmax of the
             * one before, the values of the one before that (each stage reads what the last wrote
             * an iteration earlier, not what its own stores have just left in flight) */
            int na = 0;
            for (int64_t q0 = 0; q0 < m_pad; q0 += PX_T) {
                const int32_t *b = bounds + (q0 / PX_T) * PX_BOUNDS;
                if (b[PX_Q_LAST] >= k0 && (int64_t)b[PX_Q_FIRST] <= k0 + n - 1) active[na++] = q0;
            }
            const PxSpan sp = {qa, kb, vb, o, run_max, run_sum, first, last, bounds, k0, n, dq, nd};
            for (int i = 0; i < na + 2; i++) {
                if (i < na) px_scores(&sp, active[i], s + (i & 1) * PX_T * PA_SPAN);
                if (i >= 1 && i <= na)
                    px_softmax(&sp, active[i - 1], s + ((i - 1) & 1) * PX_T * PA_SPAN, pa + ((i - 1) & 1) * 2 * PX_T * PA_SPAN);
                if (i >= 2) px_values(&sp, active[i - 2], pa + ((i - 2) & 1) * 2 * PX_T * PA_SPAN);
            }
        }
        for (int r = 0; r < rows; r++) {
            char *out_row = (char *)a->out + (size_t)((it.row0 + r) * a->out_row_stride) * esize;
            for (int g = 0; g < groups; g++) {
                const int64_t m = (int64_t)g * rows + r;
                const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_load_ps(run_sum + m * 16));
                float *orow = o + m * dq;
                for (int d = 0; d < dim; d++) orow[d] *= inv;
                store_row_avx512(out_row + (size_t)(kvh * groups + g) * dim * esize, orow, dim, a->dtype);
            }
        }
    }
    _tile_release();
}

#undef PX_TAU
#undef PX_KT
#undef PX_T
