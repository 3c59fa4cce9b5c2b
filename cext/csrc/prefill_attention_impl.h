/* Kernel body of prefill_attention.c, included once per instruction set with PA_SUFFIX,
 * PA_VW (float lanes of a vector) and PA_MV (vectors of queries per block) set, inside a
 * `#pragma GCC target`. GCC vector extensions, so one source serves 4, 8 and 16 lanes.
 *
 * One item: (sequence, kv head, tile of up to PA_TILE_ROWS query rows). Its M = rows x G
 * query vectors are laid out queries-in-lanes: Qt [Dp, Mp] (scaled), Ot [Dp, Mp]; lane
 * m = g * rows + r. Keys are walked in spans of PA_SPAN: the span's keys and values are
 * converted once to float32 rows Kf / Vf [PA_SPAN, Dp]; then per block of MBLK = PA_MV *
 * PA_VW lanes: scores St [span, MBLK] (each key broadcast against MBLK queries), the
 * online-softmax update (max, exp, sums: lane-wise), Ot += Vf^T St (each value broadcast). */

#define PA_CAT2(a, b) a##_##b
#define PA_CAT(a, b) PA_CAT2(a, b)
#define PA_FN(name) PA_CAT(name, PA_SUFFIX)
#define VF PA_FN(vf)
#define VI PA_FN(vi)
#define MBLK (PA_MV * PA_VW)

typedef float VF __attribute__((vector_size(PA_VW * 4)));
typedef int32_t VI __attribute__((vector_size(PA_VW * 4)));

