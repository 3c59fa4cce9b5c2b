/* The x86 kernels of qgemm.c, included once per variant with QG_SUFFIX, QG_DOT2 and the
 * QG_F* float-vector macros set, inside a `#pragma GCC target` region (qgemm.c): avx2 (AVX2 +
 * FMA: madd_epi16 dot products, 8-lane FMAs) and avx512 (AVX-512 VNNI: vpdpwssd dot products,
 * 16-lane FMAs). Both decode the weights with the same 256-bit shifts and masks. */

static inline float QG_FN(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The weight bytes QG_PREFETCH_BYTES ahead of this pass (one pass's worth, not beyond
 * `end`): a pass reads only QG_NR short rows (576 bytes each for SmolLM2's head), too little
 * for the hardware prefetcher to run ahead of. On SmolLM2's int8 head at batch 1 this took
 * the product from ~5.0 to ~2.0-3.3 ms on a Xeon (the distance: best of 2-24 passes tried),
 * into L1; into L2 (qg_prefetch_level) on AMD, where that made a decode step ~1.35x faster. */
#define QG_PREFETCH_BYTES 24576

/* Those lines, `per_step` of them at each step of the pass's block loop (QG_FN(prefetch_step));
 * with steps = 1 one call issues them all at the pass's start (the burst, what batched passes
 * do). A burst of ~50 prefetches fills the core's miss buffers and stalls the pass behind them
 * (on a Zen 4, 14% of a one-row Q8 product's samples sat on one prefetcht1); spread over the
 * decode steps' block loops, they wait beside the arithmetic. */
typedef struct {
    const uint8_t *p, *end;
    int per_step, l2;
} QG_FN(Prefetch);

static inline QG_FN(Prefetch) QG_FN(prefetch_spread)(const uint8_t *at, int64_t bytes, const uint8_t *end,
                                                     int64_t steps) {
    QG_FN(Prefetch) pf;
    pf.p = at + QG_PREFETCH_BYTES;
    pf.end = pf.p + bytes < end ? pf.p + bytes : end;
    const int64_t lines = pf.end > pf.p ? (pf.end - pf.p + 63) / 64 : 0;
    pf.per_step = (int)((lines + steps - 1) / (steps > 0 ? steps : 1));
    pf.l2 = qg_prefetch_level() == QG_PREFETCH_L2;
    return pf;
}

QG_ALWAYS_INLINE static inline void QG_FN(prefetch_step)(QG_FN(Prefetch) *pf) {
    if (pf == NULL) return;
    for (int j = 0; j < pf->per_step && pf->p < pf->end; j++, pf->p += 64) {
        if (pf->l2) _mm_prefetch((const char *)pf->p, _MM_HINT_T1);
        else _mm_prefetch((const char *)pf->p, _MM_HINT_T0);
    }
}

/* Both kernels take QG_NR weight rows x up to QG_TR activation rows per pass: QG_NR * QG_TR
 * independent accumulators (one FMA chain each, so a single activation row still keeps the
 * FMA units busy), the activation block loaded once per pass and shared by the weight rows. */
#define QG_NR 4
#define QG_TR 2

/* One pass: weight rows n .. n + nr - 1 (pointers in d, m, codes) x activation rows
 * i0 .. i0 + TR - 1. TR is a constant at each call site, so the loops over it unroll. */
/* 8 scales or mins of a Q4 row from block b (fp16 or float32). */
static inline __m256 QG_FN(q4_load8)(const uint8_t *p, int64_t b, int half) {
    if (half == QG_SCALES_SUPER) {  /* b % 8 == 0: one group, f * q[0..7] */
        const uint8_t *group = p + b / 8 * 10;
        uint16_t h;
        memcpy(&h, group, 2);
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(group + 2))));
        return _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(h)), q);
    }
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + b * 2)));
    return _mm256_loadu_ps((const float *)p + b);
}

/* block_scale with the F16C conversion. */
static inline float QG_FN(block_scale_f16c)(const uint8_t *row, int64_t nb, int64_t b,
                                                                          int half, int which) {
    uint16_t h;
    if (half == QG_SCALES_F16) {
        memcpy(&h, row + (which * nb + b) * 2, 2);
        return _cvtsh_ss(h);
    }
    if (half == QG_SCALES_SUPER) {
        const uint8_t *group = row + which * q4_scale_bytes(nb, half) + b / 8 * 10;
        memcpy(&h, group, 2);
        return _cvtsh_ss(h) * (float)group[2 + b % 8];
    }
    return block_scale(row, nb, b, half, which);
}

