/* The O(vocab) passes over one row of the sampler kernel (included by sampler_kernels.c only).
 * Written with GCC's vector extension or as plain loops it vectorizes (built with
 * -fno-trapping-math, never -ffast-math: -inf is a value here); the passes are cloned for AVX2
 * and the clone is picked at load time (target_clones). */
#ifndef SAMPLER_ROWS_H
#define SAMPLER_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu.h"

#define SK_BLOCK_MAX 64 /* per block of the row its max: searches skip blocks that cannot matter */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SK_CLONES
#endif

/* The hottest passes also have hand-written AVX2 versions (intrinsics need a function-wide
 * target, so they are separate functions picked per call by sk_has_avx2: cpu.h's switch). Same operations
 * in the same order as the portable code (no FMA): every path gives the same bits. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define SK_AVX2_PATH 1
#define SK_AVX2 __attribute__((target("avx2")))
static inline int sk_has_avx2(void) { return cpu_isa() >= CPU_ISA_AVX2; }  /* cpu.h's switch */
#else
#define SK_AVX2_PATH 0
static inline int sk_has_avx2(void) { return 0; }
#endif

/* exp(x) for x <= 0 (relative error < 3e-7); 0 below -87 (and for -inf). */
static inline float fast_exp(float x) {
    float c = x < -87.0f ? -87.0f : x;
    float j = c * 1.44269504088896341f + 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    j -= 12582912.0f;
    float r = c - j * 0.693145751953125f;
    r = r - j * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)j + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return x < -87.0f ? 0.0f : p * scale;
}

/* 8-float vectors of GCC's vector extension: two SSE registers in the baseline build, one
 * AVX register in the avx2 clone. Loads through memcpy (no alignment assumed). */
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

static inline vf8 load8(const float *p) {
    vf8 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline vf8 max8(vf8 a, vf8 b) {
    vi8 is_a = a > b;
    return (vf8)((is_a & (vi8)a) | (~is_a & (vi8)b));
}

static inline float max_of(const float *x, int64_t n) {
    vf8 acc0 = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
    vf8 acc1 = acc0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = max8(load8(x + i), acc0);
        acc1 = max8(load8(x + i + 8), acc1);
    }
    acc0 = max8(acc0, acc1);
    float m = -INFINITY;
    for (int k = 0; k < 8; k++) m = acc0[k] > m ? acc0[k] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

#if SK_AVX2_PATH
/* The maxima of 8 whole blocks at a time: each block's 8 vectors folded into one register
 * (the loaded value first: _mm256_max_ps returns its second operand when either is NaN, so a
 * NaN is never kept, as in max8), then the 8 registers reduced together by a transpose, so
 * one store writes 8 block maxima (per block a horizontal reduction cost more than its loads).
 * Returns the blocks done (a multiple of 8); *m the max over them. */
SK_AVX2 static int64_t block_maxes_avx2(const float *x, int64_t n, float *bmax, float *m) {
    __m256 acc = _mm256_set1_ps(-INFINITY);
    int64_t b = 0;
    for (; (b + 8) * SK_BLOCK_MAX <= n; b += 8) {
        __m256 r[8];
        for (int k = 0; k < 8; k++) {
            const float *p = x + (b + k) * SK_BLOCK_MAX;
            __m256 v = _mm256_set1_ps(-INFINITY);
            for (int j = 0; j < SK_BLOCK_MAX; j += 8) v = _mm256_max_ps(_mm256_loadu_ps(p + j), v);
            r[k] = v;
        }
        __m256 t0 = _mm256_max_ps(_mm256_unpacklo_ps(r[0], r[1]), _mm256_unpackhi_ps(r[0], r[1]));
        __m256 t1 = _mm256_max_ps(_mm256_unpacklo_ps(r[2], r[3]), _mm256_unpackhi_ps(r[2], r[3]));
        __m256 t2 = _mm256_max_ps(_mm256_unpacklo_ps(r[4], r[5]), _mm256_unpackhi_ps(r[4], r[5]));
        __m256 t3 = _mm256_max_ps(_mm256_unpacklo_ps(r[6], r[7]), _mm256_unpackhi_ps(r[6], r[7]));
        __m256 u0 = _mm256_max_ps(_mm256_shuffle_ps(t0, t1, 0x44), _mm256_shuffle_ps(t0, t1, 0xee));
        __m256 u1 = _mm256_max_ps(_mm256_shuffle_ps(t2, t3, 0x44), _mm256_shuffle_ps(t2, t3, 0xee));
        __m256 v = _mm256_max_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
        _mm256_storeu_ps(bmax + b, v);  /* lane k: block b + k */
        acc = _mm256_max_ps(v, acc);
    }
    float lanes[8], out = -INFINITY;
    _mm256_storeu_ps(lanes, acc);
    for (int k = 0; k < 8; k++) out = lanes[k] > out ? lanes[k] : out;
    *m = out;
    return b;
}
#endif

/* bmax[b] = max of x[b * SK_BLOCK_MAX ...] (the last block may be short); returns the row's max. */
SK_CLONES static float block_maxes_portable(const float *x, int64_t n, float *bmax, int64_t first_block, float m) {
    for (int64_t b = first_block, start = first_block * SK_BLOCK_MAX; start < n; b++, start += SK_BLOCK_MAX) {
        float v = max_of(x + start, start + SK_BLOCK_MAX <= n ? SK_BLOCK_MAX : n - start);
        bmax[b] = v;
        m = v > m ? v : m;
    }
    return m;
}

static inline float block_maxes(const float *x, int64_t n, float *bmax) {
    int64_t done = 0;
    float m = -INFINITY;
#if SK_AVX2_PATH
    if (sk_has_avx2()) done = block_maxes_avx2(x, n, bmax, &m);
#endif
    return block_maxes_portable(x, n, bmax, done, m);
}

SK_CLONES static double row_sum(const float *w, int64_t n) {
    vf8 acc0 = {0}, acc1 = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 += load8(w + i);
        acc1 += load8(w + i + 8);
    }
    acc0 += acc1;
    double total = 0.0;
    for (int k = 0; k < 8; k++) total += acc0[k];
    for (; i < n; i++) total += w[i];
    return total;
}

