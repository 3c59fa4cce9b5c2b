/* Kernel bodies, included once per instruction set by fused_kernels.c with FK_SUFFIX set
 * (and a `#pragma GCC target` around the include). Written for the auto-vectoriser:
 * inner loops over contiguous float32 rows, `omp simd` reductions, no calls to libm.
 * Each function runs items [begin, end) of one kernel call; arguments were validated.
 * With FK_VEC8 (the AVX2 and AVX-512 variants) decode attention and float16 rows use AVX2
 * intrinsics: gcc 12 vectorises neither the _Float16 loops nor a dot product per key well. */

#define FK_CAT2(a, b) a##_##b
#define FK_CAT(a, b) FK_CAT2(a, b)
#define FK_FN(name) FK_CAT(name, FK_SUFFIX)

/* bfloat16 -> float32 (dtype.h); float16 (KV caches only) through _Float16 (one vcvtph2ps per
 * 8 values where the variant has F16C). */
static inline void FK_FN(load_row)(float *dst, const void *src, int64_t n, int dtype) {
    if (dtype == FK_FLOAT32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    if (dtype == FK_FLOAT16) {
        const _Float16 *h = (const _Float16 *)src;
        int64_t i = 0;
#ifdef FK_VEC8
        /* gcc 12 does not vectorise the _Float16 loop (one vpinsrw + vcvtph2ps per value) */
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
        for (; i < n; i++) dst[i] = (float)h[i];
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) dst[i] = dt_bf16_to_f32(s[i]);
}

/* float32 -> bfloat16 (dtype.h: round to nearest even, as torch rounds); -> float16 round to
 * nearest even (the hardware conversion, as torch's). */
static inline void FK_FN(store_row)(void *dst, const float *src, int64_t n, int dtype) {
    if (dtype == FK_FLOAT32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    if (dtype == FK_FLOAT16) {
        _Float16 *h = (_Float16 *)dst;
        int64_t i = 0;
#ifdef FK_VEC8
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; i++) h[i] = (_Float16)src[i];
        return;
    }
    uint16_t *d = (uint16_t *)dst;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) d[i] = dt_f32_to_bf16(src[i]);
}

/* exp(x) for x in float32 range, ~1 ulp; 0 below -87.3 (no libm call, vectorisable). */
static inline float FK_FN(fast_exp)(float x) {
    x = x < 88.3762626647949f ? x : 88.3762626647949f;
    const int is_tiny = x < -87.3365447504f;
    x = x > -87.3365447504f ? x : -87.3365447504f;
    /* round to nearest through the 1.5 * 2^23 trick (no floorf call; exact without -ffast-math) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return is_tiny ? 0.0f : p * scale;
}

/* out[i] = x[i] * rsqrt(mean(x^2) + eps) * w[i] over dim values (out may be x). */
static inline void FK_FN(rms_scale)(const float *x, const float *w, int64_t dim, float eps, float *out) {
    float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < dim; i++) sum_sq += x[i] * x[i];
    const float inv = 1.0f / __builtin_sqrtf(sum_sq / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) out[i] = x[i] * inv * w[i];
}

static void FK_FN(add_rmsnorm_rows)(const AddNormArgs *a, int64_t begin, int64_t end, float *scratch) {
    const int64_t dim = a->dim;
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    float *w = scratch;          /* [E] */
    float *delta = scratch + dim; /* [E] */
    FK_FN(load_row)(w, a->weight, dim, a->dtype);
    for (int64_t t = begin; t < end; t++) {
        float *x = a->resid + t * dim;
        if (a->delta != NULL) {  /* float32 rows read and written in place, else through the scratch */
            const float *d = (const float *)a->delta + t * dim;
            if (a->dtype != FK_FLOAT32) {
                FK_FN(load_row)(delta, (const char *)a->delta + (size_t)(t * dim) * esize, dim, a->dtype);
                d = delta;
            }
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) x[i] += d[i];
        }
        if (a->dtype == FK_FLOAT32) {
            FK_FN(rms_scale)(x, w, dim, a->eps, (float *)a->out + t * dim);
        } else {
            FK_FN(rms_scale)(x, w, dim, a->eps, delta);
            FK_FN(store_row)((char *)a->out + (size_t)(t * dim) * esize, delta, dim, a->dtype);
        }
    }
}