/* A Q4 (or Q5: HIGH) pair's 64 codes as four runs of 16 int16 (elements 0-15, 16-31, 32-47, 48-63). */
QG_ALWAYS_INLINE static inline void QG_FN(q45_decode_pair)(
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

/* A pass's QG_NR Q4 weight rows: their blocks' scales into wd [QG_NR][nb] and (with mins) their
 * mins into wm [QG_NR][nb] as float32, once per pass (exact: fp16 values, or a fp16 group scale
 * times a 6-bit integer). */
static void QG_FN(q4_pass_scales)(const QArgs *a, const uint8_t *const *rows, float *wd, float *wm) {
    const int64_t nb = a->num_cols / QK_BLOCK;
    const int half = a->half;
    for (int k = 0; k < QG_NR; k++) {
        const uint8_t *d = rows[k], *m = rows[k] + q4_scale_bytes(nb, half);
        int64_t b = 0;
        for (; b + 8 <= nb; b += 8) {
            _mm256_storeu_ps(wd + k * nb + b, QG_FN(q4_load8)(d, b, half));
            if (a->has_mins) _mm256_storeu_ps(wm + k * nb + b, QG_FN(q4_load8)(m, b, half));
        }
        for (; b < nb; b++) { /* the tail (K = 896: 4 of 28 blocks) with F16C, not the portable conversion */
            wd[k * nb + b] = QG_FN(block_scale_f16c)(rows[k], nb, b, half, 0);
            if (a->has_mins) wm[k * nb + b] = QG_FN(block_scale_f16c)(rows[k], nb, b, half, 1);
        }
    }
}

/* The min term sum_b m_b * sx_b of a weight row (its mins wm [nb]) and an activation row (its
 * block sums sx [nb]), in the one order every Q4 pass uses: 8 lanes over the 8-block groups,
 * their sum, then the tail's FMAs. */
QG_ALWAYS_INLINE static inline float QG_FN(min_term)(const float *wm, const float *sx, int64_t nb) {
    __m256 mv = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) mv = _mm256_fmadd_ps(_mm256_loadu_ps(wm + b), _mm256_loadu_ps(sx + b), mv);
    float mm = QG_FN(hsum)(mv);
    for (; b < nb; b++) mm = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(wm[b]), _mm_set_ss(sx[b]), _mm_set_ss(mm)));
    return mm;
}

/* Activation row i against one Q4 weight row read straight from its bytes (a pass without
 * q4_pass_scales: one or two activation rows): its blocks' scales d * dx into sc [nb] and
 * the min term, with min_term's operations on the same values. */
QG_ALWAYS_INLINE static inline float QG_FN(q4_row_scales)(const QArgs *a, const uint8_t *row, int64_t i, float *sc) {
    const int64_t nb = a->num_cols / QK_BLOCK;
    const int half = a->half;
    const float *dx = a->dx + i * nb, *sx = a->sx + i * nb;
    const uint8_t *d = row, *m = row + q4_scale_bytes(nb, half);
    __m256 mv = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
        _mm256_storeu_ps(sc + b, _mm256_mul_ps(QG_FN(q4_load8)(d, b, half), _mm256_loadu_ps(dx + b)));
        if (a->has_mins) mv = _mm256_fmadd_ps(QG_FN(q4_load8)(m, b, half), _mm256_loadu_ps(sx + b), mv);
    }
    float mm = QG_FN(hsum)(mv);
    for (; b < nb; b++) { /* the tail (K = 896: 4 of 28 blocks) with F16C, not the portable conversion */
        sc[b] = QG_FN(block_scale_f16c)(row, nb, b, half, 0) * dx[b];
        if (a->has_mins)
            mm = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(QG_FN(block_scale_f16c)(row, nb, b, half, 1)),
                                            _mm_set_ss(sx[b]), _mm_set_ss(mm)));
    }
    return a->has_mins ? mm : 0.0f;
}

/* One pass: QG_NR weight rows x TR activation rows. The weights come decoded from `decoded`
 * ([QG_NR][K] int16, filled once per pass when there are more than QG_TR activation rows, so
 * the decode is not repeated for every pair of them) or, when it is NULL, straight from the
 * codes. */