static inline VF PA_FN(vload)(const float *p) {
    VF v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline VI PA_FN(iload)(const int32_t *p) {
    VI v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void PA_FN(vstore)(float *p, VF v) { memcpy(p, &v, sizeof v); }

static inline VF PA_FN(vsplat)(float x) { return (VF){0} + x; }

static inline VF PA_FN(vmax)(VF a, VF b) {
    const VI gt = a > b;
    return (VF)(((VI)a & gt) | ((VI)b & ~gt));
}

/* fused_impl.h's fast_exp on PA_VW lanes (same polynomial; 0 below -87.3, -inf included). */
static inline VF PA_FN(vexp)(VF x) {
    x = -PA_FN(vmax)(-x, PA_FN(vsplat)(-88.3762626647949f));
    const VI is_tiny = x < -87.3365447504f;
    x = PA_FN(vmax)(x, PA_FN(vsplat)(-87.3365447504f));
    const VF n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    VF r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    VF p = PA_FN(vsplat)(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const VI e = (__builtin_convertvector(n, VI) + 127) << 23;
    return (VF)((VI)(p * (VF)e) & ~is_tiny);
}

/* n values of a cache or activation row (dtype) -> float32 dst; dst[n..padded) = 0. */
static inline void PA_FN(load_row)(float *dst, const void *src, int n, int padded, int dtype) {
    int i = 0;
    if (dtype == FK_FLOAT32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        i = n;
    } else if (dtype == FK_FLOAT16) {
        const uint16_t *h = (const uint16_t *)src;
#ifdef PA_F16C
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
        for (; i < n; i++) dst[i] = dt_f16_to_f32(h[i]);
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (; i < n; i++) dst[i] = dt_bf16_to_f32(s[i]);
    }
    for (; i < padded; i++) dst[i] = 0.0f;
}

/* float32 -> dtype (bfloat16: round to nearest even, NaN kept quiet, as torch rounds). */
static inline void PA_FN(store_row)(void *dst, const float *src, int n, int dtype) {
    if (dtype == FK_FLOAT32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    for (int i = 0; i < n; i++) d[i] = dt_f32_to_bf16(src[i]);
}

/* St[j][lane] = sum_d Kf[j][d] * Qt[d][lane] for j < n4 (a multiple of 4), MBLK lanes from qt. */
static inline void PA_FN(scores)(const float *qt, int64_t mp, const float *kf, int dp, int n4, float *st) {
    for (int j = 0; j < n4; j += 4) {
        VF acc[4][PA_MV];
        for (int u = 0; u < 4; u++)
            for (int v = 0; v < PA_MV; v++) acc[u][v] = PA_FN(vsplat)(0.0f);
        const float *k0 = kf + (size_t)j * dp;
        for (int d = 0; d < dp; d++) {
            VF qv[PA_MV];
            for (int v = 0; v < PA_MV; v++) qv[v] = PA_FN(vload)(qt + (size_t)d * mp + v * PA_VW);
            for (int u = 0; u < 4; u++) {
                const float k = k0[(size_t)u * dp + d];
                for (int v = 0; v < PA_MV; v++) acc[u][v] += k * qv[v];
            }
        }
        for (int u = 0; u < 4; u++)
            for (int v = 0; v < PA_MV; v++) PA_FN(vstore)(st + (size_t)(j + u) * MBLK + v * PA_VW, acc[u][v]);
    }
}

/* Ot[d][lane] = Ot[d][lane] * corr[lane] + sum_{j < n} Vf[j][d] * St[j][lane] (dp % 4 == 0). */
static inline void PA_FN(accumulate)(float *ot, int64_t mp, const float *vf, int dp, int n, const float *st,
                                     const VF *corr) {
    for (int d0 = 0; d0 < dp; d0 += 4) {
        VF acc[4][PA_MV];
        for (int u = 0; u < 4; u++)
            for (int v = 0; v < PA_MV; v++)
                acc[u][v] = PA_FN(vload)(ot + (size_t)(d0 + u) * mp + v * PA_VW) * corr[v];
        for (int j = 0; j < n; j++) {
            VF pv[PA_MV];
            for (int v = 0; v < PA_MV; v++) pv[v] = PA_FN(vload)(st + (size_t)j * MBLK + v * PA_VW);
            const float *vr = vf + (size_t)j * dp + d0;
            for (int u = 0; u < 4; u++) {
                const float x = vr[u];
                for (int v = 0; v < PA_MV; v++) acc[u][v] += x * pv[v];
            }
        }
        for (int u = 0; u < 4; u++)
            for (int v = 0; v < PA_MV; v++) PA_FN(vstore)(ot + (size_t)(d0 + u) * mp + v * PA_VW, acc[u][v]);
    }
}

/* Items [begin, end) of a call (see PaItem): every tile is one sequence's rows row0..row0+rows-1
 * for one kv head. scratch: pa_scratch_floats(). */
static void PA_FN(prefill_items)(const PaArgs *a, int64_t begin, int64_t end, float *scratch) {
    const int dim = a->head_dim, num_kv = a->num_kv_heads, groups = a->num_heads / num_kv;
    const int dp = (dim + 3) & ~3, bs = a->block_size;
    const int64_t mp = a->mp;
    const size_t cache_esize = a->cache_dtype == FK_FLOAT32 ? 4 : 2;
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    float *qt = scratch;                           /* [Dp, Mp] */
    float *ot = qt + (size_t)dp * mp;              /* [Dp, Mp] */
    float *kf = ot + (size_t)dp * mp;              /* [PA_SPAN, Dp] */
    float *vf = kf + (size_t)PA_SPAN * dp;         /* [PA_SPAN, Dp] */
    float *st = vf + (size_t)PA_SPAN * dp;         /* [PA_SPAN, MBLK] */
    float *run_max = st + (size_t)PA_SPAN * MBLK;  /* [Mp] */
    float *run_sum = run_max + mp;                 /* [Mp] */
    float *row = run_sum + mp;                     /* [Dp] */
    int32_t *last = (int32_t *)(row + dp);         /* [Mp] last key of each lane (-1: a padding lane) */
    int32_t *first = last + mp;                    /* [Mp] first key of each lane */
    for (int64_t item = begin; item < end; item++) {
        const PaItem it = a->items[item];
        const int64_t *table = a->block_tables + it.seq * a->table_stride;
        const int rows = it.num_rows, kvh = it.kv_head;
        const int m_real = rows * groups;
        const int64_t m_pad = (m_real + MBLK - 1) / MBLK * MBLK;
        int64_t lo, hi, min_last, max_first;
        pa_item_lanes(a, &it, groups, m_pad, 0, last, first, &lo, &hi, &min_last, &max_first);
        /* Qt: scaled queries, lanes past m_real zero. */
        memset(qt, 0, sizeof(float) * (size_t)dp * mp);
        memset(ot, 0, sizeof(float) * (size_t)dp * mp);
        for (int r = 0; r < rows; r++) {
            const char *q_row = (const char *)a->q + (size_t)((it.row0 + r) * a->q_row_stride) * esize;
            for (int g = 0; g < groups; g++) {
                PA_FN(load_row)(row, q_row + (size_t)(kvh * groups + g) * dim * esize, dim, dp, a->dtype);
                const int64_t m = (int64_t)g * rows + r;
                for (int d = 0; d < dim; d++) qt[d * mp + m] = row[d] * a->scale;
            }
        }
        for (int64_t m = 0; m < m_pad; m++) {
            run_max[m] = -1e30f;
            run_sum[m] = 0.0f;
        }
        for (int64_t k0 = lo; k0 <= hi; k0 += PA_SPAN) {
            const int n = hi + 1 - k0 < PA_SPAN ? (int)(hi + 1 - k0) : PA_SPAN;
            const int n4 = (n + 3) & ~3;
            for (int j = 0; j < n; j++) {
                const int64_t key = k0 + j;
                const int64_t slot = table[key / bs] * bs + key % bs;
                const size_t at = (size_t)((slot * num_kv + kvh) * dim) * cache_esize;
                PA_FN(load_row)(kf + (size_t)j * dp, (const char *)a->k_cache + at, dim, dp, a->cache_dtype);
                PA_FN(load_row)(vf + (size_t)j * dp, (const char *)a->v_cache + at, dim, dp, a->cache_dtype);
            }
            memset(kf + (size_t)n * dp, 0, sizeof(float) * (size_t)(n4 - n) * dp);
            const int is_masked = k0 + n - 1 > min_last || k0 < max_first;
            for (int64_t m0 = 0; m0 < m_pad; m0 += MBLK) {
                PA_FN(scores)(qt + m0, mp, kf, dp, n4, st);
                if (is_masked) {
                    VI lastv[PA_MV], firstv[PA_MV];
                    for (int v = 0; v < PA_MV; v++) {
                        lastv[v] = PA_FN(iload)(last + m0 + v * PA_VW);
                        firstv[v] = PA_FN(iload)(first + m0 + v * PA_VW);
                    }
                    const VF ninf = PA_FN(vsplat)(-__builtin_inff());
                    for (int j = 0; j < n; j++) {
                        const int32_t key = (int32_t)(k0 + j);
                        for (int v = 0; v < PA_MV; v++) {
                            const VI ok = (lastv[v] >= key) & (firstv[v] <= key);
                            float *s = st + (size_t)j * MBLK + v * PA_VW;
                            const VF x = PA_FN(vload)(s);
                            PA_FN(vstore)(s, (VF)(((VI)x & ok) | ((VI)ninf & ~ok)));
                        }
                    }
                }
                VF mx[PA_MV], corr[PA_MV], sum[PA_MV];
                for (int v = 0; v < PA_MV; v++) mx[v] = PA_FN(vload)(run_max + m0 + v * PA_VW);
                for (int j = 0; j < n; j++)
                    for (int v = 0; v < PA_MV; v++)
                        mx[v] = PA_FN(vmax)(mx[v], PA_FN(vload)(st + (size_t)j * MBLK + v * PA_VW));
                for (int v = 0; v < PA_MV; v++) {
                    corr[v] = PA_FN(vexp)(PA_FN(vload)(run_max + m0 + v * PA_VW) - mx[v]);
                    sum[v] = PA_FN(vsplat)(0.0f);
                }
                for (int j = 0; j < n; j++)
                    for (int v = 0; v < PA_MV; v++) {
                        float *s = st + (size_t)j * MBLK + v * PA_VW;
                        const VF e = PA_FN(vexp)(PA_FN(vload)(s) - mx[v]);
                        PA_FN(vstore)(s, e);
                        sum[v] += e;
                    }
                for (int v = 0; v < PA_MV; v++) {
                    float *rs = run_sum + m0 + v * PA_VW;
                    PA_FN(vstore)(rs, PA_FN(vload)(rs) * corr[v] + sum[v]);
                    PA_FN(vstore)(run_max + m0 + v * PA_VW, mx[v]);
                }
                PA_FN(accumulate)(ot + m0, mp, vf, dp, n, st, corr);
            }
        }
        for (int r = 0; r < rows; r++) {
            char *out_row = (char *)a->out + (size_t)((it.row0 + r) * a->out_row_stride) * esize;
            for (int g = 0; g < groups; g++) {
                const int64_t m = (int64_t)g * rows + r;
                const float inv = 1.0f / run_sum[m];
                for (int d = 0; d < dim; d++) row[d] = ot[d * mp + m] * inv;
                PA_FN(store_row)(out_row + (size_t)(kvh * groups + g) * dim * esize, row, dim, a->dtype);
            }
        }
    }
}

#undef MBLK
#undef VI
#undef VF
#undef PA_FN
#undef PA_CAT
#undef PA_CAT2
