/* Quantized weight products (qgemm.h: the routes and the byte layouts): activations quantized
 * (or, on the float route, reordered) once per call on the calling thread, then output
 * features split across cpu.h's pool. Scalar kernels for any CPU, AVX2 kernels (madd_epi16
 * integer dot products, or float32 FMAs over weights decoded per pass) chosen per call by
 * cpu.h's switch. */
#include "qgemm.h"
#include "cpu.h"
#include "dtype.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* x codes are int16 (|q| <= QG_XMAX): a 15-bit activation is as good as float32 for these
 * sums (int8 activations, as llama.cpp uses, moved SmolLM2's decode logprobs by up to 0.67
 * from llama.cpp's while the exact weights stayed within 0.21), and a decode step is bound by
 * the bytes of weights it reads, not by the multiply-adds. */
#define QG_XMAX 32767.0f

#if defined(__x86_64__) && defined(__GNUC__)
#define QG_HAVE_X86 1
#include <immintrin.h>
#endif


typedef struct {
    const float *xf;    /* [M, K] float32 x, contiguous (the float path: num_rows >= QG_FLOAT_ROWS), else NULL */
    const int16_t *qx;  /* [M, K] int16 codes of x */
    const float *dx;    /* [M, K / 32] block scales of x */
    const float *sx;    /* [M, K / 32] exact block sums of x (Q4's m term) */
    int64_t num_rows, num_cols;
    const uint8_t *blocks; int half, high, has_mins; /* Q4 (half: fp16 scales and mins; high: Q5 codes;
                                                      * has_mins: 0 when every min is 0, as for Q5_0) */
    const int8_t *q8; const uint8_t *scales; /* Q8 (scales fp16 when `half`, else float32) */
    const float *bias;
    void *y; int64_t y_stride; int dtype;
    int64_t num_out;
} QArgs;

static inline void store_out(const QArgs *a, int64_t row, int64_t col, float v) {
    if (a->dtype == DT_FLOAT32) {
        ((float *)a->y)[row * a->y_stride + col] = v;
    } else {
        ((uint16_t *)a->y)[row * a->y_stride + col] = dt_f32_to_bf16(v);
    }
}

/* A pair of blocks: 32 bytes of nibbles, and for Q5 rows 8 more of fifth bits. */
static inline int64_t q4_pair_bytes(int high) { return high ? 40 : 32; }

/* Where a row's codes start: after its scales and (has_mins) its mins. */
static inline int64_t q4_codes_offset(int64_t nb, int half, int has_mins) {
    return nb * (half ? 2 : 4) * (has_mins ? 2 : 1);
}

static inline int64_t q4_row_bytes(int64_t nb, int half, int high, int has_mins) {
    return q4_codes_offset(nb, half, has_mins) + nb / 2 * q4_pair_bytes(high);
}

/* Block b's scale (which = 0) or min (which = 1) from a row's scales (fp16 when `half`). */
static inline float block_scale(const uint8_t *row, int64_t nb, int64_t b, int half, int which) {
    if (half) {
        uint16_t h;
        memcpy(&h, row + (which * nb + b) * 2, 2);
        return dt_f16_to_f32(h);
    }
    float f;
    memcpy(&f, row + (which * nb + b) * 4, 4);
    return f;
}

/* Element e (0..63) of a Q4 pair's 32 bytes (qgemm.h). */
static inline int q4_code(const uint8_t *pair, int e) {
    const int quarter = e / 16, i = e % 16;
    return (pair[2 * i + quarter / 2] >> (4 * (quarter % 2))) & 0x0F;
}

/* Element e (0..63) of a Q5 pair's 40 bytes as a signed code c in -16..15 (qgemm.h). */
static inline int q5_code(const uint8_t *pair, int e) {
    const int quarter = e / 16, i = e % 16;
    const int word = pair[2 * i] | (pair[2 * i + 1] << 8);
    int field;
    if (quarter == 0)
        field = ((pair[32 + i / 2] >> (4 * (i % 2))) & 0x0F) | ((word & 1) << 4);
    else
        field = (word >> (5 * quarter - 4)) & 0x1F;
    return field >= 16 ? field - 32 : field;
}

static inline int q45_code(const uint8_t *pair, int e, int high) { return high ? q5_code(pair, e) : q4_code(pair, e); }

/* Element j (0..31) of a Q8 block (qgemm.h: byte 2i = element i, 2i + 1 = element 16 + i). */
static inline int q8_code(const int8_t *block, int j) { return block[2 * (j % 16) + j / 16]; }

/* x [M, K] -> qx, dx, sx (blocks of 32). */
static void quantize_rows(const void *x, int64_t x_stride, int64_t num_rows, int64_t num_cols, int dtype,
                          int16_t *qx, float *dx, float *sx) {
    float v[QK_BLOCK];
    const int64_t nb = num_cols / QK_BLOCK;
    for (int64_t i = 0; i < num_rows; i++) {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = i * x_stride + b * QK_BLOCK;
            if (dtype == DT_FLOAT32) {
                memcpy(v, (const float *)x + at, sizeof v);
            } else {
                const uint16_t *h = (const uint16_t *)x + at;
                for (int j = 0; j < QK_BLOCK; j++) v[j] = dt_bf16_to_f32(h[j]);
            }
            float amax = 0.0f, sum = 0.0f;
            for (int j = 0; j < QK_BLOCK; j++) {
                float m = fabsf(v[j]);
                amax = m > amax ? m : amax;
                sum += v[j];
            }
            const float d = amax / QG_XMAX, inv = amax > 0.0f ? QG_XMAX / amax : 0.0f;
            int16_t *codes = qx + i * num_cols + b * QK_BLOCK;
            for (int j = 0; j < QK_BLOCK; j++) codes[j] = (int16_t)nearbyintf(v[j] * inv);
            dx[i * nb + b] = d;
            sx[i * nb + b] = sum;
        }
    }
}