QG_ALWAYS_INLINE static inline void QG_FN(q4_tile)(
        const QArgs *a, int64_t n, int nr, int64_t i0, const int TR, const int HIGH, const uint8_t *const *rows,
        const float *wd, const float *wm, float *scales, const int16_t *decoded, QG_FN(Prefetch) *pf) {
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
        const float *dx = a->dx + (i0 + r) * nb;
        for (int k = 0; k < QG_NR; k++) {
            float *sc = scales + (k * QG_TR + r) * nb;
            if (wd == NULL) {
                macc[k][r] = QG_FN(q4_row_scales)(a, rows[k], i0 + r, sc);
            } else {
                int64_t b = 0;
                for (; b + 8 <= nb; b += 8)
                    _mm256_storeu_ps(sc + b, _mm256_mul_ps(_mm256_loadu_ps(wd + k * nb + b), _mm256_loadu_ps(dx + b)));
                for (; b < nb; b++) sc[b] = wd[k * nb + b] * dx[b];
                macc[k][r] = a->has_mins ? QG_FN(min_term)(wm + k * nb, a->sx + (i0 + r) * nb, nb) : 0.0f;
            }
            acc[k][r] = _mm256_setzero_ps();
        }
    }
    for (int64_t b = 0; b < nb; b += 2) {
        QG_FN(prefetch_step)(pf);
        for (int k = 0; k < QG_NR; k++) {
            __m256i w[4];
            if (decoded != NULL) {
                const int16_t *dw = decoded + k * K + b * QK_BLOCK;
                for (int j = 0; j < 4; j++) w[j] = _mm256_loadu_si256((const __m256i *)(dw + 16 * j));
            } else {
                QG_FN(q45_decode_pair)(codes[k] + (b / 2) * pair_bytes, HIGH, w);
            }
            const __m256i w00 = w[0], w01 = w[1], w10 = w[2], w11 = w[3];
            for (int r = 0; r < TR; r++) {
                const int16_t *x = xrow[r] + b * QK_BLOCK;
                const float *sc = scales + (k * QG_TR + r) * nb + b;
                const __m256i p0 = QG_DOT2(w00, QG_LOAD16(x), w01, QG_LOAD16(x + 16));
                const __m256i p1 = QG_DOT2(w10, QG_LOAD16(x + 32), w11, QG_LOAD16(x + 48));
                acc[k][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc), _mm256_cvtepi32_ps(p0), acc[k][r]);
                acc[k][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + 1), _mm256_cvtepi32_ps(p1), acc[k][r]);
            }
        }
    }
    for (int k = 0; k < nr; k++)
        for (int r = 0; r < TR; r++) {
            const float bias = a->bias ? a->bias[n + k] : 0.0f;
            store_out(a, i0 + r, n + k, QG_FN(hsum)(acc[k][r]) + macc[k][r] + bias);
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

QG_ALWAYS_INLINE static inline void QG_FN(float_tile)(
        const QArgs *a, int64_t n, int nr, int64_t i0, const int TR, const float *w) {
    const int64_t K = a->num_cols;
    const float *x[QG_FR];
    QG_FVEC acc[QG_NR][QG_FR];
    for (int r = 0; r < TR; r++) x[r] = a->xf + (i0 + r) * K;
    for (int k = 0; k < QG_NR; k++)
        for (int r = 0; r < TR; r++) acc[k][r] = QG_FZERO();
    for (int64_t j = 0; j < K; j += QG_FLANES) {
        QG_FVEC xv[QG_FR];
        for (int r = 0; r < TR; r++) xv[r] = QG_FLOAD(x[r] + j);
        for (int k = 0; k < QG_NR; k++) {
            const QG_FVEC wv = QG_FLOAD(w + k * K + j);
            for (int r = 0; r < TR; r++) acc[k][r] = QG_FFMA(wv, xv[r], acc[k][r]);
        }
    }
    for (int k = 0; k < nr; k++)
        for (int r = 0; r < TR; r++) {
            const float bias = a->bias ? a->bias[n + k] : 0.0f;
            store_out(a, i0 + r, n + k, QG_FHSUM(acc[k][r]) + bias);
        }
}

/* Every activation row against the QG_NR weight rows decoded at w ([QG_NR][K] float32). */
static void QG_FN(float_rows)(const QArgs *a, int64_t n, int nr,
                                                                    const float *w) {
    int64_t i0 = 0;
    /* tiles of 3 rows, the last 4 as 2 + 2 (a 1-row tile runs 4 FMA chains for 5 loads) */
    for (; a->num_rows - i0 == 3 || a->num_rows - i0 > 4; i0 += QG_FR) QG_FN(float_tile)(a, n, nr, i0, QG_FR, w);
    for (; a->num_rows - i0 >= 2; i0 += 2) QG_FN(float_tile)(a, n, nr, i0, 2, w);
    if (i0 < a->num_rows) QG_FN(float_tile)(a, n, nr, i0, 1, w);
}

/* 16 int16 codes -> two float32 vectors d * c + m at out, in the float path's order: each run
 * of 16 elements is stored as elements 0-3, 8-11, then 4-7, 12-15 (what unpacking the words
 * into the high halves of 32-bit lanes gives, with no lane crossing: the lanes hold c * 65536,
 * so d arrives scaled by 2^-16); the activations are laid out in the same order (run()), and
 * a dot product does not depend on the order of its terms' pairs. */
#define QG_UNPACK_SCALE (1.0f / 65536.0f)

QG_ALWAYS_INLINE static inline void QG_FN(codes16_to_float)(
        __m256i c, __m256 d, __m256 m, float *out) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_unpacklo_epi16(zero, c));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_unpackhi_epi16(zero, c));
    _mm256_storeu_ps(out, _mm256_fmadd_ps(lo, d, m));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(hi, d, m));
}

