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
    const uint8_t *blocks; int half, high, has_mins; /* Q4 (half: 1 fp16 scales and mins, 2 QG_SUPER's
                                                      * groups, 0 float32; high: Q5 codes;
                                                      * has_mins: 0 when every min is 0, as for Q5_0) */
    const int8_t *q8; const uint8_t *scales; /* Q8 (scales fp16 when `half`, else float32) */
    const float *bias;
    void *y; int64_t y_stride; int dtype;
    int64_t num_out;
    int packed;  /* QG_PACKED: a->blocks holds strips of 16 rows; PACKED_Q4, PACKED_Q5 or PACKED_Q8 */
    int int8;    /* QG_INT8 (packed layouts): activation codes |q| <= 127 */
    const int8_t *qx8;   /* QG_INT8 on the AVX-512 kernel: [M, K] codes in its order (strip_quantize_rows8) */
    const int32_t *isx;  /* with qx8: [M, K / 32] each block's sum of codes (PACKED_Q6: [M, K / 16], each
                          * group of 16's) */
} QArgs;

static inline void store_out(const QArgs *a, int64_t row, int64_t col, float v) {
    if (a->dtype == DT_FLOAT32) {
        ((float *)a->y)[row * a->y_stride + col] = v;
    } else {
        ((uint16_t *)a->y)[row * a->y_stride + col] = dt_f32_to_bf16(v);
    }
}

/* One buffer for M rows of activation codes: *qx [M, K] int16, *dx and *sx [M, K / 32] -> the buffer
 * to free, or NULL (no memory). */
static char *alloc_codes(int64_t M, int64_t K, int16_t **qx, float **dx, float **sx) {
    const int64_t nb = K / QK_BLOCK;
    char *buf = (char *)malloc(sizeof(int16_t) * (size_t)(M * K) + sizeof(float) * 2 * (size_t)(M * nb));
    if (buf != NULL) {
        *dx = (float *)buf;
        *sx = *dx + M * nb;
        *qx = (int16_t *)(*sx + M * nb);
    }
    return buf;
}

/* A pair of blocks: 32 bytes of nibbles, and for Q5 rows 8 more of fifth bits. */
static inline int64_t q4_pair_bytes(int high) { return high ? 40 : 32; }

/* Q4 scale modes (QArgs.half): float32, fp16, QG_SUPER's groups. */
enum { QG_SCALES_F32 = 0, QG_SCALES_F16 = 1, QG_SCALES_SUPER = 2 };

static inline int layout_scales(int layout) {
    return (layout & QG_HALF) ? QG_SCALES_F16 : (layout & QG_SUPER) ? QG_SCALES_SUPER : QG_SCALES_F32;
}

/* The bytes of a row's nb scales (and again of its mins). */
static inline int64_t q4_scale_bytes(int64_t nb, int half) {
    return half == QG_SCALES_SUPER ? nb / 8 * 10 : nb * (half ? 2 : 4);
}

/* Where a row's codes start: after its scales and (has_mins) its mins. */
static inline int64_t q4_codes_offset(int64_t nb, int half, int has_mins) {
    return q4_scale_bytes(nb, half) * (has_mins ? 2 : 1);
}

static inline int64_t q4_row_bytes(int64_t nb, int half, int high, int has_mins) {
    return q4_codes_offset(nb, half, has_mins) + nb / 2 * q4_pair_bytes(high);
}