static void FK_FN(rope_kv_rows)(const RopeArgs *a, int64_t begin, int64_t end, float *scratch) {
    const int dim = a->head_dim, half = dim / 2;
    const int num_kv = a->num_kv_heads, num_rot = a->num_heads + a->num_kv_heads;
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    const size_t cache_esize = a->cache_dtype == FK_FLOAT32 ? 4 : 2;
    float *head = scratch;          /* [D] */
    float *rot = scratch + dim;     /* [D] */
    for (int64_t t = begin; t < end; t++) {
        char *row = (char *)a->qkv + (size_t)(t * a->row_stride) * esize;
        const float *c = a->cos + a->positions[t] * half;
        const float *s = a->sin + a->positions[t] * half;
        const int64_t slot = a->slots[t];
        char *k_dst = (char *)a->k_cache + (size_t)(slot * num_kv * dim) * cache_esize;
        char *v_dst = (char *)a->v_cache + (size_t)(slot * num_kv * dim) * cache_esize;
        for (int h = 0; h < num_rot; h++) {
            char *src = row + (size_t)h * dim * esize;
            FK_FN(load_row)(head, src, dim, a->dtype);
#pragma omp simd
            for (int i = 0; i < half; i++) {
                rot[i] = head[i] * c[i] - head[i + half] * s[i];
                rot[i + half] = head[i + half] * c[i] + head[i] * s[i];
            }
            FK_FN(store_row)(src, rot, dim, a->dtype);
        }
        /* k (now rotated) and v are adjacent in the row: [KH, D] each. */
        if (a->cache_dtype == a->dtype) {
            const size_t kv_bytes = (size_t)num_kv * dim * esize;
            memcpy(k_dst, row + (size_t)a->num_heads * dim * esize, kv_bytes);
            memcpy(v_dst, row + (size_t)num_rot * dim * esize, kv_bytes);
        } else {
            for (int h = 0; h < 2 * num_kv; h++) {  /* k heads, then v heads */
                FK_FN(load_row)(head, row + (size_t)(a->num_heads + h) * dim * esize, dim, a->dtype);
                char *dst = h < num_kv ? k_dst + (size_t)h * dim * cache_esize
                                       : v_dst + (size_t)(h - num_kv) * dim * cache_esize;
                FK_FN(store_row)(dst, head, dim, a->cache_dtype);
            }
        }
    }
}

#ifdef FK_VEC8
/* 8 cache values from `p` (float32 or float16) as float32. */
static inline __m256 FK_FN(load8)(const char *p, const int is_half) {
    return is_half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps((const float *)p);
}

/* fast_exp on 8 lanes: the scalar code's operations as this target compiles them (its rounding to
 * nearest through 1.5 * 2^23 contracted into one FMA), so a value's bits do not depend on whether a
 * lane or a scalar tail took it. */