/* A row's nb scales (or mins) as float32 times `mul` into out (fp16 or float32 source). */
QG_ALWAYS_INLINE static inline void QG_FN(scales_to_float)(const uint8_t *p, int64_t nb, int half,
                                                                    float mul, float *out) {
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) _mm256_storeu_ps(out + b, _mm256_mul_ps(QG_FN(q4_load8)(p, b, half), _mm256_set1_ps(mul)));
    for (; b < nb; b++) {
        float v;
        if (half == QG_SCALES_SUPER) {
            v = block_scale(p, nb, b, half, 0);
        } else if (half) {
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
static void QG_FN(q45_row_to_float)(const QArgs *a, const uint8_t *row,
                                                                     float *sm, float *out) {
    const int64_t K = a->num_cols, nb = K / QK_BLOCK, pair_bytes = q4_pair_bytes(a->high);
    const uint8_t *codes = row + q4_codes_offset(nb, a->half, a->has_mins);
    QG_FN(scales_to_float)(row, nb, a->half, QG_UNPACK_SCALE, sm);
    if (a->has_mins) QG_FN(scales_to_float)(row + q4_scale_bytes(nb, a->half), nb, a->half, 1.0f, sm + nb);
    for (int64_t p = 0; p < nb / 2; p++) {
        __m256i w[4];
        if (a->high) QG_FN(q45_decode_pair)(codes + p * pair_bytes, 1, w);
        else QG_FN(q45_decode_pair)(codes + p * pair_bytes, 0, w);
        for (int half_pair = 0; half_pair < 2; half_pair++) {
            const int64_t b = 2 * p + half_pair;
            const __m256 d = _mm256_broadcast_ss(sm + b);
            const __m256 m = a->has_mins ? _mm256_broadcast_ss(sm + nb + b) : _mm256_setzero_ps();
            QG_FN(codes16_to_float)(w[2 * half_pair], d, m, out + b * QK_BLOCK);
            QG_FN(codes16_to_float)(w[2 * half_pair + 1], d, m, out + b * QK_BLOCK + 16);
        }
    }
}

/* A Q8 row -> float32 out [K] in the float path's order: w = q * scale per block. sm: nb
 * floats of scratch for the row's scales. */
static void QG_FN(q8_row_to_float)(const QArgs *a, const int8_t *row,
                                                                    const uint8_t *scales, float *sm, float *out) {
    const int64_t nb = a->num_cols / QK_BLOCK;
    const __m256 zero = _mm256_setzero_ps();
    QG_FN(scales_to_float)(scales, nb, a->half, QG_UNPACK_SCALE, sm);
    for (int64_t b = 0; b < nb; b++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(row + b * QK_BLOCK));
        const __m256 d = _mm256_broadcast_ss(sm + b);
        QG_FN(codes16_to_float)(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), d, zero, out + b * QK_BLOCK);
        QG_FN(codes16_to_float)(_mm256_srai_epi16(v, 8), d, zero, out + b * QK_BLOCK + 16);
    }
}

#if QG_FLANES == 16
/* Rows i0 .. i0 + 2 * RP - 1 against QG_NR weight rows decoded to int16 (`decoded`, [QG_NR][K]
 * in element order; wd [QG_NR][nb] their blocks' scales as float32), 512 bits wide: a vector
 * holds two activation rows' 8 lanes (row r in lanes 0-7, r + 1 in 8-15), so one madd +
 * vpdpwssd, one conversion and one FMA serve both. Lane by lane these are q4_tile's and
 * q8_tile's operations on the same integers (the int32 partial sums of a block, its scale
 * d * dx rounded once, one FMA per block in block order, the 8 lanes summed by hsum, then the
 * min term and the bias), so every row gets the bits of the 256-bit passes: 1.6x fewer
 * arithmetic instructions per multiply-add for the activation rows of batched products. */