/* ---- scalar kernels ---- */

static void q4_range_scalar(const void *p, int64_t n0, int64_t n1, float *scratch) {
    (void)scratch;
    const QArgs *a = (const QArgs *)p;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = a->blocks + n * q4_row_bytes(nb, a->half, a->high, a->has_mins);
        const uint8_t *codes = row + q4_codes_offset(nb, a->half, a->has_mins);
        const float bias = a->bias ? a->bias[n] : 0.0f;
        for (int64_t i = 0; i < a->num_rows; i++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const float db = block_scale(row, nb, b, a->half, 0);
                const float mb = a->has_mins ? block_scale(row, nb, b, a->half, 1) : 0.0f;
                const uint8_t *pair = codes + (b / 2) * q4_pair_bytes(a->high);
                const int first = (int)(b % 2) * QK_BLOCK;  /* block b: elements first .. first + 31 of its pair */
                const int16_t *xq = a->qx + i * K + b * QK_BLOCK;
                int32_t dot = 0;
                for (int j = 0; j < QK_BLOCK; j++) dot += q45_code(pair, first + j, a->high) * xq[j];
                acc += db * a->dx[i * nb + b] * (float)dot + mb * a->sx[i * nb + b];
            }
            store_out(a, i, n, acc + bias);
        }
    }
}

static void q8_range_scalar(const void *p, int64_t n0, int64_t n1, float *scratch) {
    (void)scratch;
    const QArgs *a = (const QArgs *)p;
    const int64_t nb = a->num_cols / QK_BLOCK;
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *row = a->q8 + n * a->num_cols;
        const float bias = a->bias ? a->bias[n] : 0.0f;
        for (int64_t i = 0; i < a->num_rows; i++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const int8_t *w = row + b * QK_BLOCK;
                const int16_t *xq = a->qx + i * a->num_cols + b * QK_BLOCK;
                int32_t dot = 0;
                for (int j = 0; j < QK_BLOCK; j++) dot += q8_code(w, j) * xq[j];
                acc += block_scale(a->scales + n * nb * (a->half ? 2 : 4), nb, b, a->half, 0) * a->dx[i * nb + b] * (float)dot;
            }
            store_out(a, i, n, acc + bias);
        }
    }
}

/* ---- AVX2 kernels ---- */

#ifdef QG_HAVE_X86
__attribute__((target("avx2,fma,f16c"))) static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The weight bytes QG_PREFETCH_BYTES ahead of this pass (one pass's worth, not beyond
 * `end`): a pass reads only QG_NR short rows (576 bytes each for SmolLM2's head), too little
 * for the hardware prefetcher to run ahead of. On SmolLM2's int8 head at batch 1 this took
 * the product from ~5.0 to ~2.0-3.3 ms (the distance: best of 2-24 passes tried). */
#define QG_PREFETCH_BYTES 24576
__attribute__((target("avx2,fma,f16c"))) static inline void prefetch_ahead(const uint8_t *at, int64_t bytes,
                                                                          const uint8_t *end) {
    const uint8_t *from = at + QG_PREFETCH_BYTES, *to = from + bytes;
    if (to > end) to = end;
    for (const uint8_t *p = from; p < to; p += 64) _mm_prefetch((const char *)p, _MM_HINT_T0);
}

/* Both kernels take QG_NR weight rows x up to QG_TR activation rows per pass: QG_NR * QG_TR
 * independent accumulators (one FMA chain each, so a single activation row still keeps the
 * FMA units busy), the activation block loaded once per pass and shared by the weight rows. */
#define QG_NR 4
#define QG_TR 2

/* One pass: weight rows n .. n + nr - 1 (pointers in d, m, codes) x activation rows
 * i0 .. i0 + TR - 1. TR is a constant at each call site, so the loops over it unroll. */
/* 8 scales or mins of a Q4 row from block b (fp16 or float32). */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 q4_load8(const uint8_t *p, int64_t b, int half) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + b * 2)));
    return _mm256_loadu_ps((const float *)p + b);
}