static inline __m256 FK_FN(exp8)(__m256 x) {
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    const __m256 is_tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365447504f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447504f));
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), magic), magic);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(is_tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* Three multipliers c0..c2 times two vectors x, y into six sums (c_g * x into *xg, c_g * y into
 * *yg): independent FMA chains, for scores8 (three queries, two keys) and pv8 (three weights,
 * sixteen values). */
static inline void FK_FN(fma3x2)(const __m256 c0, const __m256 c1, const __m256 c2, const __m256 x, const __m256 y,
                                 __m256 *x0, __m256 *y0, __m256 *x1, __m256 *y1, __m256 *x2, __m256 *y2) {
    *x0 = _mm256_fmadd_ps(c0, x, *x0);
    *y0 = _mm256_fmadd_ps(c0, y, *y0);
    *x1 = _mm256_fmadd_ps(c1, x, *x1);
    *y1 = _mm256_fmadd_ps(c1, y, *y1);
    *x2 = _mm256_fmadd_ps(c2, x, *x2);
    *y2 = _mm256_fmadd_ps(c2, y, *y2);
}

/* out[g * FK_SPAN + j] = q_g . k_j for every group g and the count cache rows
 * k_j = k + j * stride (D % 8 == 0): each 8 values of a key are widened once for all groups;
 * per key and group one lane-partial vector, 8 keys of a group reduced together. */
static inline void FK_FN(scores8)(const float *q, int groups, const char *k, size_t stride, int64_t count,
                                  int dim, const int is_half, float *out, float *part) {
    const size_t esize = is_half ? 2 : 4;
    for (int64_t j0 = 0; j0 < count; j0 += 8) {
        const int n = count - j0 < 8 ? (int)(count - j0) : 8;
        int u = 0;
        if (groups == 3) {  /* two keys a pass: six independent sums (GQA with three queries a key) */
            const float *q0 = q, *q1 = q0 + dim, *q2 = q1 + dim;
            for (; u + 2 <= n; u += 2) {
                const char *kr = k + (size_t)(j0 + u) * stride, *kr1 = kr + stride;
                __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps();
                __m256 t0 = _mm256_setzero_ps(), t1 = _mm256_setzero_ps(), t2 = _mm256_setzero_ps();
                for (int i = 0; i < dim; i += 8)
                    FK_FN(fma3x2)(_mm256_loadu_ps(q0 + i), _mm256_loadu_ps(q1 + i), _mm256_loadu_ps(q2 + i),
                                  FK_FN(load8)(kr + i * esize, is_half), FK_FN(load8)(kr1 + i * esize, is_half),
                                  &s0, &t0, &s1, &t1, &s2, &t2);
                _mm256_storeu_ps(part + u * 8, s0);
                _mm256_storeu_ps(part + (8 + u) * 8, s1);
                _mm256_storeu_ps(part + (16 + u) * 8, s2);
                _mm256_storeu_ps(part + (u + 1) * 8, t0);
                _mm256_storeu_ps(part + (8 + u + 1) * 8, t1);
                _mm256_storeu_ps(part + (16 + u + 1) * 8, t2);
            }
        }
        for (; u < n; u++) {
            const char *kr = k + (size_t)(j0 + u) * stride;
            int g = 0;
            for (; g + 3 <= groups; g += 3) {
                const float *q0 = q + g * dim, *q1 = q0 + dim, *q2 = q1 + dim;
                __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps();
                for (int i = 0; i < dim; i += 8) {
                    const __m256 x = FK_FN(load8)(kr + i * esize, is_half);
                    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + i), x, s0);
                    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + i), x, s1);
                    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + i), x, s2);
                }
                _mm256_storeu_ps(part + (g * 8 + u) * 8, s0);
                _mm256_storeu_ps(part + ((g + 1) * 8 + u) * 8, s1);
                _mm256_storeu_ps(part + ((g + 2) * 8 + u) * 8, s2);
            }
            for (; g < groups; g++) {
                const float *q0 = q + g * dim;
                __m256 s0 = _mm256_setzero_ps();
                for (int i = 0; i < dim; i += 8)
                    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + i), FK_FN(load8)(kr + i * esize, is_half), s0);
                _mm256_storeu_ps(part + (g * 8 + u) * 8, s0);
            }
        }
        for (int g = 0; g < groups; g++) {
            const float *pg = part + g * 64;
            __m256 v[8];
            for (int u = 0; u < 8; u++) v[u] = u < n ? _mm256_loadu_ps(pg + u * 8) : _mm256_setzero_ps();
            const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
            const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
            const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
            const __m256 r = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
            float *og = out + g * FK_SPAN + j0;
            if (n == 8) {
                _mm256_storeu_ps(og, r);
            } else {
                float tmp[8];
                _mm256_storeu_ps(tmp, r);
                for (int u = 0; u < n; u++) og[u] = tmp[u];
            }
        }
    }
}