QG_ALWAYS_INLINE static inline void QG_FN(wide_tile)(
        const QArgs *a, int64_t n, int nr, int64_t i0, const int RP, const int16_t *decoded,
        const float *wd, const float macc[QG_NR][4], const int MINS) {
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    __m512 acc[QG_NR][2];
    for (int k = 0; k < QG_NR; k++)
        for (int rp = 0; rp < RP; rp++) acc[k][rp] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i x0[2], x1[2];
        __m512 dxv[2];
        for (int rp = 0; rp < RP; rp++) {
            const int64_t i = i0 + 2 * rp;
            const int16_t *xa = a->qx + i * K + b * QK_BLOCK, *xb = xa + K;
            x0[rp] = _mm512_inserti64x4(_mm512_castsi256_si512(QG_LOAD16(xa)), QG_LOAD16(xb), 1);
            x1[rp] = _mm512_inserti64x4(_mm512_castsi256_si512(QG_LOAD16(xa + 16)), QG_LOAD16(xb + 16), 1);
            dxv[rp] = _mm512_insertf32x8(_mm512_set1_ps(a->dx[i * nb + b]), _mm256_set1_ps(a->dx[(i + 1) * nb + b]), 1);
        }
        for (int k = 0; k < QG_NR; k++) {
            const int16_t *w = decoded + k * K + b * QK_BLOCK;
            const __m512i w0 = _mm512_broadcast_i64x4(QG_LOAD16(w)), w1 = _mm512_broadcast_i64x4(QG_LOAD16(w + 16));
            const __m512 d = _mm512_set1_ps(wd[k * nb + b]);
            for (int rp = 0; rp < RP; rp++) {
                const __m512i dot = _mm512_dpwssd_epi32(_mm512_madd_epi16(w0, x0[rp]), w1, x1[rp]);
                acc[k][rp] = _mm512_fmadd_ps(_mm512_mul_ps(d, dxv[rp]), _mm512_cvtepi32_ps(dot), acc[k][rp]);
            }
        }
    }
    for (int k = 0; k < nr; k++)
        for (int rp = 0; rp < RP; rp++) {
            const float bias = a->bias ? a->bias[n + k] : 0.0f;
            const float lo = QG_FN(hsum)(_mm512_castps512_ps256(acc[k][rp]));
            const float hi = QG_FN(hsum)(_mm512_extractf32x8_ps(acc[k][rp], 1));
            if (MINS) {
                store_out(a, i0 + 2 * rp, n + k, lo + macc[k][2 * rp] + bias);
                store_out(a, i0 + 2 * rp + 1, n + k, hi + macc[k][2 * rp + 1] + bias);
            } else {
                store_out(a, i0 + 2 * rp, n + k, lo + bias);
                store_out(a, i0 + 2 * rp + 1, n + k, hi + bias);
            }
        }
}

/* Rows i0 .. i1 - 1 through wide_tile, 4 at a time (then 2); returns the first row left (none
 * or one). wd, wm: the pass's weight scales and (Q4 with mins) mins, q4_pass_scales'. */
static int64_t QG_FN(wide_rows)(const QArgs *a, int64_t n, int nr, int64_t i0, int64_t i1,
                                const int16_t *decoded, const float *wd, const float *wm, int is_q4) {
    const int64_t nb = a->num_cols / QK_BLOCK;
    float macc[QG_NR][4] = {{0.0f}};
    for (; i0 + 2 <= i1; ) {
        const int rp = i0 + 4 <= i1 ? 2 : 1;
        if (is_q4) {
            for (int k = 0; k < QG_NR; k++)
                for (int r = 0; r < 2 * rp; r++)
                    macc[k][r] = a->has_mins ? QG_FN(min_term)(wm + k * nb, a->sx + (i0 + r) * nb, nb) : 0.0f;
            if (rp == 2) QG_FN(wide_tile)(a, n, nr, i0, 2, decoded, wd, macc, 1);
            else QG_FN(wide_tile)(a, n, nr, i0, 1, decoded, wd, macc, 1);
        } else {
            if (rp == 2) QG_FN(wide_tile)(a, n, nr, i0, 2, decoded, wd, macc, 0);
            else QG_FN(wide_tile)(a, n, nr, i0, 1, decoded, wd, macc, 0);
        }
        i0 += 2 * rp;
    }
    return i0;
}
#endif