__attribute__((target("avx2,fma,f16c"))) static inline float block_scale_f16c(const uint8_t *row, int64_t nb, int64_t b,
                                                                          int half, int which) {
    if (half) {
        uint16_t h;
        memcpy(&h, row + (which * nb + b) * 2, 2);
        return _cvtsh_ss(h);
    }
    return block_scale(row, nb, b, half, which);
}

/* A Q4 (or Q5: HIGH) pair's 64 codes as four runs of 16 int16 (elements 0-15, 16-31, 32-47, 48-63). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void q45_decode_pair(
        const uint8_t *pair, const int HIGH, __m256i w[4]) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)pair);
    if (HIGH) { /* Q5: word i = c3 (bits 11-15), c2 (6-10), c1 (1-5), c0's sign bit (0); the
                 * nibble after: c0's low 4 bits. Arithmetic shifts sign-extend each field. */
        const __m128i p = _mm_loadl_epi64((const __m128i *)(pair + 32));
        const __m256i low = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_slli_epi16(p, 4), p)), 7);
        w[0] = _mm256_srai_epi16(_mm256_or_si256(_mm256_slli_epi16(v, 15), low), 11);  /* bits 7-10: don't care */
        w[1] = _mm256_srai_epi16(_mm256_slli_epi16(v, 10), 11);
        w[2] = _mm256_srai_epi16(_mm256_slli_epi16(v, 5), 11);
        w[3] = _mm256_srai_epi16(v, 11);
    } else {
        const __m256i nibble = _mm256_set1_epi16(0x000F);
        w[0] = _mm256_and_si256(v, nibble);
        w[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        w[2] = _mm256_and_si256(_mm256_srli_epi16(v, 8), nibble);  /* block b + 1 */
        w[3] = _mm256_srli_epi16(v, 12);
    }
}

/* One pass: QG_NR weight rows x TR activation rows. The weights come decoded from `decoded`
 * ([QG_NR][K] int16, filled once per pass when there are more than QG_TR activation rows, so
 * the decode is not repeated for every pair of them) or, when it is NULL, straight from the
 * codes. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void q4_tile_avx2(
        const QArgs *a, int64_t n, int nr, int64_t i0, const int TR, const int HIGH, const uint8_t *const *rows,
        float *scales, const int16_t *decoded) {
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    const int half = a->half;
    const int64_t pair_bytes = q4_pair_bytes(HIGH);
    const int16_t *xrow[QG_TR];
    const uint8_t *codes[QG_NR];
    float macc[QG_NR][QG_TR];
    __m256 acc[QG_NR][QG_TR];
    for (int k = 0; k < QG_NR; k++) codes[k] = rows[k] + q4_codes_offset(nb, half, a->has_mins);
    for (int r = 0; r < TR; r++) {
        xrow[r] = a->qx + (i0 + r) * K;
        const float *dx = a->dx + (i0 + r) * nb, *sx = a->sx + (i0 + r) * nb;
        for (int k = 0; k < QG_NR; k++) {
            const uint8_t *d = rows[k], *m = rows[k] + nb * (half ? 2 : 4);
            float *sc = scales + (k * QG_TR + r) * nb;
            __m256 mv = _mm256_setzero_ps();
            int64_t b = 0;
            for (; b + 8 <= nb; b += 8) {
                _mm256_storeu_ps(sc + b, _mm256_mul_ps(q4_load8(d, b, half), _mm256_loadu_ps(dx + b)));
                if (a->has_mins) mv = _mm256_fmadd_ps(q4_load8(m, b, half), _mm256_loadu_ps(sx + b), mv);
            }
            float mm = hsum_avx2(mv);
            for (; b < nb; b++) { /* the tail (K = 896: 4 of 28 blocks) with F16C, not the portable conversion */
                sc[b] = block_scale_f16c(rows[k], nb, b, half, 0) * dx[b];
                if (a->has_mins) mm += block_scale_f16c(rows[k], nb, b, half, 1) * sx[b];
            }
            macc[k][r] = mm;
            acc[k][r] = _mm256_setzero_ps();
        }
    }
    for (int64_t b = 0; b < nb; b += 2) {
        for (int k = 0; k < QG_NR; k++) {
            __m256i w[4];
            if (decoded != NULL) {
                const int16_t *dw = decoded + k * K + b * QK_BLOCK;
                for (int j = 0; j < 4; j++) w[j] = _mm256_loadu_si256((const __m256i *)(dw + 16 * j));
            } else {
                q45_decode_pair(codes[k] + (b / 2) * pair_bytes, HIGH, w);
            }
            const __m256i w00 = w[0], w01 = w[1], w10 = w[2], w11 = w[3];
            for (int r = 0; r < TR; r++) {
                const int16_t *x = xrow[r] + b * QK_BLOCK;
                const float *sc = scales + (k * QG_TR + r) * nb + b;
                const __m256i p0 = _mm256_add_epi32(_mm256_madd_epi16(w00, _mm256_loadu_si256((const __m256i *)x)),
                                                    _mm256_madd_epi16(w01, _mm256_loadu_si256((const __m256i *)(x + 16))));
                const __m256i p1 = _mm256_add_epi32(_mm256_madd_epi16(w10, _mm256_loadu_si256((const __m256i *)(x + 32))),
                                                    _mm256_madd_epi16(w11, _mm256_loadu_si256((const __m256i *)(x + 48))));
                acc[k][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc), _mm256_cvtepi32_ps(p0), acc[k][r]);
                acc[k][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + 1), _mm256_cvtepi32_ps(p1), acc[k][r]);
            }
        }
    }
    for (int k = 0; k < nr; k++)
        for (int r = 0; r < TR; r++) {
            const float bias = a->bias ? a->bias[n + k] : 0.0f;
            store_out(a, i0 + r, n + k, hsum_avx2(acc[k][r]) + macc[k][r] + bias);
        }
}