/* acc[g][i] += sum_j p[g * p_stride + j] * v_j[i] for every group g (D % 8 == 0): each 16
 * values of a cache row are read once for up to three groups, whose 2-6 sums run as independent
 * chains (one chain per accumulator waits on the FMA's latency every key). Each acc[g][i] sums
 * its keys in order, so the chunking changes no result. */
static inline void FK_FN(pv8)(const float *p, int64_t p_stride, const char *v, size_t stride, int64_t count,
                              int dim, int groups, const int is_half, float *acc) {
    const size_t esize = is_half ? 2 : 4;
    int i = 0;
    for (; i + 16 <= dim; i += 16) {
        int g = 0;
        for (; g + 3 <= groups; g += 3) {
            float *c0 = acc + g * dim + i, *c1 = c0 + dim, *c2 = c1 + dim;
            __m256 a0 = _mm256_loadu_ps(c0), b0 = _mm256_loadu_ps(c0 + 8);
            __m256 a1 = _mm256_loadu_ps(c1), b1 = _mm256_loadu_ps(c1 + 8);
            __m256 a2 = _mm256_loadu_ps(c2), b2 = _mm256_loadu_ps(c2 + 8);
            const float *p0 = p + g * p_stride, *p1 = p0 + p_stride, *p2 = p1 + p_stride;
            for (int64_t j = 0; j < count; j++) {
                const char *row = v + (size_t)j * stride + i * esize;
                FK_FN(fma3x2)(_mm256_set1_ps(p0[j]), _mm256_set1_ps(p1[j]), _mm256_set1_ps(p2[j]),
                              FK_FN(load8)(row, is_half), FK_FN(load8)(row + 8 * esize, is_half),
                              &a0, &b0, &a1, &b1, &a2, &b2);
            }
            _mm256_storeu_ps(c0, a0);
            _mm256_storeu_ps(c0 + 8, b0);
            _mm256_storeu_ps(c1, a1);
            _mm256_storeu_ps(c1 + 8, b1);
            _mm256_storeu_ps(c2, a2);
            _mm256_storeu_ps(c2 + 8, b2);
        }
        for (; g < groups; g++) {
            float *c0 = acc + g * dim + i;
            __m256 a0 = _mm256_loadu_ps(c0), b0 = _mm256_loadu_ps(c0 + 8);
            const float *p0 = p + g * p_stride;
            for (int64_t j = 0; j < count; j++) {
                const char *row = v + (size_t)j * stride + i * esize;
                const __m256 w0 = _mm256_set1_ps(p0[j]);
                a0 = _mm256_fmadd_ps(w0, FK_FN(load8)(row, is_half), a0);
                b0 = _mm256_fmadd_ps(w0, FK_FN(load8)(row + 8 * esize, is_half), b0);
            }
            _mm256_storeu_ps(c0, a0);
            _mm256_storeu_ps(c0 + 8, b0);
        }
    }
    for (; i < dim; i += 8) {  /* D % 16 == 8: the last 8 values */
        for (int g = 0; g < groups; g++) {
            __m256 a0 = _mm256_loadu_ps(acc + g * dim + i);
            const float *p0 = p + g * p_stride;
            for (int64_t j = 0; j < count; j++)
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(p0[j]), FK_FN(load8)(v + (size_t)j * stride + i * esize, is_half), a0);
            _mm256_storeu_ps(acc + g * dim + i, a0);
        }
    }
}

/* Prefetches count cache rows of `bytes` each, `stride` apart (the cache is read a head at a
 * time, a third or less of each slot's bytes: too sparse for the hardware prefetcher). */