static void QG_FN(q4_range)(const void *p, int64_t n0, int64_t n1,
                                                                  float *scratch) {
    const QArgs *a = (const QArgs *)p;
    const int64_t row_bytes = q4_row_bytes(a->num_cols / QK_BLOCK, a->half, a->high, a->has_mins);
    for (int64_t n = n0; n < n1; n += QG_NR) {
        const int nr = n1 - n < QG_NR ? (int)(n1 - n) : QG_NR;
        const uint8_t *rows[QG_NR];
        for (int k = 0; k < QG_NR; k++) rows[k] = a->blocks + (n + (k < nr ? k : 0)) * row_bytes;
        /* decode steps (up to QG_INPLACE_ROWS rows, the codes read in place): over the pass's block
         * pairs. Batched passes keep the burst: spreading it over their decode of the rows measured
         * no faster at 4 and 16 rows. */
        const int inplace = a->num_rows <= QG_INPLACE_ROWS;
        const int spread = qg_spread_on() && a->xf == NULL && inplace;
        QG_FN(Prefetch) pf = QG_FN(prefetch_spread)(a->blocks + n * row_bytes, QG_NR * row_bytes, a->blocks + n1 * row_bytes,
                                                    spread ? a->num_cols / (2 * QK_BLOCK) : 1);
        if (!spread) QG_FN(prefetch_step)(&pf);  /* the burst */
        if (a->xf != NULL) {
            float *sm = scratch + QG_NR * a->num_cols;
            for (int k = 0; k < QG_NR; k++) QG_FN(q45_row_to_float)(a, rows[k], sm, scratch + k * a->num_cols);
            QG_FN(float_rows)(a, n, nr, scratch);
            continue;
        }
        int64_t i0 = 0;
        int16_t *decoded = NULL;
        const int64_t nb = a->num_cols / QK_BLOCK;
        float *wd = NULL, *wm = scratch + QG_NR * nb, *sc = wm + QG_NR * nb;  /* run()'s scratch layout */
        if (!inplace) { /* decode the pass's rows once for all the activation rows */
            wd = scratch;
            QG_FN(q4_pass_scales)(a, rows, wd, wm);
            const int64_t K = a->num_cols, pair_bytes = q4_pair_bytes(a->high);
            decoded = (int16_t *)(scratch + QG_NR * (QG_TR + 2) * nb);
            for (int k = 0; k < QG_NR; k++) {
                const uint8_t *codes = rows[k] + q4_codes_offset(K / QK_BLOCK, a->half, a->has_mins);
                for (int64_t p = 0; p < K / (2 * QK_BLOCK); p++) {
                    __m256i w[4];
                    if (a->high) QG_FN(q45_decode_pair)(codes + p * pair_bytes, 1, w);
                    else QG_FN(q45_decode_pair)(codes + p * pair_bytes, 0, w);
                    for (int j = 0; j < 4; j++)
                        _mm256_storeu_si256((__m256i *)(decoded + k * K + p * 2 * QK_BLOCK + 16 * j), w[j]);
                }
            }
        }
        if (decoded == NULL) {  /* decode steps (few rows): the codes read in place, a pair of rows per tile */
            QG_FN(Prefetch) *pfp = spread ? &pf : NULL;
            for (; i0 < a->num_rows; i0 += QG_TR, pfp = NULL) {  /* the first tile issues the prefetch */
                const int two = i0 + QG_TR <= a->num_rows;
                if (a->high) {
                    if (two) QG_FN(q4_tile)(a, n, nr, i0, QG_TR, 1, rows, NULL, NULL, sc, NULL, pfp);
                    else QG_FN(q4_tile)(a, n, nr, i0, 1, 1, rows, NULL, NULL, sc, NULL, pfp);
                } else {
                    if (two) QG_FN(q4_tile)(a, n, nr, i0, QG_TR, 0, rows, NULL, NULL, sc, NULL, pfp);
                    else QG_FN(q4_tile)(a, n, nr, i0, 1, 0, rows, NULL, NULL, sc, NULL, pfp);
                }
            }
            continue;
        }
#if QG_FLANES == 16
        i0 = QG_FN(wide_rows)(a, n, nr, 0, a->num_rows, decoded, wd, wm, 1);
#endif
        if (a->high) {
            for (; i0 + QG_TR <= a->num_rows; i0 += QG_TR) QG_FN(q4_tile)(a, n, nr, i0, QG_TR, 1, rows, wd, wm, sc, decoded, NULL);
            if (i0 < a->num_rows) QG_FN(q4_tile)(a, n, nr, i0, 1, 1, rows, wd, wm, sc, decoded, NULL);
        } else {
            for (; i0 + QG_TR <= a->num_rows; i0 += QG_TR) QG_FN(q4_tile)(a, n, nr, i0, QG_TR, 0, rows, wd, wm, sc, decoded, NULL);
            if (i0 < a->num_rows) QG_FN(q4_tile)(a, n, nr, i0, 1, 0, rows, wd, wm, sc, decoded, NULL);
        }
    }
}

QG_ALWAYS_INLINE static inline void QG_FN(q8_tile)(
        const QArgs *a, int64_t n, int nr, int64_t i0, const int TR, const int8_t *const *rows,
        const uint8_t *const *wscales, float *scales, QG_FN(Prefetch) *pf) {
    const int64_t nb = a->num_cols / QK_BLOCK;
    __m256 acc[QG_NR][QG_TR];
    for (int r = 0; r < TR; r++) {
        const float *dx = a->dx + (i0 + r) * nb;
        for (int k = 0; k < QG_NR; k++) {
            float *sc = scales + (k * QG_TR + r) * nb;
            int64_t b = 0;
            for (; b + 8 <= nb; b += 8)
                _mm256_storeu_ps(sc + b, _mm256_mul_ps(QG_FN(q4_load8)(wscales[k], b, a->half), _mm256_loadu_ps(dx + b)));
            for (; b < nb; b++) sc[b] = QG_FN(block_scale_f16c)(wscales[k], nb, b, a->half, 0) * dx[b];
            acc[k][r] = _mm256_setzero_ps();
        }
    }
    for (int64_t b = 0; b < nb; b++) {
        QG_FN(prefetch_step)(pf);
        for (int k = 0; k < QG_NR; k++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(rows[k] + b * QK_BLOCK));
            const __m256i w0 = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8);  /* low bytes: elements 0..15 */
            const __m256i w1 = _mm256_srai_epi16(w, 8);                         /* high bytes: 16..31 */
            for (int r = 0; r < TR; r++) {
                const int16_t *x = a->qx + (i0 + r) * a->num_cols + b * QK_BLOCK;
                const __m256i dot = QG_DOT2(w0, QG_LOAD16(x), w1, QG_LOAD16(x + 16));
                const float *sc = scales + (k * QG_TR + r) * nb + b;
                acc[k][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc), _mm256_cvtepi32_ps(dot), acc[k][r]);
            }
        }
    }
    for (int k = 0; k < nr; k++)
        for (int r = 0; r < TR; r++) {
            const float bias = a->bias ? a->bias[n + k] : 0.0f;
            store_out(a, i0 + r, n + k, QG_FN(hsum)(acc[k][r]) + bias);
        }
}