/* ---- the float path (many activation rows) ----
 * With QG_FLOAT_ROWS or more activation rows a product is bound by arithmetic, not by the
 * weights' bytes, and the integer tiles spend as many instructions per block on the float
 * epilogue (convert, scale, FMA per block of 32 and row pair) as on the multiply-adds. There,
 * each pass decodes its QG_NR weight rows once into float32 scratch (w = d * c + m: the
 * dequantized weights) and runs plain FMAs against the float32 activations, QG_NR x QG_FR
 * accumulators: no activation quantization, 8 multiply-adds per FMA at two FMAs a cycle. */
#define QG_FR 3

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void float_tile_avx2(
        const QArgs *a, int64_t n, int nr, int64_t i0, const int TR, const float *w) {
    const int64_t K = a->num_cols;
    const float *x[QG_FR];
    __m256 acc[QG_NR][QG_FR];
    for (int r = 0; r < TR; r++) x[r] = a->xf + (i0 + r) * K;
    for (int k = 0; k < QG_NR; k++)
        for (int r = 0; r < TR; r++) acc[k][r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < K; j += 8) {
        __m256 xv[QG_FR];
        for (int r = 0; r < TR; r++) xv[r] = _mm256_loadu_ps(x[r] + j);
        for (int k = 0; k < QG_NR; k++) {
            const __m256 wv = _mm256_loadu_ps(w + k * K + j);
            for (int r = 0; r < TR; r++) acc[k][r] = _mm256_fmadd_ps(wv, xv[r], acc[k][r]);
        }
    }
    for (int k = 0; k < nr; k++)
        for (int r = 0; r < TR; r++) {
            const float bias = a->bias ? a->bias[n + k] : 0.0f;
            store_out(a, i0 + r, n + k, hsum_avx2(acc[k][r]) + bias);
        }
}

/* Every activation row against the QG_NR weight rows decoded at w ([QG_NR][K] float32). */
__attribute__((target("avx2,fma,f16c"))) static void float_rows_avx2(const QArgs *a, int64_t n, int nr,
                                                                    const float *w) {
    int64_t i0 = 0;
    /* tiles of 3 rows, the last 4 as 2 + 2 (a 1-row tile runs 4 FMA chains for 5 loads) */
    for (; a->num_rows - i0 == 3 || a->num_rows - i0 > 4; i0 += QG_FR) float_tile_avx2(a, n, nr, i0, QG_FR, w);
    for (; a->num_rows - i0 >= 2; i0 += 2) float_tile_avx2(a, n, nr, i0, 2, w);
    if (i0 < a->num_rows) float_tile_avx2(a, n, nr, i0, 1, w);
}

/* 16 int16 codes -> two float32 vectors d * c + m at out, in the float path's order: each run
 * of 16 elements is stored as elements 0-3, 8-11, then 4-7, 12-15 (what unpacking the words
 * into the high halves of 32-bit lanes gives, with no lane crossing: the lanes hold c * 65536,
 * so d arrives scaled by 2^-16); the activations are laid out in the same order (run()), and
 * a dot product does not depend on the order of its terms' pairs. */
