/* The O(vocab) passes over one row of the sampler kernel (included by sampler_kernels.c only).
 * Written with GCC's vector extension or as plain loops it vectorizes (built with
 * -fno-trapping-math, never -ffast-math: -inf is a value here); the passes are cloned for AVX2
 * and the clone is picked at load time (target_clones). */
#ifndef SAMPLER_ROWS_H
#define SAMPLER_ROWS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define SK_BLOCK_MAX 64 /* per block of the row its max: searches skip blocks that cannot matter */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SK_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SK_CLONES
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

/* bmax[b] = max of x[b * SK_BLOCK_MAX ...] (the last block may be short); returns the row's max. */
SK_CLONES static float block_maxes(const float *x, int64_t n, float *bmax) {
    float m = -INFINITY;
    for (int64_t b = 0, start = 0; start < n; b++, start += SK_BLOCK_MAX) {
        float v = max_of(x + start, start + SK_BLOCK_MAX <= n ? SK_BLOCK_MAX : n - start);
        bmax[b] = v;
        m = v > m ? v : m;
    }
    return m;
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

/* w[i] = exp(x[i] * inv_t - shift), or 0 where that is below floor_w. */
SK_CLONES static void exp_into(const float *x, int64_t n, float inv_t, float shift, float floor_w, float *w) {
    for (int64_t i = 0; i < n; i++) {
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