static inline void FK_FN(prefetch_rows)(const char *p, size_t stride, int64_t count, size_t bytes) {
    for (int64_t j = 0; j < count; j++)
        for (size_t o = 0; o < bytes; o += 64) _mm_prefetch(p + (size_t)j * stride + o, _MM_HINT_T0);
}

/* Keys [pos, len) of one (sequence, kv head) on the 8-lane path, FK_SPAN keys at a time
 * (across blocks): scores of every group, one online-softmax update per group and span,
 * then the values. */
static void FK_FN(attend_span8)(const AttnArgs *a, const int64_t *table, int kvh, int64_t pos, int64_t len,
                                const float *qf, float *acc, float *scores, float *run_max, float *run_sum,
                                float *part, const int is_half) {
    const int dim = a->head_dim, num_kv = a->num_kv_heads, groups = a->num_heads / num_kv, bs = a->block_size;
    const size_t cache_esize = is_half ? 2 : 4;
    const size_t slot_stride = (size_t)num_kv * dim * cache_esize;
    while (pos < len) {
        const int64_t n = len - pos < FK_SPAN ? len - pos : FK_SPAN;
        for (int64_t done = 0; done < n;) {
            const int64_t at = pos + done, offset = at % bs;
            const int64_t count = bs - offset < n - done ? bs - offset : n - done;
            const size_t row0 = (size_t)((table[at / bs] * bs + offset) * num_kv + kvh) * dim * cache_esize;
            const char *k_base = (const char *)a->k_cache + row0;
            /* the keys and values FK_PREFETCH_KEYS on (by block) */
            const int64_t ahead = (at / bs) * bs + FK_PREFETCH_KEYS;
            if (ahead < len) {
                const int64_t ahead_count = len - ahead < bs ? len - ahead : bs;
                const size_t ahead_row = (size_t)((table[ahead / bs] * bs) * num_kv + kvh) * dim * cache_esize;
                FK_FN(prefetch_rows)((const char *)a->k_cache + ahead_row, slot_stride, ahead_count, (size_t)dim * cache_esize);
                FK_FN(prefetch_rows)((const char *)a->v_cache + ahead_row, slot_stride, ahead_count, (size_t)dim * cache_esize);
            }
            FK_FN(scores8)(qf, groups, k_base, slot_stride, count, dim, is_half, scores + done, part);
            done += count;
        }
        for (int g = 0; g < groups; g++) {
            float *sg = scores + g * FK_SPAN;
            __m256 mv = _mm256_set1_ps(run_max[g]);
            int64_t j = 0;
            for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + j));
            float m8[8];
            _mm256_storeu_ps(m8, mv);
            float chunk_max = m8[0];
            for (int u = 1; u < 8; u++) chunk_max = m8[u] > chunk_max ? m8[u] : chunk_max;
            for (; j < n; j++) chunk_max = sg[j] > chunk_max ? sg[j] : chunk_max;
            const float correction = FK_FN(fast_exp)(run_max[g] - chunk_max);
            const __m256 mx = _mm256_set1_ps(chunk_max);
            __m256 sv = _mm256_setzero_ps();
            for (j = 0; j + 8 <= n; j += 8) {
                const __m256 e = FK_FN(exp8)(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mx));
                _mm256_storeu_ps(sg + j, e);
                sv = _mm256_add_ps(sv, e);
            }
            float sum = 0.0f;
            for (; j < n; j++) {
                sg[j] = FK_FN(fast_exp)(sg[j] - chunk_max);
                sum += sg[j];
            }
            _mm256_storeu_ps(m8, sv);
            for (int u = 0; u < 8; u++) sum += m8[u];
            run_sum[g] = run_sum[g] * correction + sum;
            run_max[g] = chunk_max;
            if (correction != 1.0f) {
                float *ag = acc + g * dim;
                for (int i = 0; i < dim; i++) ag[i] *= correction;
            }
        }
        for (int64_t done = 0; done < n;) {
            const int64_t at = pos + done, offset = at % bs;
            const int64_t count = bs - offset < n - done ? bs - offset : n - done;
            const char *v_base = (const char *)a->v_cache + (size_t)((table[at / bs] * bs + offset) * num_kv + kvh) * dim * cache_esize;
            FK_FN(pv8)(scores + done, FK_SPAN, v_base, slot_stride, count, dim, groups, is_half, acc);
            done += count;
        }
        pos += n;
    }
}
#endif