/* Block b's scale (which = 0) or min (which = 1) from a row's scales (fp16 when `half`). */
static inline float block_scale(const uint8_t *row, int64_t nb, int64_t b, int half, int which) {
    if (half == QG_SCALES_SUPER) {
        const uint8_t *group = row + which * q4_scale_bytes(nb, half) + b / 8 * 10;
        uint16_t h;
        memcpy(&h, group, 2);
        return dt_f16_to_f32(h) * (float)group[2 + b % 8];
    }
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

/* The sum of a block's 32 values in the order of the strip route's quantizer (qgemm_strip.h: the
 * two halves added lane by lane, then GCC's _mm512_reduce_add_ps: halves of 8, 4, then pairs). */
static float strip_order_sum(const float *v) {
    float t[16];
    for (int i = 0; i < 16; i++) t[i] = v[i] + v[16 + i];
    for (int i = 0; i < 8; i++) t[i] = t[8 + i] + t[i];
    for (int i = 0; i < 4; i++) t[i] = t[4 + i] + t[i];
    return (t[0] + t[2]) + (t[1] + t[3]);
}

/* x [M, K] -> qx, dx, sx (blocks of 32); strip_order: the sums in strip_order_sum's order. int8
 * (QG_INT8): codes |q| <= 127 and sx = dx * (the codes' sum), else |q| <= QG_XMAX and sx the exact
 * sum. */
static void quantize_rows(const void *x, int64_t x_stride, int64_t num_rows, int64_t num_cols, int dtype,
                          int16_t *qx, float *dx, float *sx, int strip_order, int int8) {
    const float xmax = int8 ? 127.0f : QG_XMAX;
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
            const float d = amax / xmax, inv = amax > 0.0f ? xmax / amax : 0.0f;
            int16_t *codes = qx + i * num_cols + b * QK_BLOCK;
            int32_t code_sum = 0;
            for (int j = 0; j < QK_BLOCK; j++) {
                codes[j] = (int16_t)nearbyintf(v[j] * inv);
                code_sum += codes[j];
            }
            dx[i * nb + b] = d;
            sx[i * nb + b] = int8 ? d * (float)code_sum : strip_order ? strip_order_sum(v) : sum;
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

/* ---- QG_PACKED: Q4, Q5 and Q8 rows in strips of 16 (qgemm.h) ---- */
/* PACKED_Q5I8: Q5 strips whose sign masks qg_pack_int8 rewrote in the int8 kernel's order (QG_INT8).
 * PACKED_Q6: QG_Q6's strips (qg_q6k_pack). */
enum { PACKED_Q4 = 1, PACKED_Q8 = 2, PACKED_Q5 = 3, PACKED_Q5I8 = 4, PACKED_Q6 = 5 };

/* A strip's bytes of codes per block: 16 rows x 32 nibbles (and Q5's 16 sign masks, Q6's high bits)
 * or bytes. */
static inline int64_t packed_code_bytes(int packed) {
    return packed == PACKED_Q8 ? 512 : packed == PACKED_Q6 ? 384 : packed == PACKED_Q5 || packed == PACKED_Q5I8 ? 320 : 256;
}

#define QS_TILE 16  /* outputs per strip */
#define QS_ROWS 8   /* the most activation rows one pass over a strip (or a panel) takes */
#define QS_PASSES(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)
/* M rows in ceil(M / QS_ROWS) passes of near-equal counts (rows i0 .. i0 + rows - 1 each): 9
 * rows as 4 + 5, not 8 + 1 (a lone row re-reads the strip at a decode row's cost). Every count
 * sums the same integers in the same float32 order, so a row's outputs do not depend on it. */
#define QS_SPLIT(M, CALL)                                                                               \
    {                                                                                                   \
        const int64_t num_ = (M);                                                                       \
        int64_t i0 = 0;                                                                                 \
        for (int64_t p_ = (num_ + QS_ROWS - 1) / QS_ROWS; p_ > 0; p_--) {                               \
            const int64_t rows = (num_ - i0) / p_;                                                      \
            CALL;                                                                                       \
            i0 += rows;                                                                                 \
        }                                                                                               \
    }

/* Whether a packed strip holds mins after its scales (Q4, and Q5 with mins). */
static inline int packed_mins(int packed, int has_mins) { return packed != PACKED_Q8 && packed != PACKED_Q6 && has_mins; }

/* A strip's bytes of scales (and again of mins, Q4). */
static inline int64_t packed_scale_bytes(int64_t nb, int half) {
    return half == QG_SCALES_SUPER ? nb / 8 * 160 : nb * 16 * (half ? 2 : 4);
}

static inline int64_t packed_strip_bytes(int packed, int64_t nb, int half, int has_mins) {
    if (packed == PACKED_Q6) return nb * 420;  /* codes 384, scales 2 x 16, d 16 x 2 per 8 blocks */
    return nb * packed_code_bytes(packed) + (1 + packed_mins(packed, has_mins)) * packed_scale_bytes(nb, half);
}

/* Where Q5's sign bit of input e of row j sits in block b's masks (byte, and bit within it): mask
 * 4v + t (a little-endian uint32 after the nibbles) has bit 2j for input 8v + 2t, 2j + 1 for 8v + 2t + 1. */
static inline int64_t packed_sign_at(int64_t b, int j, int e, int *bit) {
    const int k = e % 8, index = 2 * j + k % 2;
    *bit = index % 8;
    return b * 320 + 256 + 4 * (4 * (e / 8) + k / 2) + index / 8;
}

/* The same for PACKED_Q5I8 (qgemm.h's QG_INT8), whose bit is set where the code is NOT negative: per
 * vector v two little-endian uint64, for the nibbles & 0x0F0F0F0F (t = 0, 2) then >> 4 (t = 1, 3), bit
 * 4j + k for byte k of row j's lane, byte k holding input 8v + 2t + p at k = t / 2 + 2p. */
static inline int64_t packed_sign8_at(int64_t b, int j, int e, int *bit) {
    const int k = e % 8, t = k / 2, index = 4 * j + t / 2 + 2 * (k % 2);
    *bit = index % 8;
    return b * 320 + 256 + 16 * (e / 8) + 8 * (t % 2) + index / 8;
}

/* Input e (0..31) of block b of row j (0..15) of a strip: Q4 nibble t of vector e / 8 holds 8v + 2t,
 * nibble t + 4 holds 8v + 2t + 1 (Q5: its low 4 bits, minus 16 where its sign bit is set); Q8 byte 0,
 * 2, 1, 3 of vector e / 4 holds 4u, 4u + 1, 4u + 2, 4u + 3. */
static inline int packed_code(int packed, const uint8_t *strip, int64_t b, int j, int e) {
    if (packed == PACKED_Q8) {
        const int k = e % 4;
        return (int8_t)strip[b * 512 + (e / 4) * 64 + 4 * j + ((k & 1) << 1) + (k >> 1)];
    }
    const int k = e % 8, nibble = k / 2 + 4 * (k % 2);
    const uint8_t *u = strip + b * packed_code_bytes(packed) + (e / 8) * 64 + 4 * j;
    const int low = (u[nibble / 2] >> (4 * (nibble % 2))) & 0x0F;
    int bit;
    if (packed == PACKED_Q5I8) {
        const int64_t at = packed_sign8_at(b, j, e, &bit);
        return (strip[at] >> bit) & 1 ? low : low - 16;
    }
    if (packed != PACKED_Q5) return low;
    const int64_t at = packed_sign_at(b, j, e, &bit);
    return (strip[at] >> bit) & 1 ? low - 16 : low;
}

/* Block b of row j of a PACKED_Q6 strip -> its 32 codes q - 32 (-32..31), the six words read once.
 * Input e keeps its code (qgemm.h) as pair p = e / 2 in half h = e % 2 of 32-bit lane j of word u of
 * the block's six, q ^ 32 in 6-bit fields: pairs 0-11 whole (word p / 2, bits 16 h + 6 (p % 2)), pairs
 * 12 + m their low 4 bits at bits 16 h + 12 of word m and their high 2 bits at bits 16 h + 12 + 2 (m % 2)
 * of word 4 + m / 2. */
static inline void q6_packed_block(const uint8_t *strip, int64_t b, int j, int *codes) {
    uint32_t w[6];
    for (int u = 0; u < 6; u++) memcpy(&w[u], strip + b * 384 + u * 64 + 4 * j, 4);
    for (int e = 0; e < QK_BLOCK; e++) {
        const int p = e / 2, h = e % 2;
        int field;
        if (p < 12) {
            field = (int)(w[p / 2] >> (16 * h + 6 * (p % 2))) & 0x3F;
        } else {
            const int m = p - 12;
            field = ((int)(w[m] >> (16 * h + 12)) & 0x0F) | ((int)(w[4 + m / 2] >> (16 * h + 12 + 2 * (m % 2))) & 3) << 4;
        }
        codes[e] = (field ^ 32) - 32;
    }
}

/* Group g (16 inputs) of row j of a PACKED_Q6 strip: d * s[g] (exact in float32). */
static inline float q6_packed_scale(const uint8_t *strip, int64_t nb, int64_t g, int j) {
    const uint8_t *sc = strip + nb * 384;
    uint16_t h;
    memcpy(&h, sc + 2 * nb * 16 + (g / 16) * 32 + 2 * j, 2);
    return dt_f16_to_f32(h) * (float)(int8_t)sc[g * 16 + j];
}

/* Block b's scale (which = 0) or min (which = 1) of row j of a strip. */
static inline float packed_scale(int packed, const uint8_t *strip, int64_t nb, int64_t b, int j, int half,
                                 int which) {
    const uint8_t *sc = strip + nb * packed_code_bytes(packed) + which * packed_scale_bytes(nb, half);
    uint16_t h;
    if (half == QG_SCALES_SUPER) {
        const uint8_t *group = sc + b / 8 * 160;
        memcpy(&h, group + 2 * j, 2);
        return dt_f16_to_f32(h) * (float)group[32 + (b % 8) * 16 + j];
    }
    if (half) {
        memcpy(&h, sc + (b * 16 + j) * 2, 2);
        return dt_f16_to_f32(h);
    }
    float f;
    memcpy(&f, sc + (b * 16 + j) * 4, 4);
    return f;
}

/* Strips s0 .. s1 - 1 of a packed product, one output at a time, with the AVX-512 kernel's
 * operations in its order (an exact integer sum per block, then its float32 FMAs): the same
 * bits. */
static void packed_range_scalar(const void *p, int64_t s0, int64_t s1, float *scratch) {
    (void)scratch;
    const QArgs *a = (const QArgs *)p;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    const int packed = a->packed, mins = packed_mins(packed, a->has_mins);
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *strip = a->blocks + s * packed_strip_bytes(packed, nb, a->half, a->has_mins);
        for (int j = 0; j < 16; j++) {
            const int64_t n = s * 16 + j;
            const float bias = a->bias ? a->bias[n] : 0.0f;
            for (int64_t i = 0; i < a->num_rows; i++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const int16_t *xq = a->qx + i * K + b * QK_BLOCK;
                    if (packed == PACKED_Q6) {  /* a sum per group of 16 */
                        float f[2];
                        int codes[QK_BLOCK];
                        q6_packed_block(strip, b, j, codes);
                        for (int g = 0; g < 2; g++) {
                            int32_t dot = 0;
                            for (int e = 0; e < 16; e++) dot += codes[16 * g + e] * xq[16 * g + e];
                            f[g] = (float)dot;
                        }
                        const float t = fmaf(f[1], q6_packed_scale(strip, nb, 2 * b + 1, j),
                                             f[0] * q6_packed_scale(strip, nb, 2 * b, j));
                        acc = fmaf(t, a->dx[i * nb + b], acc);
                        continue;
                    }
                    int32_t dot = 0;
                    for (int e = 0; e < QK_BLOCK; e++) dot += packed_code(packed, strip, b, j, e) * xq[e];
                    const float scale = packed_scale(packed, strip, nb, b, j, a->half, 0) * a->dx[i * nb + b];
                    acc = fmaf((float)dot, scale, acc);
                    if (mins) acc = fmaf(packed_scale(packed, strip, nb, b, j, a->half, 1), a->sx[i * nb + b], acc);
                }
                store_out(a, i, n, acc + bias);
            }
        }
    }
}