#define QG_UNPACK_SCALE (1.0f / 65536.0f)

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void codes16_to_float(
        __m256i c, __m256 d, __m256 m, float *out) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_unpacklo_epi16(zero, c));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_unpackhi_epi16(zero, c));
    _mm256_storeu_ps(out, _mm256_fmadd_ps(lo, d, m));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(hi, d, m));
}

/* A row's nb scales (or mins) as float32 times `mul` into out (fp16 or float32 source). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void scales_to_float(const uint8_t *p, int64_t nb, int half,
                                                                    float mul, float *out) {
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) _mm256_storeu_ps(out + b, _mm256_mul_ps(q4_load8(p, b, half), _mm256_set1_ps(mul)));
    for (; b < nb; b++) {
        float v;
        if (half) {
            uint16_t h;
            memcpy(&h, p + b * 2, 2);
            v = _cvtsh_ss(h);
        } else {
            memcpy(&v, p + b * 4, 4);
        }
        out[b] = v * mul;
    }
}

/* A Q4/Q5 row -> float32 out [K] in the float path's order: w = d * c + m per block (m = 0
 * without mins). sm: 2 * nb floats of scratch for the row's scales and mins. */
__attribute__((target("avx2,fma,f16c"))) static void q45_row_to_float(const QArgs *a, const uint8_t *row,
                                                                     float *sm, float *out) {
    const int64_t K = a->num_cols, nb = K / QK_BLOCK, pair_bytes = q4_pair_bytes(a->high);
    const uint8_t *codes = row + q4_codes_offset(nb, a->half, a->has_mins);
    scales_to_float(row, nb, a->half, QG_UNPACK_SCALE, sm);
    if (a->has_mins) scales_to_float(row + nb * (a->half ? 2 : 4), nb, a->half, 1.0f, sm + nb);
    for (int64_t p = 0; p < nb / 2; p++) {
        __m256i w[4];
        if (a->high) q45_decode_pair(codes + p * pair_bytes, 1, w);
        else q45_decode_pair(codes + p * pair_bytes, 0, w);
        for (int half_pair = 0; half_pair < 2; half_pair++) {
            const int64_t b = 2 * p + half_pair;
            const __m256 d = _mm256_broadcast_ss(sm + b);
            const __m256 m = a->has_mins ? _mm256_broadcast_ss(sm + nb + b) : _mm256_setzero_ps();
            codes16_to_float(w[2 * half_pair], d, m, out + b * QK_BLOCK);
            codes16_to_float(w[2 * half_pair + 1], d, m, out + b * QK_BLOCK + 16);
        }
    }
}

/* A Q8 row -> float32 out [K] in the float path's order: w = q * scale per block. sm: nb
 * floats of scratch for the row's scales. */
__attribute__((target("avx2,fma,f16c"))) static void q8_row_to_float(const QArgs *a, const int8_t *row,
                                                                    const uint8_t *scales, float *sm, float *out) {
    const int64_t nb = a->num_cols / QK_BLOCK;
    const __m256 zero = _mm256_setzero_ps();
    scales_to_float(scales, nb, a->half, QG_UNPACK_SCALE, sm);
    for (int64_t b = 0; b < nb; b++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(row + b * QK_BLOCK));
        const __m256 d = _mm256_broadcast_ss(sm + b);
        codes16_to_float(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), d, zero, out + b * QK_BLOCK);
        codes16_to_float(_mm256_srai_epi16(v, 8), d, zero, out + b * QK_BLOCK + 16);
    }
}