static void QG_FN(q8_range)(const void *p, int64_t n0, int64_t n1,
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
        const int inplace = a->num_rows <= QG_INPLACE_ROWS;
        const int spread = qg_spread_on() && a->xf == NULL && inplace;  /* decode steps */
        QG_FN(Prefetch) pf = QG_FN(prefetch_spread)((const uint8_t *)a->q8 + n * a->num_cols, QG_NR * a->num_cols,
                                                    (const uint8_t *)a->q8 + n1 * a->num_cols, spread ? nb : 1);
        if (!spread) QG_FN(prefetch_step)(&pf);  /* the burst */
        if (a->xf != NULL) {
            float *sm = scratch + QG_NR * a->num_cols;
            for (int k = 0; k < QG_NR; k++) QG_FN(q8_row_to_float)(a, rows[k], wscales[k], sm, scratch + k * a->num_cols);
            QG_FN(float_rows)(a, n, nr, scratch);
            continue;
        }
        int64_t i0 = 0;
#if QG_FLANES == 16
        if (!inplace) {  /* sign-extend the pass's codes once, in element order */
            const int64_t K = a->num_cols;
            float *wd = scratch;  /* [QG_NR][nb] */
            int16_t *decoded = (int16_t *)(scratch + QG_NR * (QG_TR + 2) * nb);
            for (int k = 0; k < QG_NR; k++) {
                for (int64_t b = 0; b < nb; b++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(rows[k] + b * QK_BLOCK));
                    _mm256_storeu_si256((__m256i *)(decoded + k * K + b * QK_BLOCK), _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8));
                    _mm256_storeu_si256((__m256i *)(decoded + k * K + b * QK_BLOCK + 16), _mm256_srai_epi16(w, 8));
                    wd[k * nb + b] = QG_FN(block_scale_f16c)(wscales[k], nb, b, a->half, 0);
                }
            }
            i0 = QG_FN(wide_rows)(a, n, nr, 0, a->num_rows, decoded, wd, NULL, 0);
        }
#endif
        for (; i0 + QG_TR <= a->num_rows; i0 += QG_TR) QG_FN(q8_tile)(a, n, nr, i0, QG_TR, rows, wscales, scratch, spread ? &pf : NULL);
        if (i0 < a->num_rows) QG_FN(q8_tile)(a, n, nr, i0, 1, rows, wscales, scratch, spread ? &pf : NULL);
    }
}
/* x [M, K] (float32 or bfloat16, row stride x_stride) -> xf [M, K] float32 in the float path's
 * order: each run of 16 elements as elements 0-3, 8-11, 4-7, 12-15 (QG_FN(codes16_to_float)). */
static void QG_FN(float_rows_in_decoded_order)(
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

/* 16 int16 codes c (elements in order) -> d * c + m at out, float32 or bfloat16 (round to
 * nearest even, as dt_f32_to_bf16 for every finite value). qgemm.c is built with
 * -ffp-contract=off, so the multiply and the add round separately, as the definition's do. */
QG_ALWAYS_INLINE static inline void QG_FN(store16)(__m256i c, __m256 d, __m256 m, void *out, int64_t at,
                                                   int out_dtype) {
    const __m256 clo = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(c)));
    const __m256 chi = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(c, 1)));
    const __m256 lo = _mm256_add_ps(_mm256_mul_ps(clo, d), m), hi = _mm256_add_ps(_mm256_mul_ps(chi, d), m);
    if (out_dtype == DT_FLOAT32) {
        _mm256_storeu_ps((float *)out + at, lo);
        _mm256_storeu_ps((float *)out + at + 8, hi);
        return;
    }
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    __m256i ul = _mm256_castps_si256(lo), uh = _mm256_castps_si256(hi);
    const __m256i rl = _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(ul, 16), one));
    const __m256i rh = _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(uh, 16), one));
    ul = _mm256_srli_epi32(_mm256_add_epi32(ul, rl), 16);
    uh = _mm256_srli_epi32(_mm256_add_epi32(uh, rh), 16);
    /* packus works per 128-bit lane: [l0-3, h0-3, l4-7, h4-7] -> reorder the 64-bit quarters */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(ul, uh), 0xD8);
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), packed);
}

#if QG_FLANES == 16
/* 16 values c * d + m (multiply, then add: the definition's rounding) -> out at `at`, float32 or
 * bfloat16 rounded to nearest even as store16 does. */