/* Rows first .. first + count - 1 of packed strips -> out [count, K]: w = d * q + m per block (multiply,
 * then add), as the row layout dequantizes. */
static void dequantize_packed(int packed, const uint8_t *w, int half, int has_mins, int64_t first, int64_t count,
                              int64_t num_cols, void *out, int out_dtype) {
    const int64_t nb = num_cols / QK_BLOCK;
    for (int64_t n = first; n < first + count; n++) {
        const uint8_t *strip = w + (n / 16) * packed_strip_bytes(packed, nb, half, has_mins);
        const int j = (int)(n % 16);
        for (int64_t b = 0; b < nb; b++) {
            float v[QK_BLOCK];
            if (packed == PACKED_Q6) {  /* (d * s) * c, as ggml's d * sc * q */
                int codes[QK_BLOCK];
                q6_packed_block(strip, b, j, codes);
                const float scale[2] = {q6_packed_scale(strip, nb, 2 * b, j), q6_packed_scale(strip, nb, 2 * b + 1, j)};
                for (int e = 0; e < QK_BLOCK; e++) v[e] = scale[e / 16] * (float)codes[e];
            } else {
                const float d = packed_scale(packed, strip, nb, b, j, half, 0);
                const float m = packed_mins(packed, has_mins) ? packed_scale(packed, strip, nb, b, j, half, 1) : 0.0f;
                for (int e = 0; e < QK_BLOCK; e++) {
                    v[e] = d * (float)packed_code(packed, strip, b, j, e);
                    if (packed != PACKED_Q8) v[e] = v[e] + m;  /* as the row layouts dequantize */
                }
            }
            const int64_t at = (n - first) * num_cols + b * QK_BLOCK;
            for (int e = 0; e < QK_BLOCK; e++) {
                if (out_dtype == DT_FLOAT32) ((float *)out)[at + e] = v[e];
                else ((uint16_t *)out)[at + e] = dt_f32_to_bf16(v[e]);
            }
        }
    }
}

/* A dequantize call: rows [first, first + count) of W -> out. */
typedef struct {
    int format, half, has_mins; const uint8_t *w; const int8_t *w8; const uint8_t *scales;
    int64_t first, num_cols; void *out; int out_dtype;
} DqArgs;

/* ---- x86 kernels: one source (qgemm_x86.h), two variants ---- */

#ifdef QG_HAVE_X86
#include <cpuid.h>

/* Which cache the weight prefetch fills (QG_FN(prefetch_spread)): QG_PREFETCH_L1 (prefetcht0) or
 * QG_PREFETCH_L2 (prefetcht1); 0 until the first product asks (qg_prefetch_level). */
static int qg_prefetch = 0;

/* The CPU's default: L2 on AMD, L1 elsewhere. Measured (docs/performance.md, "The weights'
 * prefetch"): on a Zen 4 prefetcht0 left a one-row decode step ~1.35x slower than prefetcht1
 * (Gemma 3 270M 22-28 vs 16-18 ms, Qwen2.5-0.5B 37-39 vs 26-28); prefetcht0 is what the
 * distance was tuned with on an AMX Xeon, where prefetcht1 is not measured yet. */