__attribute__((target("avx2,fma,f16c"))) static void q4_range_avx2(const void *p, int64_t n0, int64_t n1,
                                                                  float *scratch) {
    const QArgs *a = (const QArgs *)p;
    const int64_t row_bytes = q4_row_bytes(a->num_cols / QK_BLOCK, a->half, a->high, a->has_mins);
    for (int64_t n = n0; n < n1; n += QG_NR) {
        const int nr = n1 - n < QG_NR ? (int)(n1 - n) : QG_NR;
        const uint8_t *rows[QG_NR];
        for (int k = 0; k < QG_NR; k++) rows[k] = a->blocks + (n + (k < nr ? k : 0)) * row_bytes;
        prefetch_ahead(a->blocks + n * row_bytes, QG_NR * row_bytes, a->blocks + n1 * row_bytes);
        if (a->xf != NULL) {
            float *sm = scratch + QG_NR * a->num_cols;
            for (int k = 0; k < QG_NR; k++) q45_row_to_float(a, rows[k], sm, scratch + k * a->num_cols);
            float_rows_avx2(a, n, nr, scratch);
            continue;
        }
        int64_t i0 = 0;
        int16_t *decoded = NULL;
        if (a->num_rows > QG_TR) { /* decode the pass's rows once for all the activation rows */
            const int64_t K = a->num_cols, pair_bytes = q4_pair_bytes(a->high);
            decoded = (int16_t *)(scratch + QG_NR * QG_TR * (K / QK_BLOCK));
            for (int k = 0; k < QG_NR; k++) {
                const uint8_t *codes = rows[k] + q4_codes_offset(K / QK_BLOCK, a->half, a->has_mins);
                for (int64_t p = 0; p < K / (2 * QK_BLOCK); p++) {
                    __m256i w[4];
                    if (a->high) q45_decode_pair(codes + p * pair_bytes, 1, w);
                    else q45_decode_pair(codes + p * pair_bytes, 0, w);
                    for (int j = 0; j < 4; j++)
                        _mm256_storeu_si256((__m256i *)(decoded + k * K + p * 2 * QK_BLOCK + 16 * j), w[j]);
                }
            }
        }
        if (a->high) {
            for (; i0 + QG_TR <= a->num_rows; i0 += QG_TR) q4_tile_avx2(a, n, nr, i0, QG_TR, 1, rows, scratch, decoded);
            if (i0 < a->num_rows) q4_tile_avx2(a, n, nr, i0, 1, 1, rows, scratch, decoded);
        } else {
            for (; i0 + QG_TR <= a->num_rows; i0 += QG_TR) q4_tile_avx2(a, n, nr, i0, QG_TR, 0, rows, scratch, decoded);
            if (i0 < a->num_rows) q4_tile_avx2(a, n, nr, i0, 1, 0, rows, scratch, decoded);
        }
    }
}

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void q8_tile_avx2(
        const QArgs *a, int64_t n, int nr, int64_t i0, const int TR, const int8_t *const *rows,
        const uint8_t *const *wscales, float *scales) {
    const int64_t nb = a->num_cols / QK_BLOCK;
    __m256 acc[QG_NR][QG_TR];
    for (int r = 0; r < TR; r++) {
        const float *dx = a->dx + (i0 + r) * nb;
        for (int k = 0; k < QG_NR; k++) {
            float *sc = scales + (k * QG_TR + r) * nb;
            int64_t b = 0;
            for (; b + 8 <= nb; b += 8)
                _mm256_storeu_ps(sc + b, _mm256_mul_ps(q4_load8(wscales[k], b, a->half), _mm256_loadu_ps(dx + b)));
            for (; b < nb; b++) sc[b] = block_scale_f16c(wscales[k], nb, b, a->half, 0) * dx[b];
            acc[k][r] = _mm256_setzero_ps();
        }
    }
    for (int64_t b = 0; b < nb; b++) {
        for (int k = 0; k < QG_NR; k++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(rows[k] + b * QK_BLOCK));
            const __m256i w0 = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8);  /* low bytes: elements 0..15 */
            const __m256i w1 = _mm256_srai_epi16(w, 8);                         /* high bytes: 16..31 */
            for (int r = 0; r < TR; r++) {
                const int16_t *x = a->qx + (i0 + r) * a->num_cols + b * QK_BLOCK;
                const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)x)),
                                                     _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(x + 16))));
                const float *sc = scales + (k * QG_TR + r) * nb + b;
                acc[k][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc), _mm256_cvtepi32_ps(dot), acc[k][r]);
            }
        }
    }
    for (int k = 0; k < nr; k++)
        for (int r = 0; r < TR; r++) {
            const float bias = a->bias ? a->bias[n + k] : 0.0f;
            store_out(a, i0 + r, n + k, hsum_avx2(acc[k][r]) + bias);
        }
}

__attribute__((target("avx2,fma,f16c"))) static void q8_range_avx2(const void *p, int64_t n0, int64_t n1,
                                                                  float *scratch) {
    const QArgs *a = (const QArgs *)p;
    const int64_t nb = a->num_cols / QK_BLOCK;
    for (int64_t n = n0; n < n1; n += QG_NR) {
        const int nr = n1 - n < QG_NR ? (int)(n1 - n) : QG_NR;
        const int8_t *rows[QG_NR];
        const uint8_t *wscales[QG_NR];
        for (int k = 0; k < QG_NR; k++) {
            const int64_t row = n + (k < nr ? k : 0);
            rows[k] = a->q8 + row * a->num_cols;
            wscales[k] = a->scales + row * nb * (a->half ? 2 : 4);
        }
        prefetch_ahead((const uint8_t *)a->q8 + n * a->num_cols, QG_NR * a->num_cols,
                       (const uint8_t *)a->q8 + n1 * a->num_cols);
        if (a->xf != NULL) {
            float *sm = scratch + QG_NR * a->num_cols;
            for (int k = 0; k < QG_NR; k++) q8_row_to_float(a, rows[k], wscales[k], sm, scratch + k * a->num_cols);
            float_rows_avx2(a, n, nr, scratch);
            continue;
        }
        int64_t i0 = 0;
        for (; i0 + QG_TR <= a->num_rows; i0 += QG_TR) q8_tile_avx2(a, n, nr, i0, QG_TR, rows, wscales, scratch);
        if (i0 < a->num_rows) q8_tile_avx2(a, n, nr, i0, 1, rows, wscales, scratch);
    }
}
#endif