/* Item i = (sequence, kv head) pair i / S (S = a->num_splits), key range i % S of that pair's
 * fk_attention_splits ranges (none past them); pair p = sequence p / KH, kv head p % KH: its
 * G = H / KH query heads walk the block
 * table together, one key row at a time, with an online softmax per block. */
static void FK_FN(attention_items)(const AttnArgs *a, int64_t begin, int64_t end, float *scratch) {
    const int dim = a->head_dim, num_kv = a->num_kv_heads;
    const int groups = a->num_heads / num_kv;
    const int bs = a->block_size;
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    const size_t cache_esize = a->cache_dtype == FK_FLOAT32 ? 4 : 2;
    float *qf = scratch;                     /* [G, D] scaled queries */
    float *acc = qf + groups * dim;          /* [G, D] */
    float *krow = acc + groups * dim;        /* [D] */
    float *vrow = krow + dim;                /* [D] */
    float *scores = vrow + dim;              /* [G, FK_SPAN] (FK_SPAN >= FK_CHUNK) */
    float *run_max = scores + groups * FK_SPAN; /* [G] */
    float *run_sum = run_max + groups;       /* [G] */
    const int stride = a->num_splits;
    for (int64_t item = begin; item < end; item++) {
        const int split = (int)(item % stride);
        const int64_t b = item / stride / num_kv;
        const int kvh = (int)(item / stride % num_kv);
        int64_t len = a->context_lens[b];
        int64_t first = 0;
        if (a->sliding_window > 0 && len > a->sliding_window) first = len - a->sliding_window;
        const int num_splits = fk_attention_splits(len - first);
        if (split >= num_splits) continue;  /* a shorter row than the batch's longest */
        if (num_splits > 1) {
            /* Keys [first, len) cut in num_splits near-equal ranges; this item takes one. */
            const int64_t total = len - first;
            const int64_t lo = first + total * split / num_splits;
            len = first + total * (split + 1) / num_splits;
            first = lo;
        }
        const int64_t *table = a->block_tables + b * a->table_stride;
        const char *q_row = (const char *)a->q + (size_t)(b * a->q_row_stride) * esize;
        for (int g = 0; g < groups; g++) {
            float *qg = qf + g * dim;
            FK_FN(load_row)(qg, q_row + (size_t)(kvh * groups + g) * dim * esize, dim, a->dtype);
#pragma omp simd
            for (int i = 0; i < dim; i++) qg[i] *= a->scale;
            run_max[g] = -1e30f;
            run_sum[g] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * (size_t)groups * dim);
        int64_t pos = first;
#ifdef FK_VEC8
        if (dim % 8 == 0 && (a->cache_dtype == FK_FLOAT32 || a->cache_dtype == FK_FLOAT16)) {
            float *part = run_sum + groups;  /* [G, 8 keys, 8 lanes] */
            if (a->cache_dtype == FK_FLOAT16) FK_FN(attend_span8)(a, table, kvh, pos, len, qf, acc, scores, run_max, run_sum, part, 1);
            else FK_FN(attend_span8)(a, table, kvh, pos, len, qf, acc, scores, run_max, run_sum, part, 0);
            pos = len;
        }
#endif
        while (pos < len) {
            /* A chunk of keys inside one block. */
            const int64_t block = table[pos / bs];
            const int64_t offset = pos % bs;
            int64_t count = bs - offset;
            if (count > len - pos) count = len - pos;
            if (count > FK_CHUNK) count = FK_CHUNK;
            const int64_t slot0 = block * bs + offset;
            const size_t slot_stride = (size_t)num_kv * dim * cache_esize;
            const char *k_base = (const char *)a->k_cache + (size_t)(slot0 * num_kv + kvh) * dim * cache_esize;
            const char *v_base = (const char *)a->v_cache + (size_t)(slot0 * num_kv + kvh) * dim * cache_esize;
            for (int64_t j = 0; j < count; j++) {
                const float *k;
                if (a->cache_dtype == FK_FLOAT32) {
                    k = (const float *)(k_base + j * slot_stride);
                } else {
                    FK_FN(load_row)(krow, k_base + j * slot_stride, dim, a->cache_dtype);
                    k = krow;
                }
                for (int g = 0; g < groups; g++) {
                    const float *qg = qf + g * dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int i = 0; i < dim; i++) dot += qg[i] * k[i];
                    scores[g * FK_CHUNK + j] = dot;
                }
            }
            for (int g = 0; g < groups; g++) {
                float *sg = scores + g * FK_CHUNK;
                float chunk_max = run_max[g];
                for (int64_t j = 0; j < count; j++) chunk_max = sg[j] > chunk_max ? sg[j] : chunk_max;
                const float correction = FK_FN(fast_exp)(run_max[g] - chunk_max);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < count; j++) {
                    sg[j] = FK_FN(fast_exp)(sg[j] - chunk_max);
                    sum += sg[j];
                }
                run_sum[g] = run_sum[g] * correction + sum;
                run_max[g] = chunk_max;
                if (correction != 1.0f) {
                    float *ag = acc + g * dim;
#pragma omp simd
                    for (int i = 0; i < dim; i++) ag[i] *= correction;
                }
            }
            for (int64_t j = 0; j < count; j++) {
                const float *v;
                if (a->cache_dtype == FK_FLOAT32) {
                    v = (const float *)(v_base + j * slot_stride);
                } else {
                    FK_FN(load_row)(vrow, v_base + j * slot_stride, dim, a->cache_dtype);
                    v = vrow;
                }
                for (int g = 0; g < groups; g++) {
                    float *ag = acc + g * dim;
                    const float p = scores[g * FK_CHUNK + j];
#pragma omp simd
                    for (int i = 0; i < dim; i++) ag[i] += p * v[i];
                }
            }
            pos += count;
        }
        if (num_splits > 1) {
            /* Unnormalised partial: [G] max, [G] sum, [G, D] acc, merged by the caller. */
            float *part = a->partials + item * (size_t)groups * (dim + 2);
            memcpy(part, run_max, sizeof(float) * groups);
            memcpy(part + groups, run_sum, sizeof(float) * groups);
            memcpy(part + 2 * groups, acc, sizeof(float) * (size_t)groups * dim);
            continue;
        }
        char *out_row = (char *)a->out + (size_t)(b * a->num_heads * dim) * esize;
        for (int g = 0; g < groups; g++) {
            float *ag = acc + g * dim;
            const float inv = 1.0f / run_sum[g];
#pragma omp simd
            for (int i = 0; i < dim; i++) ag[i] *= inv;
            FK_FN(store_row)(out_row + (size_t)(kvh * groups + g) * dim * esize, ag, dim, a->dtype);
        }
    }
}