QG_ALWAYS_INLINE static inline void QG_FN(store16_wide)(__m512i c, __m512 d, __m512 m, void *out, int64_t at,
                                                        int out_dtype) {
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c), d), m);
    if (out_dtype == DT_FLOAT32) {
        _mm512_storeu_ps((float *)out + at, v);
        return;
    }
    __m512i u = _mm512_castps_si512(v);
    const __m512i r = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
    u = _mm512_srli_epi32(_mm512_add_epi32(u, r), 16);
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), _mm512_cvtepi32_epi16(u));
}

/* One Q4 row (no high bits): each pair's 16 words widened to 16 int32 lanes once, its four runs of
 * 16 codes shifted out of them, each block's scale and min read once. */
static void QG_FN(dequantize_q4_row)(const DqArgs *a, const uint8_t *row, int64_t nb, int64_t at) {
    const uint8_t *codes = row + q4_codes_offset(nb, a->half, a->has_mins);
    const __m512i nibble = _mm512_set1_epi32(0x0F);
    for (int64_t pair = 0; pair < nb / 2; pair++) {
        const __m512i z = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(codes + pair * 32)));
        const int64_t b = 2 * pair, o = at + pair * 2 * QK_BLOCK;
        const __m512 d0 = _mm512_set1_ps(QG_FN(block_scale_f16c)(row, nb, b, a->half, 0));
        const __m512 d1 = _mm512_set1_ps(QG_FN(block_scale_f16c)(row, nb, b + 1, a->half, 0));
        const __m512 m0 = a->has_mins ? _mm512_set1_ps(QG_FN(block_scale_f16c)(row, nb, b, a->half, 1)) : _mm512_setzero_ps();
        const __m512 m1 = a->has_mins ? _mm512_set1_ps(QG_FN(block_scale_f16c)(row, nb, b + 1, a->half, 1))
                                      : _mm512_setzero_ps();
        QG_FN(store16_wide)(_mm512_and_si512(z, nibble), d0, m0, a->out, o, a->out_dtype);
        QG_FN(store16_wide)(_mm512_and_si512(_mm512_srli_epi32(z, 4), nibble), d0, m0, a->out, o + 16, a->out_dtype);
        QG_FN(store16_wide)(_mm512_and_si512(_mm512_srli_epi32(z, 8), nibble), d1, m1, a->out, o + 32, a->out_dtype);
        QG_FN(store16_wide)(_mm512_srli_epi32(z, 12), d1, m1, a->out, o + 48, a->out_dtype);
    }
}
#endif

/* Output rows first + [i0, i1) of a dequantize call (DqArgs) -> out rows [i0, i1), elements in order. */
static void QG_FN(dequantize_range)(const void *p, int64_t i0, int64_t i1, float *scratch) {
    (void)scratch;
    const DqArgs *a = (const DqArgs *)p;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    for (int64_t i = i0; i < i1; i++) {
        const int64_t n = a->first + i, at = i * K;
#if QG_FLANES == 16
        if (a->format == QG_Q4) {
            QG_FN(dequantize_q4_row)(a, a->w + n * q4_row_bytes(nb, a->half, 0, a->has_mins), nb, at);
            continue;
        }
#endif
        if (a->format == QG_Q8) {
            const int8_t *row = a->w8 + n * K;
            const uint8_t *sc = a->scales + n * nb * (a->half ? 2 : 4);
            for (int64_t b = 0; b < nb; b++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(row + b * QK_BLOCK));
                const __m256 d = _mm256_set1_ps(block_scale(sc, nb, b, a->half, 0)), m = _mm256_setzero_ps();
                QG_FN(store16)(_mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), d, m, a->out, at + b * QK_BLOCK,
                               a->out_dtype);
                QG_FN(store16)(_mm256_srai_epi16(v, 8), d, m, a->out, at + b * QK_BLOCK + 16, a->out_dtype);
            }
            continue;
        }
        const int high = a->format == QG_Q5;
        const uint8_t *row = a->w + n * q4_row_bytes(nb, a->half, high, a->has_mins);
        const uint8_t *codes = row + q4_codes_offset(nb, a->half, a->has_mins);
        for (int64_t pair = 0; pair < nb / 2; pair++) {
            __m256i c[4];
            if (high) QG_FN(q45_decode_pair)(codes + pair * 40, 1, c);
            else QG_FN(q45_decode_pair)(codes + pair * 32, 0, c);
            for (int j = 0; j < 4; j++) {
                const int64_t b = 2 * pair + j / 2;
                const __m256 d = _mm256_set1_ps(block_scale(row, nb, b, a->half, 0));
                const __m256 m = a->has_mins ? _mm256_set1_ps(block_scale(row, nb, b, a->half, 1))
                                             : _mm256_setzero_ps();
                QG_FN(store16)(c[j], d, m, a->out, at + pair * 2 * QK_BLOCK + 16 * j, a->out_dtype);
            }
        }
    }
}