/* x [M, K] (float32 or bfloat16, row stride x_stride) -> xf [M, K] float32 in the float path's
 * order: each run of 16 elements as elements 0-3, 8-11, 4-7, 12-15 (codes16_to_float). */
#ifdef QG_HAVE_X86
__attribute__((target("avx2,fma,f16c"))) static void float_rows_in_decoded_order(
        const void *x, int64_t x_stride, int64_t M, int64_t K, int dtype, float *xf) {
    for (int64_t i = 0; i < M; i++) {
        for (int64_t j = 0; j < K; j += 16) {
            __m256 lo, hi;  /* elements 0-7, 8-15 */
            if (dtype == DT_FLOAT32) {
                const float *src = (const float *)x + i * x_stride + j;
                lo = _mm256_loadu_ps(src);
                hi = _mm256_loadu_ps(src + 8);
            } else {  /* bfloat16: the 16 bits above 16 zero bits */
                const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i * x_stride + j));
                lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
                hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
            }
            _mm256_storeu_ps(xf + i * K + j, _mm256_permute2f128_ps(lo, hi, 0x20));      /* 0-3, 8-11 */
            _mm256_storeu_ps(xf + i * K + j + 8, _mm256_permute2f128_ps(lo, hi, 0x31));  /* 4-7, 12-15 */
        }
    }
}
#endif

/* ---- entry points ---- */

static int64_t qg_float_rows = 6;  /* measured: benchmarks/qgemm_rows.py */

void qg_set_float_rows(int64_t rows) { qg_float_rows = rows; }

int64_t qg_get_float_rows(void) { return qg_float_rows; }

static int run(QArgs *a, const void *x, int64_t x_stride, int is_q4) {
    const int64_t M = a->num_rows, K = a->num_cols, nb = K / QK_BLOCK;
    if (K <= 0 || K % (is_q4 ? 2 * QK_BLOCK : QK_BLOCK) != 0) return QG_BAD_LENGTH;
    if (M <= 0 || a->num_out <= 0) return QG_OK;
    CpuRangeFn fn = is_q4 ? q4_range_scalar : q8_range_scalar;
    int use_float = 0;
#ifdef QG_HAVE_X86
    if (cpu_isa() >= CPU_ISA_AVX2) {
        fn = is_q4 ? q4_range_avx2 : q8_range_avx2;
        use_float = M >= qg_float_rows;
    }
#endif
    char *buf;
    if (use_float) {
        buf = (char *)malloc(sizeof(float) * (size_t)(M * K));
        if (buf == NULL) return QG_NO_MEMORY;
#ifdef QG_HAVE_X86
        float_rows_in_decoded_order(x, x_stride, M, K, a->dtype, (float *)buf);
#endif
        a->xf = (const float *)buf;
    } else {
        buf = (char *)malloc(sizeof(int16_t) * (size_t)(M * K) + sizeof(float) * 2 * (size_t)(M * nb));
        if (buf == NULL) return QG_NO_MEMORY;
        float *dx = (float *)buf, *sx = dx + M * nb;
        int16_t *qx = (int16_t *)(sx + M * nb);
        quantize_rows(x, x_stride, M, K, a->dtype, qx, dx, sx);
        a->qx = qx; a->dx = dx; a->sx = sx;
    }
    /* scratch per worker: the pass's scales, then (Q4/Q5) its rows' decoded codes, QG_NR x K int16 */
    const size_t floats = (size_t)(use_float ? QG_NR * K + 2 * nb
                                             : QG_NR * QG_TR * nb + (is_q4 ? QG_NR * K / 2 : 0));
    int rc = cpu_parallel_for(fn, a, a->num_out, M * a->num_out * K, floats);
    free(buf);
    return rc;
}

int qg_matmul(int layout, const void *x, int64_t x_stride, int64_t num_rows, int64_t num_cols,
              const void *w, const void *scales, int64_t num_out, const float *bias,
              void *y, int64_t y_stride, int dtype) {
    const int format = layout & QG_FORMAT_MASK, half = (layout & QG_HALF) != 0;
    if (format == QG_Q8) {
        QArgs a = {NULL, NULL, NULL, NULL, num_rows, num_cols, NULL, half, 0, 0, (const int8_t *)w,
                   (const uint8_t *)scales, bias, y, y_stride, dtype, num_out};
        return run(&a, x, x_stride, 0);
    }
    if (format != QG_Q4 && format != QG_Q5) return QG_BAD_LAYOUT;
    QArgs a = {NULL, NULL, NULL, NULL, num_rows, num_cols, (const uint8_t *)w, half, format == QG_Q5,
               !(layout & QG_NO_MINS), NULL, NULL, bias, y, y_stride, dtype, num_out};
    return run(&a, x, x_stride, 1);
}