#if SK_AVX2_PATH
/* fast_exp on 8 lanes, the same operations in the same order (bit for bit the scalar's). */
SK_AVX2 static inline __m256 fast_exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f), round = _mm256_set1_ps(12582912.0f);
    __m256 is_low = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    __m256 c = _mm256_blendv_ps(x, lo, is_low);
    __m256 j = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)), round), round);
    __m256 r = _mm256_sub_ps(c, _mm256_mul_ps(j, _mm256_set1_ps(0.693145751953125f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(j, _mm256_set1_ps(1.428606765330187045e-06f)));
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(j), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(is_low, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* exp_into's whole 8-lane groups; returns how many values it did. */
SK_AVX2 static int64_t exp_into_avx2(const float *x, int64_t n, float inv_t, float shift, float floor_w, float *w) {
    const __m256 it = _mm256_set1_ps(inv_t), sh = _mm256_set1_ps(shift), fw = _mm256_set1_ps(floor_w);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = fast_exp8(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), it), sh));
        _mm256_storeu_ps(w + i, _mm256_and_ps(v, _mm256_cmp_ps(v, fw, _CMP_GE_OQ)));
    }
    return i;
}
#endif

/* w[i] = exp(x[i] * inv_t - shift), or 0 where that is below floor_w. */
SK_CLONES static void exp_into(const float *x, int64_t n, float inv_t, float shift, float floor_w, float *w) {
    int64_t i = 0;
#if SK_AVX2_PATH
    if (sk_has_avx2()) i = exp_into_avx2(x, n, inv_t, shift, floor_w, w);
#endif
    for (; i < n; i++) {
        float v = fast_exp(x[i] * inv_t - shift);
        w[i] = v >= floor_w ? v : 0.0f;
    }
}

SK_CLONES static int64_t count_at_least(const float *x, int64_t n, float v) {
    vf8 limit = {v, v, v, v, v, v, v, v};
    vi8 acc = {0};
    int64_t i = 0, total = 0;
    for (; i + 8 <= n; i += 8) acc -= load8(x + i) >= limit; /* true is -1 */
    for (int k = 0; k < 8; k++) total += acc[k];
    for (; i < n; i++) total += x[i] >= v;
    return total;
}

#endif