static int qg_default_prefetch(void) {
    unsigned eax, ebx, ecx, edx;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) && ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u)
        return QG_PREFETCH_L2;  /* "AuthenticAMD" */
    return QG_PREFETCH_L1;
}

/* Whether products of up to QG_INPLACE_ROWS rows (decode steps) spread their weight prefetch
 * over each pass's block loop (QG_FN(prefetch_step)) instead of issuing it in one burst at the
 * pass's start. */
static int qg_spread = 1;

static inline int qg_spread_on(void) { return __atomic_load_n(&qg_spread, __ATOMIC_RELAXED); }

int qg_prefetch_spread(void) { return qg_spread_on(); }

void qg_set_prefetch_spread(int on) { __atomic_store_n(&qg_spread, on != 0, __ATOMIC_RELAXED); }

/* Products of up to this many rows read each pass's codes in place, one tile per pair of rows
 * (the weights decoded again for each pair, from L1); more rows decode each pass's weights once
 * into scratch first. Same bits either way. Qwen2.5-0.5B's decode step (benchmarks/decode.py,
 * Zen 4, the two ways in alternate processes): 3 rows 36.7-39.3 ms in place against 47.7-48.2,
 * 4 rows 39.8-43.1 against 51.4-51.8, 5 rows 53.1-56.3 against 56.5-61.9; 6-9 rows alike. */
#define QG_INPLACE_ROWS 5

int qg_prefetch_level(void) {
    int level = __atomic_load_n(&qg_prefetch, __ATOMIC_RELAXED);
    if (level == 0) {
        level = qg_default_prefetch();
        __atomic_store_n(&qg_prefetch, level, __ATOMIC_RELAXED);
    }
    return level;
}

void qg_set_prefetch_level(int level) {
    __atomic_store_n(&qg_prefetch, level == QG_PREFETCH_L1 || level == QG_PREFETCH_L2 ? level : 0, __ATOMIC_RELAXED);
}
#else
int qg_prefetch_level(void) { return QG_PREFETCH_L1; }
void qg_set_prefetch_level(int level) { (void)level; }
int qg_prefetch_spread(void) { return 0; }
void qg_set_prefetch_spread(int on) { (void)on; }
#endif

#ifdef QG_HAVE_X86
#define QG_CAT2(a, b) a##_##b
#define QG_CAT(a, b) QG_CAT2(a, b)
#define QG_FN(name) QG_CAT(name, QG_SUFFIX)
#define QG_ALWAYS_INLINE __attribute__((always_inline))
#define QG_LOAD16(p) _mm256_loadu_si256((const __m256i *)(p))

/* Block step b of a pass over a strip: the next strip's share of it (its bytes per block, codes and
 * scales alike), one strip ahead, into qg_prefetch_level's cache (l2). */