#ifdef FK_VEC8
/* dst = act(gate) * up over the first multiple of 8 of n values (the scalar loops' operations, lane
 * by lane) -> how many were done. GCC left those loops scalar (10 cycles a value). */
static inline int64_t FK_FN(glu8)(const float *gate, const float *up, float *dst, int64_t n, int act) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        __m256 z = g;
        if (act == FK_ACT_GELU_TANH) {
            const __m256 c = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), g);
            z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f), _mm256_fmadd_ps(c, g, g));
        }
        const __m256 e = FK_FN(exp8)(_mm256_xor_ps(z, sign));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
    return i;
}
#endif

static void FK_FN(silu_mul_rows)(const SiluArgs *a, int64_t begin, int64_t end, float *scratch) {
    const int64_t inter = a->inter;
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    for (int64_t t = begin; t < end; t++) {
        const char *row = (const char *)a->gate_up + (size_t)(t * 2 * inter) * esize;
        char *out = (char *)a->out + (size_t)(t * inter) * esize;
        for (int64_t c0 = 0; c0 < inter; c0 += FK_CHUNK_COLS) {
            const int64_t n = inter - c0 < FK_CHUNK_COLS ? inter - c0 : FK_CHUNK_COLS;
            /* float32 in place (the rows are read and written where they are), else through the
             * scratch's float32 copies [FK_CHUNK_COLS] of gate and up */
            const float *gate = (const float *)(row + (size_t)c0 * esize);
            const float *up = (const float *)(row + (size_t)(inter + c0) * esize);
            float *dst = (float *)(out + (size_t)c0 * esize);
            if (a->dtype != FK_FLOAT32) {
                FK_FN(load_row)(scratch, row + (size_t)c0 * esize, n, a->dtype);
                FK_FN(load_row)(scratch + FK_CHUNK_COLS, row + (size_t)(inter + c0) * esize, n, a->dtype);
                gate = dst = scratch;
                up = scratch + FK_CHUNK_COLS;
            }
            int64_t i0 = 0;
#ifdef FK_VEC8
            i0 = FK_FN(glu8)(gate, up, dst, n, a->act);
#endif
            if (a->act == FK_ACT_GELU_TANH) {
                /* 0.5 g (1 + tanh(u)) = g * sigmoid(2 u), u = sqrt(2 / pi) (g + 0.044715 g^3) */
#pragma omp simd
                for (int64_t i = i0; i < n; i++) {
                    const float g = gate[i];
                    const float u2 = 1.5957691216057308f * (g + 0.044715f * g * g * g);
                    dst[i] = g / (1.0f + FK_FN(fast_exp)(-u2)) * up[i];
                }
            } else {
#pragma omp simd
                for (int64_t i = i0; i < n; i++) dst[i] = gate[i] / (1.0f + FK_FN(fast_exp)(-gate[i])) * up[i];
            }
            if (a->dtype != FK_FLOAT32) FK_FN(store_row)(out + (size_t)c0 * esize, scratch, n, a->dtype);
        }
    }
}