int qg_dequantize(int layout, const void *w, const void *scales, int64_t first, int64_t count,
                  int64_t num_cols, void *out, int out_dtype) {
    const int format = layout & QG_FORMAT_MASK, half = (layout & QG_HALF) != 0;
    if (format != QG_Q4 && format != QG_Q5 && format != QG_Q8) return QG_BAD_LAYOUT;
    if (num_cols <= 0 || num_cols % ((format == QG_Q8 ? 1 : 2) * QK_BLOCK) != 0) return QG_BAD_LENGTH;
    const int64_t nb = num_cols / QK_BLOCK;
    const int high = format == QG_Q5, has_mins = !(layout & QG_NO_MINS);
    float v[QK_BLOCK];
    for (int64_t n = first; n < first + count; n++) {
        const int64_t at = (n - first) * num_cols;
        for (int64_t b = 0; b < nb; b++) {
            if (format == QG_Q8) {
                const int8_t *block = (const int8_t *)w + n * num_cols + b * QK_BLOCK;
                const float d = block_scale((const uint8_t *)scales + n * nb * (half ? 2 : 4), nb, b, half, 0);
                for (int j = 0; j < QK_BLOCK; j++) v[j] = d * (float)q8_code(block, j);
            } else {
                const uint8_t *row = (const uint8_t *)w + n * q4_row_bytes(nb, half, high, has_mins);
                const uint8_t *pair = row + q4_codes_offset(nb, half, has_mins) + (b / 2) * q4_pair_bytes(high);
                const int first_element = (int)(b % 2) * QK_BLOCK;
                const float d = block_scale(row, nb, b, half, 0);
                const float m = has_mins ? block_scale(row, nb, b, half, 1) : 0.0f;
                for (int j = 0; j < QK_BLOCK; j++) v[j] = d * (float)q45_code(pair, first_element + j, high) + m;
            }
            if (out_dtype == DT_FLOAT32) {
                memcpy((float *)out + at + b * QK_BLOCK, v, sizeof v);
            } else {
                uint16_t *dst = (uint16_t *)out + at + b * QK_BLOCK;
                for (int j = 0; j < QK_BLOCK; j++) dst[j] = dt_f32_to_bf16(v[j]);
            }
        }
    }
    return QG_OK;
}

int qg_q5_pack(const uint8_t *packed, const uint8_t *high, int64_t num_rows, int64_t num_cols, uint8_t *out,
               int64_t out_stride) {
    if (num_cols <= 0 || num_cols % (2 * QK_BLOCK) != 0) return QG_BAD_LENGTH;
    const int64_t num_pairs = num_cols / (2 * QK_BLOCK);
    for (int64_t n = 0; n < num_rows; n++) {
        const uint8_t *nib = packed + n * (num_cols / 2), *qh = high + n * (num_cols / 8);
        uint8_t *dst = out + n * out_stride;
        for (int64_t p = 0; p < num_pairs; p++, nib += 32, qh += 8, dst += 40) {
            uint32_t h0, h1;  /* the pair's two blocks' fifth bits, bit j = element j */
            memcpy(&h0, qh, 4);
            memcpy(&h1, qh + 4, 4);
            for (int i = 0; i < 16; i++) {
                /* 5-bit two's complement of q - 16 is q ^ 16: flip the fifth bit */
                const int c0 = ((nib[i] & 0x0F) | (((h0 >> i) & 1) << 4)) ^ 16;
                const int c1 = ((nib[i] >> 4) | (((h0 >> (16 + i)) & 1) << 4)) ^ 16;
                const int c2 = ((nib[16 + i] & 0x0F) | (((h1 >> i) & 1) << 4)) ^ 16;
                const int c3 = ((nib[16 + i] >> 4) | (((h1 >> (16 + i)) & 1) << 4)) ^ 16;
                const uint16_t word = (uint16_t)((c3 << 11) | (c2 << 6) | (c1 << 1) | (c0 >> 4));
                dst[2 * i] = (uint8_t)(word & 0xFF);
                dst[2 * i + 1] = (uint8_t)(word >> 8);
                if (i % 2 == 0)
                    dst[32 + i / 2] = (uint8_t)(c0 & 0x0F);
                else
                    dst[32 + i / 2] |= (uint8_t)((c0 & 0x0F) << 4);
            }
        }
    }
    return QG_OK;
}