QG_ALWAYS_INLINE static inline void packed_prefetch_block(const uint8_t *strip, int64_t strip_bytes, int64_t per_block,
                                                          int64_t b, int l2) {
    const char *pf = (const char *)(strip + strip_bytes + b * per_block);
    if (l2) {
        for (int64_t l = 0; l < per_block; l += 64) _mm_prefetch(pf + l, _MM_HINT_T1);
    } else {
        for (int64_t l = 0; l < per_block; l += 64) _mm_prefetch(pf + l, _MM_HINT_T0);
    }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define QG_SUFFIX avx2
#define QG_DOT2(a, x, b, y) _mm256_add_epi32(_mm256_madd_epi16(a, x), _mm256_madd_epi16(b, y))
#define QG_FVEC __m256
#define QG_FLANES 8
#define QG_FZERO() _mm256_setzero_ps()
#define QG_FLOAD(p) _mm256_loadu_ps(p)
#define QG_FFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define QG_FHSUM(v) hsum_avx2(v)
#include "qgemm_x86.h"
#include "qgemm_packed_avx2.h"
#undef QG_SUFFIX
#undef QG_DOT2
#undef QG_FVEC
#undef QG_FLANES
#undef QG_FZERO
#undef QG_FLOAD
#undef QG_FFMA
#undef QG_FHSUM
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define QG_SUFFIX avx512
#define QG_DOT2(a, x, b, y) _mm256_dpwssd_epi32(_mm256_madd_epi16(a, x), b, y)
#define QG_FVEC __m512
#define QG_FLANES 16
#define QG_FZERO() _mm512_setzero_ps()
#define QG_FLOAD(p) _mm512_loadu_ps(p)
#define QG_FFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define QG_FHSUM(v) _mm512_reduce_add_ps(v)
#include "qgemm_x86.h"
#include "qgemm_strip.h"
#pragma GCC pop_options

#if defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#define QG_HAVE_AMX 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c,amx-tile,amx-int8,amx-bf16")
#include "amx_tiles.h"
#include "qgemm_amx.h"
#include "qgemm_amx3.h"
#pragma GCC pop_options
#endif
#endif

/* ---- entry points ---- */

static int64_t qg_float_rows = 6;  /* measured: benchmarks/qgemm_rows.py */

void qg_set_float_rows(int64_t rows) { qg_float_rows = rows; }

int64_t qg_get_float_rows(void) { return qg_float_rows; }

/* A QG_PACKED product (the strip route's sums; qg_matmul checked the layout): the activations
 * quantized as the strip route quantizes them, then strips across the pool. With QG_INT8 the
 * portable kernel reads the int8 codes as int16 in input order, the AVX-512 one as bytes in its
 * own order (strip_quantize_rows8; its qx8 and isx after the int16 codes' room in the buffer), and
 * the AVX2 one as bytes in that order for Q4 and Q5 strips (maddubs_epi16), as int16 for Q8 and Q6. */
static int run_packed(QArgs *a, const void *x, int64_t x_stride) {
    const int64_t M = a->num_rows, K = a->num_cols;
    int16_t *qx;
    float *dx, *sx;
    char *buf = alloc_codes(M, K, &qx, &dx, &sx);
    if (buf == NULL) return QG_NO_MEMORY;
    CpuRangeFn fn = packed_range_scalar;
#ifdef QG_HAVE_X86
    if (cpu_allows(CPU_HAS_AVX512_VNNI)) {
        if (a->int8) {  /* the int16 codes' room holds the int8 codes and isx: K + 4 K / 32 < 2 K bytes */
            int8_t *qx8 = (int8_t *)qx;
            int32_t *isx = (int32_t *)(qx8 + M * K);
            strip_quantize_rows8(x, x_stride, M, K, a->dtype, a->packed != PACKED_Q8 && a->packed != PACKED_Q6, qx8, dx,
                                 sx, isx);
            if (a->packed == PACKED_Q6) {  /* the sums per group of 16 in their place (K + 4 K / 16 < 2 K bytes): */
                for (int64_t g = 0; g < M * K / 16; g++) {  /* packed_rows_q6 takes 32 x them off */
                    int32_t sum = 0;
                    for (int e = 0; e < 16; e++) sum += qx8[g * 16 + e];  /* a group's 16 bytes, in any order */
                    isx[g] = sum;
                }
            }
            a->qx8 = qx8; a->isx = isx;
        } else {
            strip_quantize_rows(x, x_stride, M, K, a->dtype, qx, dx, sx);
        }
        fn = packed_range_avx512;
    } else if (cpu_isa() >= CPU_ISA_AVX2) {
        if (a->int8 && (a->packed == PACKED_Q4 || a->packed == PACKED_Q5I8)) {  /* bytes, maddubs_epi16 */
            int8_t *qx8 = (int8_t *)qx;
            int32_t *isx = (int32_t *)(qx8 + M * K);
            packed_quantize_rows_avx2(x, x_stride, M, K, a->dtype, NULL, dx, sx, 1, qx8, isx);
            a->qx8 = qx8; a->isx = isx;
        } else {
            packed_quantize_rows_avx2(x, x_stride, M, K, a->dtype, qx, dx, sx, a->int8, NULL, NULL);
        }
        fn = packed_range_avx2;
    } else
#endif
        quantize_rows(x, x_stride, M, K, a->dtype, qx, dx, sx, 1, a->int8);
    a->qx = qx; a->dx = dx; a->sx = sx;
    int rc = cpu_parallel_for(fn, a, a->num_out / 16, M * a->num_out * K, 0);
    free(buf);
    return rc;
}

static int run(QArgs *a, const void *x, int64_t x_stride, int is_q4, int route) {
    const int64_t M = a->num_rows, K = a->num_cols, nb = K / QK_BLOCK;
    if (K <= 0 || K % (is_q4 ? 2 * QK_BLOCK : QK_BLOCK) != 0) return QG_BAD_LENGTH;
    if (M <= 0 || a->num_out <= 0) return QG_OK;
    if (a->packed) {
        if (route != QG_ROUTE_AMX) return run_packed(a, x, x_stride);
#ifdef QG_HAVE_AMX
        return run_amx3(a, x, x_stride);
#else
        return QG_BAD_LAYOUT;
#endif
    }
    if (route == QG_ROUTE_STRIP) {  /* below AVX-512 VNNI (the switch set lower): the int16 route, same integers */
        if (a->num_out % 16 != 0) return QG_BAD_LAYOUT;
#ifdef QG_HAVE_X86
        if (cpu_allows(CPU_HAS_AVX512_VNNI)) return run_strip(a, x, x_stride, is_q4);
#endif
        route = QG_ROUTE_INT;
    }
    if (route == QG_ROUTE_AMX) {
#ifdef QG_HAVE_AMX
        return run_amx(a, x, x_stride, is_q4);
#else
        return QG_BAD_LAYOUT;
#endif
    }
    CpuRangeFn fn = is_q4 ? q4_range_scalar : q8_range_scalar;
    int use_float = 0;
#ifdef QG_HAVE_X86
    const int wide = cpu_allows(CPU_HAS_AVX512_VNNI);  /* the avx512 variant needs VNNI */
    if (cpu_isa() >= CPU_ISA_AVX2) {
        fn = wide ? (is_q4 ? q4_range_avx512 : q8_range_avx512) : (is_q4 ? q4_range_avx2 : q8_range_avx2);
        use_float = route == QG_ROUTE_FLOAT ? 1 : route == QG_ROUTE_INT ? 0 : M >= qg_float_rows;
    }
#endif
    char *buf;
    if (use_float) {
        buf = (char *)malloc(sizeof(float) * (size_t)(M * K));
        if (buf == NULL) return QG_NO_MEMORY;
#ifdef QG_HAVE_X86
        if (wide) float_rows_in_decoded_order_avx512(x, x_stride, M, K, a->dtype, (float *)buf);
        else float_rows_in_decoded_order_avx2(x, x_stride, M, K, a->dtype, (float *)buf);
#endif
        a->xf = (const float *)buf;
    } else {
        int16_t *qx;
        float *dx, *sx;
        buf = alloc_codes(M, K, &qx, &dx, &sx);
        if (buf == NULL) return QG_NO_MEMORY;
        quantize_rows(x, x_stride, M, K, a->dtype, qx, dx, sx, 0, 0);
        a->qx = qx; a->dx = dx; a->sx = sx;
    }
    /* scratch per worker: the pass's weight scales and mins (QG_NR x nb each), its tiles' scales
     * (QG_NR x QG_TR x nb), then its rows' decoded codes (QG_NR x K int16) */
    const size_t floats = (size_t)(use_float ? QG_NR * K + 2 * nb : QG_NR * (QG_TR + 2) * nb + QG_NR * K / 2);
    int rc = cpu_parallel_for(fn, a, a->num_out, M * a->num_out * K, floats);
    free(buf);
    return rc;
}

int qg_matmul(int layout, const void *x, int64_t x_stride, int64_t num_rows, int64_t num_cols,
              const void *w, const void *scales, int64_t num_out, const float *bias,
              void *y, int64_t y_stride, int dtype) {
    const int format = layout & QG_FORMAT_MASK, half = layout_scales(layout);
    if ((layout & QG_SUPER) && (format != QG_Q4 || (layout & QG_HALF))) return QG_BAD_LAYOUT;
    if ((layout & QG_SUPER) && num_cols % (8 * QK_BLOCK) != 0) return QG_BAD_LENGTH;
    const int packed = (layout & QG_PACKED) != 0;  /* strips: the strip route only, outputs in 16s */
    if (packed && ((layout & QG_ROUTE_MASK & ~(QG_ROUTE_STRIP | QG_ROUTE_AMX)) || num_out % 16 != 0)) return QG_BAD_LAYOUT;
    const int int8 = (layout & QG_INT8) != 0;  /* packed layouts only */
    if (int8 && !packed) return QG_BAD_LAYOUT;
    if (format == QG_Q6) {  /* strips only */
        if (!packed || (layout & (QG_HALF | QG_SUPER | QG_NO_MINS))) return QG_BAD_LAYOUT;
        if (num_cols <= 0 || num_cols % (8 * QK_BLOCK) != 0) return QG_BAD_LENGTH;
        QArgs a = {NULL, NULL, NULL, NULL, num_rows, num_cols, (const uint8_t *)w, 0, 0, 0, NULL, NULL, bias, y,
                   y_stride, dtype, num_out, PACKED_Q6, int8, NULL, NULL};
        return run(&a, x, x_stride, 0, layout & QG_ROUTE_MASK);
    }
    if (format == QG_Q8) {
        QArgs a = {NULL, NULL, NULL, NULL, num_rows, num_cols, (const uint8_t *)w, half, 0, 0, (const int8_t *)w,
                   (const uint8_t *)scales, bias, y, y_stride, dtype, num_out, packed ? PACKED_Q8 : 0, int8,
                   NULL, NULL};
        return run(&a, x, x_stride, 0, layout & QG_ROUTE_MASK);
    }
    if (format != QG_Q4 && format != QG_Q5) return QG_BAD_LAYOUT;
    QArgs a = {NULL, NULL, NULL, NULL, num_rows, num_cols, (const uint8_t *)w, half, format == QG_Q5,
               !(layout & QG_NO_MINS), NULL, NULL, bias, y, y_stride, dtype, num_out,
               packed ? (format == QG_Q5 ? (int8 ? PACKED_Q5I8 : PACKED_Q5) : PACKED_Q4) : 0, int8, NULL, NULL};
    return run(&a, x, x_stride, 1, layout & QG_ROUTE_MASK);
}

/* dequantize_packed's values: from AVX2 up the strips across the pool, 16 values at a time. */
static int dequantize_packed_rows(int packed, const uint8_t *w, int half, int has_mins, int64_t first, int64_t count,
                                  int64_t num_cols, void *out, int out_dtype) {
#ifdef QG_HAVE_X86
    if (cpu_isa() >= CPU_ISA_AVX2 && count > 0) {
        PackedDqArgs args = {packed, half, has_mins, w, first, count, num_cols, out, out_dtype};
        const int64_t strips = (first + count - 1) / 16 - first / 16 + 1;
        return cpu_parallel_for(dequantize_packed_range_avx2, &args, strips, count * num_cols, 1) == CPU_OK
                   ? QG_OK : QG_NO_MEMORY;
    }
#endif
    dequantize_packed(packed, w, half, has_mins, first, count, num_cols, out, out_dtype);
    return QG_OK;
}

int qg_dequantize(int layout, const void *w, const void *scales, int64_t first, int64_t count,
                  int64_t num_cols, void *out, int out_dtype) {
    const int format = layout & QG_FORMAT_MASK, half = layout_scales(layout);
    if (format == QG_Q6) {
        if (!(layout & QG_PACKED) || (layout & (QG_HALF | QG_SUPER | QG_NO_MINS))) return QG_BAD_LAYOUT;
        if (num_cols <= 0 || num_cols % (8 * QK_BLOCK) != 0) return QG_BAD_LENGTH;
        return dequantize_packed_rows(PACKED_Q6, (const uint8_t *)w, 0, 0, first, count, num_cols, out, out_dtype);
    }
    if ((layout & QG_SUPER) && (format != QG_Q4 || (layout & QG_HALF))) return QG_BAD_LAYOUT;
    if ((layout & QG_SUPER) && num_cols % (8 * QK_BLOCK) != 0) return QG_BAD_LENGTH;
    if (num_cols <= 0 || num_cols % ((format == QG_Q8 ? 1 : 2) * QK_BLOCK) != 0) return QG_BAD_LENGTH;
    const int64_t nb = num_cols / QK_BLOCK;
    const int high = format == QG_Q5, has_mins = !(layout & QG_NO_MINS);
    if (layout & QG_PACKED) {
        const int q5 = (layout & QG_INT8) ? PACKED_Q5I8 : PACKED_Q5;
        return dequantize_packed_rows(format == QG_Q8 ? PACKED_Q8 : format == QG_Q5 ? q5 : PACKED_Q4,
                                      (const uint8_t *)w, half, has_mins, first, count, num_cols, out, out_dtype);
    }
#ifdef QG_HAVE_X86
    if (cpu_isa() >= CPU_ISA_AVX2) {  /* the same values, 16 at a time, rows across the pool */
        DqArgs args = {format, half, has_mins, (const uint8_t *)w, (const int8_t *)w, (const uint8_t *)scales,
                       first, num_cols, out, out_dtype};
        CpuRangeFn fn = cpu_allows(CPU_HAS_AVX512_VNNI) ? dequantize_range_avx512 : dequantize_range_avx2;
        return cpu_parallel_for(fn, &args, count, count * num_cols, 1) == CPU_OK ? QG_OK : QG_NO_MEMORY;
    }
#endif
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

int64_t qg_packed_strip_bytes(int layout, int64_t num_cols) {
    const int format = layout & QG_FORMAT_MASK, has_mins = !(layout & QG_NO_MINS);
    if (format == QG_Q6) {
        if ((layout & (QG_HALF | QG_SUPER | QG_NO_MINS)) || num_cols <= 0 || num_cols % (8 * QK_BLOCK) != 0) return 0;
        return packed_strip_bytes(PACKED_Q6, num_cols / QK_BLOCK, 0, 0);
    }
    if (format == QG_Q8) {
        if ((layout & QG_SUPER) || num_cols <= 0 || num_cols % QK_BLOCK != 0) return 0;
        return packed_strip_bytes(PACKED_Q8, num_cols / QK_BLOCK, layout_scales(layout), 0);
    }
    if ((format != QG_Q4 && format != QG_Q5) || num_cols <= 0 || num_cols % (2 * QK_BLOCK) != 0) return 0;
    if ((layout & QG_SUPER) && (format != QG_Q4 || (layout & QG_HALF) || num_cols % (8 * QK_BLOCK) != 0)) return 0;
    return packed_strip_bytes(format == QG_Q5 ? PACKED_Q5 : PACKED_Q4, num_cols / QK_BLOCK, layout_scales(layout),
                              has_mins);
}

/* A Q4 (or Q5: high) pair's 64 codes in element order: q45_code's values a word at a time (per element,
 * q45_code halved the packer's rate: Qwen's Q5_0 gate/up 274 against 563 M weights/s). */
static void pair_codes(const uint8_t *pair, int high, int8_t *out) {
    for (int i = 0; i < 16; i++) {
        const int word = pair[2 * i] | (pair[2 * i + 1] << 8);
        if (high) {  /* 5-bit two's complement fields: 48 + i, 32 + i, 16 + i, and i's sign bit */
            const int low = (pair[32 + i / 2] >> (4 * (i % 2))) & 0x0F, c0 = low | ((word & 1) << 4);
            out[i] = (int8_t)(c0 >= 16 ? c0 - 32 : c0);
            for (int q = 1; q < 4; q++) {
                const int field = (word >> (5 * q - 4)) & 0x1F;
                out[16 * q + i] = (int8_t)(field >= 16 ? field - 32 : field);
            }
        } else {
            for (int q = 0; q < 4; q++) out[16 * q + i] = (int8_t)((word >> (4 * q)) & 0x0F);
        }
    }
}

typedef struct {
    int packed, half, has_mins;
    const uint8_t *rows, *scales;
    int64_t num_cols, row_bytes, strip_bytes;
    uint8_t *out;
} PackArgs;

/* Strips s0 .. s1 - 1 of qg_pack (cpu_parallel_for's range function): each row's codes in element
 * order into a scratch row, then placed as packed_code reads them. */
static void pack_range(const void *p, int64_t s0, int64_t s1, float *scratch) {
    const PackArgs *a = (const PackArgs *)p;
    const int packed = a->packed, half = a->half, has_mins = a->has_mins, high = packed == PACKED_Q5;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK, scale_bytes = packed_scale_bytes(nb, half);
    int8_t *c = (int8_t *)scratch;  /* [K] */
    for (int64_t s = s0; s < s1; s++) {
        uint8_t *strip = a->out + s * a->strip_bytes;
        memset(strip, 0, (size_t)a->strip_bytes);
        for (int j = 0; j < 16; j++) {
            const int64_t n = s * 16 + j;
            const uint8_t *row = a->rows + n * a->row_bytes;
            if (packed == PACKED_Q8) {
                for (int64_t b = 0; b < nb; b++)
                    for (int e = 0; e < QK_BLOCK; e++) c[b * QK_BLOCK + e] = (int8_t)q8_code((const int8_t *)row + b * QK_BLOCK, e);
                for (int64_t b = 0; b < nb; b++)
                    for (int u = 0; u < 8; u++) {  /* bytes 0, 2, 1, 3: inputs 4u, 4u + 1, 4u + 2, 4u + 3 */
                        uint8_t *lane = strip + b * 512 + u * 64 + 4 * j;
                        const int8_t *in = c + b * QK_BLOCK + 4 * u;
                        lane[0] = (uint8_t)in[0]; lane[2] = (uint8_t)in[1]; lane[1] = (uint8_t)in[2]; lane[3] = (uint8_t)in[3];
                    }
            } else {
                const uint8_t *pairs = row + q4_codes_offset(nb, half, has_mins);
                for (int64_t p2 = 0; p2 < nb / 2; p2++) pair_codes(pairs + p2 * q4_pair_bytes(high), high, c + p2 * 64);
                const int64_t code_bytes = packed_code_bytes(packed);
                for (int64_t b = 0; b < nb; b++)
                    for (int v = 0; v < 4; v++) {
                        const int8_t *in = c + b * QK_BLOCK + 8 * v;
                        uint32_t lane = 0;
                        for (int t = 0; t < 4; t++)
                            lane |= (uint32_t)(in[2 * t] & 0x0F) << (4 * t) | (uint32_t)(in[2 * t + 1] & 0x0F) << (16 + 4 * t);
                        memcpy(strip + b * code_bytes + v * 64 + 4 * j, &lane, 4);
                        if (high) {  /* the sign masks: uint32 4v + t, bits 2j and 2j + 1 */
                            uint8_t *masks = strip + b * code_bytes + 256;
                            for (int t = 0; t < 4; t++) {
                                const int bits = (in[2 * t] < 0) | ((in[2 * t + 1] < 0) << 1);
                                masks[4 * (4 * v + t) + (2 * j) / 8] |= (uint8_t)(bits << ((2 * j) % 8));
                            }
                        }
                    }
            }
            for (int which = 0; which < 1 + packed_mins(packed, has_mins); which++) {
                const uint8_t *src = packed == PACKED_Q8 ? a->scales + n * nb * (half ? 2 : 4)
                                                         : row + which * q4_scale_bytes(nb, half);
                uint8_t *dst = strip + nb * packed_code_bytes(packed) + which * scale_bytes;
                if (half == QG_SCALES_SUPER) {
                    for (int64_t g = 0; g < nb / 8; g++) {
                        memcpy(dst + g * 160 + 2 * j, src + g * 10, 2);
                        for (int k = 0; k < 8; k++) dst[g * 160 + 32 + k * 16 + j] = src[g * 10 + 2 + k];
                    }
                } else {
                    const int size = half ? 2 : 4;
                    for (int64_t b = 0; b < nb; b++) memcpy(dst + (b * 16 + j) * size, src + b * size, (size_t)size);
                }
            }
        }
    }
}

int qg_pack(int layout, const void *rows, const void *scales, int64_t num_rows, int64_t num_cols, uint8_t *out) {
    const int format = layout & QG_FORMAT_MASK, half = layout_scales(layout), has_mins = !(layout & QG_NO_MINS);
    if (format == QG_Q6) return QG_BAD_LAYOUT;  /* no row layout: qg_q6k_pack */
    const int packed = format == QG_Q8 ? PACKED_Q8 : format == QG_Q5 ? PACKED_Q5 : PACKED_Q4;
    const int64_t strip_bytes = qg_packed_strip_bytes(layout & ~QG_PACKED, num_cols);
    if (strip_bytes == 0) {
        const int64_t multiple = (packed == PACKED_Q8 ? 1 : 2) * QK_BLOCK;
        return num_cols > 0 && num_cols % multiple == 0 ? QG_BAD_LAYOUT : QG_BAD_LENGTH;
    }
    if (num_rows % 16 != 0) return QG_BAD_LAYOUT;
    const int64_t nb = num_cols / QK_BLOCK;
    const int64_t row_bytes = packed == PACKED_Q8 ? num_cols : q4_row_bytes(nb, half, packed == PACKED_Q5, has_mins);
    PackArgs args = {packed, half, has_mins, (const uint8_t *)rows, (const uint8_t *)scales, num_cols, row_bytes,
                     strip_bytes, out};
    /* scratch: a row's codes as int8, in floats */
    const int rc = cpu_parallel_for(pack_range, &args, num_rows / 16, num_rows * num_cols, (size_t)(num_cols / 4 + 1));
    return rc == CPU_OK ? QG_OK : QG_NO_MEMORY;
}

int qg_pack_int8(int layout, uint8_t *strips, int64_t num_rows, int64_t num_cols) {
    if (!(layout & QG_PACKED) || (layout & QG_INT8) || num_rows % 16 != 0) return QG_BAD_LAYOUT;
    if ((layout & QG_FORMAT_MASK) != QG_Q5) return QG_OK;  /* Q4, Q6 and Q8 strips serve both */
    const int64_t strip_bytes = qg_packed_strip_bytes(layout, num_cols), nb = num_cols / QK_BLOCK;
    if (strip_bytes == 0) return QG_BAD_LENGTH;
    for (int64_t s = 0; s < num_rows / 16; s++) {
        uint8_t *strip = strips + s * strip_bytes;
        for (int64_t b = 0; b < nb; b++) {
            uint8_t plus[64] = {0};  /* the new masks: bit set where the code is not negative */
            for (int j = 0; j < 16; j++) {
                for (int e = 0; e < QK_BLOCK; e++) {
                    int bit, bit8;
                    const int64_t at = packed_sign_at(b, j, e, &bit), at8 = packed_sign8_at(b, j, e, &bit8);
                    if (!((strip[at] >> bit) & 1)) plus[at8 - b * 320 - 256] |= (uint8_t)(1u << bit8);
                }
            }
            memcpy(strip + b * 320 + 256, plus, sizeof plus);
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

/* Strips s0 .. s1 - 1 of qg_q6k_pack: per row its codes (0..63, ggml's element order) into scratch, then
 * placed as q6_packed_block reads them; the scales and d copied. */
static void q6k_pack_range(const void *p, int64_t s0, int64_t s1, float *scratch) {
    const PackArgs *a = (const PackArgs *)p;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK, nsb = K / 256;
    uint8_t *q = (uint8_t *)scratch;  /* [K] */
    for (int64_t s = s0; s < s1; s++) {
        uint8_t *strip = a->out + s * a->strip_bytes;
        memset(strip, 0, (size_t)a->strip_bytes);
        for (int j = 0; j < 16; j++) {
            const uint8_t *row = a->rows + (s * 16 + j) * a->row_bytes;
            for (int64_t sb = 0; sb < nsb; sb++) {
                const uint8_t *block = row + sb * 210, *ql = block, *qh = block + 128;
                uint8_t *out = q + sb * 256;
                for (int half = 0; half < 2; half++) {  /* ggml's dequantize_row_q6_K order */
                    const uint8_t *l4 = ql + 64 * half, *h2 = qh + 32 * half;
                    uint8_t *o = out + 128 * half;
                    for (int l = 0; l < 32; l++) {
                        o[l] = (uint8_t)((l4[l] & 0x0F) | ((h2[l] & 3) << 4));
                        o[l + 32] = (uint8_t)((l4[l + 32] & 0x0F) | (((h2[l] >> 2) & 3) << 4));
                        o[l + 64] = (uint8_t)((l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4));
                        o[l + 96] = (uint8_t)((l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4));
                    }
                }
                uint8_t *sc = strip + nb * 384;
                for (int g = 0; g < 16; g++) sc[(sb * 16 + g) * 16 + j] = block[192 + g];
                memcpy(sc + 2 * nb * 16 + sb * 32 + 2 * j, block + 208, 2);
            }
            for (int64_t b = 0; b < nb; b++) {
                uint32_t words[6] = {0};
                for (int e = 0; e < QK_BLOCK; e++) {  /* q6_packed_block's places */
                    const uint32_t c = q[b * QK_BLOCK + e] ^ 32u;  /* q - 32 as 6-bit two's complement */
                    const int p = e / 2, h = e % 2;
                    if (p < 12) {
                        words[p / 2] |= c << (16 * h + 6 * (p % 2));
                    } else {
                        const int m = p - 12;
                        words[m] |= (c & 0x0F) << (16 * h + 12);
                        words[4 + m / 2] |= (c >> 4) << (16 * h + 12 + 2 * (m % 2));
                    }
                }
                for (int u = 0; u < 6; u++) memcpy(strip + b * 384 + u * 64 + 4 * j, &words[u], 4);
            }
        }
    }
}

int qg_q6k_pack(const uint8_t *raw, int64_t num_rows, int64_t num_cols, uint8_t *out) {
    if (num_cols <= 0 || num_cols % 256 != 0) return QG_BAD_LENGTH;
    if (num_rows % 16 != 0) return QG_BAD_LAYOUT;
    const int64_t strip_bytes = packed_strip_bytes(PACKED_Q6, num_cols / QK_BLOCK, 0, 0);
    PackArgs args = {PACKED_Q6, 0, 0, raw, NULL, num_cols, num_cols / 256 * 210, strip_bytes, out};
    const int rc = cpu_parallel_for(q6k_pack_range, &args, num_rows / 16, num_rows * num_cols, (size_t)(num_cols / 4 + 1));
    return rc == CPU_OK ? QG_OK : QG_NO_MEMORY;
}