/* Items are vectors (t, h): dim values at x + t * row_stride + h * dim (elements), h < heads;
 * out at the same place of out (out_row_stride) = rmsnorm(vector) * weight [dim]. */
static void FK_FN(rmsnorm_rows)(const NormArgs *a, int64_t begin, int64_t end, float *scratch) {
    const int64_t dim = a->dim;
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    float *w = scratch;          /* [dim] */
    float *x = scratch + dim;    /* [dim] */
    FK_FN(load_row)(w, a->weight, dim, a->dtype);
    for (int64_t item = begin; item < end; item++) {
        const int64_t t = item / a->heads, h = item % a->heads;
        FK_FN(load_row)(x, (const char *)a->x + (size_t)(t * a->row_stride + h * dim) * esize, dim, a->dtype);
        FK_FN(rms_scale)(x, w, dim, a->eps, x);
        FK_FN(store_row)((char *)a->out + (size_t)(t * a->out_row_stride + h * dim) * esize, x, dim, a->dtype);
    }
}

static const KernelTable FK_FN(kernel_table) = {
    FK_FN(add_rmsnorm_rows), FK_FN(rope_kv_rows), FK_FN(attention_items), FK_FN(silu_mul_rows),
    FK_FN(rmsnorm_rows),
};

#undef FK_FN
#undef FK_CAT
#undef FK_CAT2
