/* The strip route of qgemm.c (included once, inside the avx512 `#pragma GCC target` region, after
 * qgemm_x86.h): the int16 route's integer sums with AVX-512 VNNI, 16 output rows per vector.
 *
 * The activations are quantized exactly as for the int16 route (per row, blocks of 32, codes
 * q = round(x / dx), |q| <= 32767, dx = max|x| / 32767, round half to even). Per strip of 16
 * output rows the weights' codes are decoded once per product into a panel of int16 pairs:
 * 32-bit word (w, n) of the panel holds inputs 2w and 2w + 1 of output row n, so a 64-byte
 * panel vector is two inputs of all 16 rows. One vpdpwssd of it against an activation row's two
 * codes (a 32-bit broadcast) adds those two products to each row's lane; 16 of them sum a
 * block of 32 inputs for 16 outputs, the same integer per output as the int16 route's (|sum| <
 * 2^27). The block's scale d * dx (and the min term m * sum(x)) is then applied in float32 once
 * per block and output, where the int16 route applies it per block and 8 lanes of partial sums:
 * a product differs from the int16 route's only in the order and number of its float32
 * roundings. Per block and activation row the route issues 16 vpdpwssd over 16 outputs (512
 * multiply-adds) and ~4 float instructions, where the int16 route's 512-bit tiles issue ~5
 * instructions per 64 multiply-adds: what a prompt chunk's products are bound by.
 *
 * Work: strips of 16 outputs across cpu.h's pool (needs N a multiple of 16); per strip its panel
 * is built once, then every activation row runs against it, up to QS_ROWS rows at a time. */

typedef struct {
    const QArgs *q;
    int is_q4;
} StripArgs;

/* Block b of row i of x (float32 or bfloat16, row stride x_stride) -> its 32 int16 codes as two
 * vectors of int32, its scale dx and its exact sum (quantize_rows' codes and scale with the same
 * rounding, round half to even through MXCSR; the sum in another order). The amx_int route's
 * quantizer too. */
static inline void strip_quantize_block(const void *x, int64_t at, int dtype, __m512i *q0, __m512i *q1,
                                        float *dx, float *sx, const float xmax) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    __m512 v0, v1;
    if (dtype == DT_FLOAT32) {
        v0 = _mm512_loadu_ps((const float *)x + at);
        v1 = _mm512_loadu_ps((const float *)x + at + 16);
    } else {
        const uint16_t *h = (const uint16_t *)x + at;
        v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h)), 16));
        v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + 16))), 16));
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign)));
    const __m512 vinv = _mm512_set1_ps(amax > 0.0f ? xmax / amax : 0.0f);
    *q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vinv));
    *q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vinv));
    *dx = amax / xmax;
    *sx = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
}

/* x [M, K] -> qx [M, K] int16, dx, sx [M, nb] (strip_quantize_block per block). */
static void strip_quantize_rows(const void *x, int64_t x_stride, int64_t num_rows, int64_t num_cols, int dtype,
                                int16_t *qx, float *dx, float *sx) {
    const int64_t nb = num_cols / QK_BLOCK;
    for (int64_t i = 0; i < num_rows; i++) {
        for (int64_t b = 0; b < nb; b++) {
            __m512i q0, q1;
            strip_quantize_block(x, i * x_stride + b * QK_BLOCK, dtype, &q0, &q1, dx + i * nb + b, sx + i * nb + b,
                                 QG_XMAX);
            int16_t *codes = qx + i * num_cols + b * QK_BLOCK;
            _mm256_storeu_si256((__m256i *)codes, _mm512_cvtepi32_epi16(q0));
            _mm256_storeu_si256((__m256i *)(codes + 16), _mm512_cvtepi32_epi16(q1));
        }
    }
}

/* x [M, K] -> int8 codes qx8 [M, K] (QG_INT8: |q| <= 127, strip_quantize_block's rounding), dx, isx
 * [M, nb] (each block's sum of codes) and sx = dx * isx (the min term's sum), the codes of each block
 * placed as packed_rows reads them: per 8 inputs e0 .. e7 of a Q4 or Q5 block (nibbles) the bytes
 * e0 e4 e1 e5 e2 e6 e3 e7 (the order of a strip word's nibbles taken by & 0x0F0F0F0F, then >> 4: two
 * 32-bit broadcasts), per 4 inputs of a Q8 block e0 e2 e1 e3 (the strip's byte order). */
static void strip_quantize_rows8(const void *x, int64_t x_stride, int64_t num_rows, int64_t num_cols, int dtype,
                                 int nibbles, int8_t *qx8, float *dx, float *sx, int32_t *isx) {
    const int64_t nb = num_cols / QK_BLOCK;
    const __m128i order = nibbles ? _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15)
                                : _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    for (int64_t i = 0; i < num_rows; i++) {
        for (int64_t b = 0; b < nb; b++) {
            __m512i q0, q1;
            strip_quantize_block(x, i * x_stride + b * QK_BLOCK, dtype, &q0, &q1, dx + i * nb + b, sx + i * nb + b,
                                 127.0f);
            isx[i * nb + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            sx[i * nb + b] = dx[i * nb + b] * (float)isx[i * nb + b];  /* the codes' sum (see qgemm.h) */
            int8_t *codes = qx8 + i * num_cols + b * QK_BLOCK;
            _mm_storeu_si128((__m128i *)codes, _mm_shuffle_epi8(_mm512_cvtepi32_epi8(q0), order));
            _mm_storeu_si128((__m128i *)(codes + 16), _mm_shuffle_epi8(_mm512_cvtepi32_epi8(q1), order));
        }
    }
}

/* The panel of output rows n0 .. n0 + 15: panel [K / 2][16] 32-bit words (word (w, n): inputs 2w
 * and 2w + 1 of row n0 + n as int16, low then high), d [nb][16] and (Q4 with mins) m [nb][16] as
 * float32. dec: [16][K] int16 of scratch (the rows decoded in input order first). */
static void strip_build_panel(const StripArgs *sa, int64_t n0, int16_t *dec, uint32_t *panel, float *d, float *m) {
    const QArgs *a = sa->q;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    for (int n = 0; n < QS_TILE; n++) {
        int16_t *out = dec + n * K;
        if (sa->is_q4) {
            const uint8_t *row = a->blocks + (n0 + n) * q4_row_bytes(nb, a->half, a->high, a->has_mins);
            const uint8_t *pairs = row + q4_codes_offset(nb, a->half, a->has_mins);
            const int64_t pair_bytes = q4_pair_bytes(a->high);
            for (int64_t p = 0; p < nb / 2; p++) {
                __m256i w[4];
                if (a->high) q45_decode_pair_avx512(pairs + p * pair_bytes, 1, w);
                else q45_decode_pair_avx512(pairs + p * pair_bytes, 0, w);
                for (int j = 0; j < 4; j++) _mm256_storeu_si256((__m256i *)(out + p * 2 * QK_BLOCK + 16 * j), w[j]);
            }
            for (int64_t b = 0; b < nb; b++) {
                d[b * QS_TILE + n] = block_scale_f16c_avx512(row, nb, b, a->half, 0);
                if (a->has_mins) m[b * QS_TILE + n] = block_scale_f16c_avx512(row, nb, b, a->half, 1);
            }
        } else {  /* Q8: byte 2i = element i, 2i + 1 = element 16 + i */
            const int8_t *row = a->q8 + (n0 + n) * K;
            const uint8_t *sc = a->scales + (n0 + n) * nb * (a->half ? 2 : 4);
            for (int64_t b = 0; b < nb; b++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(row + b * QK_BLOCK));
                _mm256_storeu_si256((__m256i *)(out + b * QK_BLOCK), _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8));
                _mm256_storeu_si256((__m256i *)(out + b * QK_BLOCK + 16), _mm256_srai_epi16(v, 8));
                d[b * QS_TILE + n] = block_scale_f16c_avx512(sc, nb, b, a->half, 0);
            }
        }
    }
    /* [16][K / 2] words -> [K / 2][16]: 16 x 16 words at a time through the 512-bit transpose
     * (K / 2 is a multiple of 16: K is a multiple of 32) */
    const uint32_t *src = (const uint32_t *)dec;
    const int64_t words = K / 2;
    for (int64_t w0 = 0; w0 < words; w0 += 16) {
        __m512i r[16], t[16];
        for (int n = 0; n < 16; n++) r[n] = _mm512_loadu_si512((const void *)(src + n * words + w0));
        /* 4 rounds: words, pairs of words, 128-bit lanes twice */
        for (int n = 0; n < 16; n += 2) {
            t[n] = _mm512_unpacklo_epi32(r[n], r[n + 1]);
            t[n + 1] = _mm512_unpackhi_epi32(r[n], r[n + 1]);
        }
        for (int n = 0; n < 16; n += 4) {
            r[n] = _mm512_unpacklo_epi64(t[n], t[n + 2]);
            r[n + 1] = _mm512_unpackhi_epi64(t[n], t[n + 2]);
            r[n + 2] = _mm512_unpacklo_epi64(t[n + 1], t[n + 3]);
            r[n + 3] = _mm512_unpackhi_epi64(t[n + 1], t[n + 3]);
        }
        /* r[4g + j] holds, per 128-bit lane L, word 4L + c of rows 4g .. 4g + 3 where c is j's
         * column: c = 0, 1, 2, 3 for j = 0, 1, 2, 3 */
        for (int j = 0; j < 4; j++) {
            /* lanes L of rows-groups g = 0..3 -> output word 4L + j holds groups 0..3 in order */
            const __m512i a01lo = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);   /* g0 L0 L1, g1 L0 L1 */
            const __m512i a01hi = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);   /* g0 L2 L3, g1 L2 L3 */
            const __m512i a23lo = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
            const __m512i a23hi = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
            t[0 + j] = _mm512_shuffle_i32x4(a01lo, a23lo, 0x88);   /* L0: g0 g1 g2 g3 */
            t[4 + j] = _mm512_shuffle_i32x4(a01lo, a23lo, 0xDD);   /* L1 */
            t[8 + j] = _mm512_shuffle_i32x4(a01hi, a23hi, 0x88);   /* L2 */
            t[12 + j] = _mm512_shuffle_i32x4(a01hi, a23hi, 0xDD);  /* L3 */
        }
        for (int L = 0; L < 4; L++)
            for (int j = 0; j < 4; j++)
                _mm512_store_si512((void *)(panel + (w0 + 4 * L + j) * QS_TILE), t[4 * L + j]);
    }
}

/* acc [TR] (rows i0 .. i0 + TR - 1, outputs n0 .. n0 + 15) + bias -> y. */
QG_ALWAYS_INLINE static inline void strip_store(const QArgs *a, int64_t n0, int64_t i0, const int TR, const __m512 *acc) {
    const __m512 bias = a->bias ? _mm512_loadu_ps(a->bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < TR; r++) {
        const __m512 out = _mm512_add_ps(acc[r], bias);
        if (a->dtype == DT_FLOAT32) {
            _mm512_storeu_ps((float *)a->y + (i0 + r) * a->y_stride + n0, out);
        } else {
            float v[QS_TILE];
            _mm512_storeu_ps(v, out);
            uint16_t *dst = (uint16_t *)a->y + (i0 + r) * a->y_stride + n0;
            for (int n = 0; n < QS_TILE; n++) dst[n] = dt_f32_to_bf16(v[n]);
        }
    }
}

/* Activation rows i0 .. i0 + TR - 1 against one panel: y [i, n0 .. n0 + 15]. */
QG_ALWAYS_INLINE static inline void strip_rows(const QArgs *a, int64_t n0, int64_t i0, const int TR,
                                               const uint32_t *panel, const float *d, const float *m,
                                               const int MINS) {
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    __m512 acc[QS_ROWS];
    const int32_t *x[QS_ROWS];
    for (int r = 0; r < TR; r++) {
        acc[r] = _mm512_setzero_ps();
        x[r] = (const int32_t *)(a->qx + (i0 + r) * K);  /* pairs of codes as words */
    }
    for (int64_t b = 0; b < nb; b++) {
        __m512i s[QS_ROWS];
        for (int r = 0; r < TR; r++) s[r] = _mm512_setzero_si512();
        const uint32_t *pb = panel + b * (QK_BLOCK / 2) * QS_TILE;
#pragma GCC unroll 16
        for (int st = 0; st < QK_BLOCK / 2; st++) {
            const __m512i w = _mm512_load_si512((const void *)(pb + st * QS_TILE));
            for (int r = 0; r < TR; r++)
                s[r] = _mm512_dpwssd_epi32(s[r], w, _mm512_set1_epi32(x[r][b * (QK_BLOCK / 2) + st]));
        }
        const __m512 db = _mm512_load_ps(d + b * QS_TILE);
        const __m512 mb = MINS ? _mm512_load_ps(m + b * QS_TILE) : _mm512_setzero_ps();
        for (int r = 0; r < TR; r++) {
            const __m512 scale = _mm512_mul_ps(db, _mm512_set1_ps(a->dx[(i0 + r) * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), scale, acc[r]);
            if (MINS) acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(a->sx[(i0 + r) * nb + b]), acc[r]);
        }
    }
    strip_store(a, n0, i0, TR, acc);
}

/* One pass of 1 .. QS_ROWS rows against a panel, in a function of its own (as packed_pass_*). */
#define QS_STRIP_PASS(NAME, MINS)                                                                       \
    __attribute__((noinline)) static void NAME(const QArgs *a, int64_t n0, int64_t i0, int64_t rows,   \
                                               const uint32_t *panel, const float *d, const float *m) { \
        enum { R_MINS = MINS };                                                                         \
        switch (rows) {                                                                                 \
        QS_PASSES(QS_STRIP_PASS_CASE)                                                                   \
        default: break;                                                                                 \
        }                                                                                               \
    }
#define QS_STRIP_PASS_CASE(TR) case TR: strip_rows(a, n0, i0, TR, panel, d, m, R_MINS); break;
QS_STRIP_PASS(strip_pass, 0)
QS_STRIP_PASS(strip_pass_mins, 1)
#undef QS_STRIP_PASS
#undef QS_STRIP_PASS_CASE

static void strip_all_rows(const QArgs *a, int64_t n0, const uint32_t *panel, const float *d, const float *m,
                           const int MINS) {
    void (*pass)(const QArgs *, int64_t, int64_t, int64_t, const uint32_t *, const float *, const float *) =
        MINS ? strip_pass_mins : strip_pass;
    QS_SPLIT(a->num_rows, pass(a, n0, i0, rows, panel, d, m))
}

/* Strips s0 .. s1 - 1 (16 output rows each). */
static void strip_range(const void *p, int64_t s0, int64_t s1, float *scratch) {
    const StripArgs *sa = (const StripArgs *)p;
    const QArgs *a = sa->q;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    /* scratch, 64-byte aligned: the panel (K / 2 x 16 words), d and m ([nb][16] each), the rows
     * decoded in input order (16 x K int16) */
    uint32_t *panel = (uint32_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *d = (float *)(panel + K / 2 * QS_TILE), *m = d + nb * QS_TILE;
    int16_t *dec = (int16_t *)(m + nb * QS_TILE);
    const int mins = sa->is_q4 && a->has_mins;
    for (int64_t s = s0; s < s1; s++) {
        strip_build_panel(sa, s * QS_TILE, dec, panel, d, m);
        if (mins) strip_all_rows(a, s * QS_TILE, panel, d, m, 1);
        else strip_all_rows(a, s * QS_TILE, panel, d, m, 0);
    }
}

/* The strip route of qg_matmul (qgemm.h), where cpu_allows(CPU_HAS_AVX512_VNNI) and N is a
 * multiple of 16 (run() checks both). */
static int run_strip(QArgs *a, const void *x, int64_t x_stride, int is_q4) {
    const int64_t M = a->num_rows, K = a->num_cols, nb = K / QK_BLOCK, N = a->num_out;
    int16_t *qx;
    float *dx, *sx;
    char *buf = alloc_codes(M, K, &qx, &dx, &sx);
    if (buf == NULL) return QG_NO_MEMORY;
    strip_quantize_rows(x, x_stride, M, K, a->dtype, qx, dx, sx);
    a->qx = qx; a->dx = dx; a->sx = sx;
    StripArgs sa = {a, is_q4};
    const size_t floats = 16 + (size_t)(K / 2 * QS_TILE) + (size_t)(2 * nb * QS_TILE) + (size_t)(QS_TILE * K / 2);
    int rc = cpu_parallel_for(strip_range, &sa, N / QS_TILE, M * N * K, floats);
    free(buf);
    return rc;
}

/* ---- QG_PACKED (qgemm.h): the strips stored as the route reads them ----
 * No panel pass: each 64-byte vector of a strip's codes is two inputs of 16 rows four times over,
 * ((u >> 4t) & 0x000F000F), so a block costs 4 loads, 3 shifts and 4 ands beside its 16 vpdpwssd
 * per activation row: one activation row (a decode step) reads its weights at the rate the
 * caches give, and every row count sums the same integers in the same float32 order as the
 * strip route over row layouts (strip_rows). Each block step prefetches the next strip's share of
 * it (into qg_prefetch_level's cache): one strip ahead, measured on Zen 4 (one row, a weight
 * beyond L3, one thread) at 21.5 GB/s against 10.5 with 1 KB ahead into L1 and 14.6 for the int16
 * route. */

/* Block b's 16 scales (or mins) of a strip's scale region sc (packed_scale's values). */
QG_ALWAYS_INLINE static inline __m512 packed_block_scales(const uint8_t *sc, int64_t b, int half) {
    if (half == QG_SCALES_SUPER) {
        const uint8_t *group = sc + b / 8 * 160;
        const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)group));
        const __m128i q = _mm_loadu_si128((const __m128i *)(group + 32 + (b % 8) * 16));
        return _mm512_mul_ps(f, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)));
    }
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + b * 32)));
    return _mm512_loadu_ps((const float *)sc + b * 16);
}

/* Activation rows i0 .. i0 + TR - 1 against one strip: y [i, n0 .. n0 + 15]. One row sums into
 * four integer accumulators and 2-7 rows into two each (a block's 16 vpdpwssd would otherwise
 * wait on each other), added exactly at the block's end. FMT PACKED_Q8: eight vectors of four
 * inputs per block, bytes 0 and 2 of each lane sign-extended to a pair, then bytes 1 and 3;
 * PACKED_Q5: Q4's nibbles, then 16 minus the pair's sign mask (a masked subtract of 16). I8 (QG_INT8,
 * qx8's byte codes): one vpdpbusd per 64 bytes of weights against four activation bytes, the weights
 * as unsigned bytes (Q4's nibbles & 0x0F0F0F0F, then >> 4; PACKED_Q5I8's with 16 added where the code
 * is not negative; Q8's codes xor 0x80), the offset (16 or 128) times the block's code sum taken off
 * the integer sum. */
QG_ALWAYS_INLINE static inline void packed_rows(const QArgs *a, const uint8_t *strip, int64_t n0, int64_t i0,
                                                const int TR, const int MINS, const int FMT, const int I8) {
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    const int half = a->half;
    const int NA = TR == 1 ? 4 : TR < QS_ROWS ? 2 : 1;
    const int64_t code_bytes = packed_code_bytes(FMT);
    const uint8_t *dsc = strip + nb * code_bytes, *msc = dsc + packed_scale_bytes(nb, half);
    const int64_t strip_bytes = packed_strip_bytes(FMT, nb, half, MINS), per_block = strip_bytes / nb;
    const __m512i sixteen = _mm512_set1_epi16(16);
    const int l2 = qg_prefetch_level() == QG_PREFETCH_L2;
    const __m512i mask = _mm512_set1_epi32(0x000F000F);
    __m512 acc[QS_ROWS];
    const int32_t *x[QS_ROWS];
    for (int r = 0; r < TR; r++) {
        acc[r] = _mm512_setzero_ps();
        x[r] = I8 ? (const int32_t *)(a->qx8 + (i0 + r) * K) : (const int32_t *)(a->qx + (i0 + r) * K);
    }
    const __m512i nibbles = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    const __m512i sixteen8 = _mm512_set1_epi8(16);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *codes = strip + b * code_bytes;
        packed_prefetch_block(strip, strip_bytes, per_block, b, l2);
        __m512i s[QS_ROWS][4];
        for (int r = 0; r < TR; r++)
            for (int k = 0; k < NA; k++) s[r][k] = _mm512_setzero_si512();
        if (I8 && FMT == PACKED_Q8) {  /* (q + 128) * x summed, 128 * sum(x) taken off below */
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) {
                const __m512i c = _mm512_xor_si512(_mm512_loadu_si512((const void *)(codes + 64 * u)), flip);
                const int k = NA == 4 ? u % 4 : NA == 2 ? u % 2 : 0;
                for (int r = 0; r < TR; r++)
                    s[r][k] = _mm512_dpbusd_epi32(s[r][k], c, _mm512_set1_epi32(x[r][b * (QK_BLOCK / 4) + u]));
            }
        } else if (I8) {  /* Q4 and Q5: the low nibbles of each byte, then the high ones */
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                const __m512i c = _mm512_loadu_si512((const void *)(codes + 64 * v));
                __m512i w0 = _mm512_and_si512(c, nibbles), w1 = _mm512_and_si512(_mm512_srli_epi32(c, 4), nibbles);
                if (FMT == PACKED_Q5I8) {  /* c + 16 (0..31): 16 added where the code is not negative */
                    uint64_t plus[2];  /* qg_pack_int8's masks: bit 4j + k for byte k of lane j */
                    memcpy(plus, codes + 256 + 16 * v, sizeof plus);
                    w0 = _mm512_mask_add_epi8(w0, _cvtu64_mask64(plus[0]), w0, sixteen8);
                    w1 = _mm512_mask_add_epi8(w1, _cvtu64_mask64(plus[1]), w1, sixteen8);
                }
                const int k = NA == 4 ? v : NA == 2 ? v % 2 : 0;
                for (int r = 0; r < TR; r++) {
                    const int32_t *xp = x[r] + b * (QK_BLOCK / 4) + 2 * v;
                    s[r][k] = _mm512_dpbusd_epi32(s[r][k], w0, _mm512_set1_epi32(xp[0]));
                    s[r][k] = _mm512_dpbusd_epi32(s[r][k], w1, _mm512_set1_epi32(xp[1]));
                }
            }
        } else if (FMT == PACKED_Q8) {
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) {
                const __m512i c = _mm512_loadu_si512((const void *)(codes + 64 * u));
                const __m512i w0 = _mm512_srai_epi16(_mm512_slli_epi16(c, 8), 8), w1 = _mm512_srai_epi16(c, 8);
                const int k = NA == 4 ? u % 4 : NA == 2 ? u % 2 : 0;
                for (int r = 0; r < TR; r++) {
                    const int32_t *xp = x[r] + b * (QK_BLOCK / 2) + 2 * u;
                    s[r][k] = _mm512_dpwssd_epi32(s[r][k], w0, _mm512_set1_epi32(xp[0]));
                    s[r][k] = _mm512_dpwssd_epi32(s[r][k], w1, _mm512_set1_epi32(xp[1]));
                }
            }
        } else {
            for (int v = 0; v < 4; v++) {
                const __m512i c = _mm512_loadu_si512((const void *)(codes + 64 * v));
                __m512i w0 = _mm512_and_si512(c, mask);
                __m512i w1 = _mm512_and_si512(_mm512_srli_epi32(c, 4), mask);
                __m512i w2 = _mm512_and_si512(_mm512_srli_epi32(c, 8), mask);
                __m512i w3 = _mm512_and_si512(_mm512_srli_epi32(c, 12), mask);
                if (FMT == PACKED_Q5) {
                    const uint32_t *sign = (const uint32_t *)(codes + 256) + 4 * v;
                    w0 = _mm512_mask_sub_epi16(w0, _cvtu32_mask32(sign[0]), w0, sixteen);
                    w1 = _mm512_mask_sub_epi16(w1, _cvtu32_mask32(sign[1]), w1, sixteen);
                    w2 = _mm512_mask_sub_epi16(w2, _cvtu32_mask32(sign[2]), w2, sixteen);
                    w3 = _mm512_mask_sub_epi16(w3, _cvtu32_mask32(sign[3]), w3, sixteen);
                }
                const int k0 = NA == 4 ? v : 0, k1 = NA == 4 ? v : NA == 2 ? 1 : 0;
                for (int r = 0; r < TR; r++) {
                    const int32_t *xp = x[r] + b * (QK_BLOCK / 2) + 4 * v;
                    s[r][k0] = _mm512_dpwssd_epi32(s[r][k0], w0, _mm512_set1_epi32(xp[0]));
                    s[r][k1] = _mm512_dpwssd_epi32(s[r][k1], w1, _mm512_set1_epi32(xp[1]));
                    s[r][k0] = _mm512_dpwssd_epi32(s[r][k0], w2, _mm512_set1_epi32(xp[2]));
                    s[r][k1] = _mm512_dpwssd_epi32(s[r][k1], w3, _mm512_set1_epi32(xp[3]));
                }
            }
        }
        const __m512 db = packed_block_scales(dsc, b, half);
        const __m512 mb = MINS ? packed_block_scales(msc, b, half) : _mm512_setzero_ps();
        for (int r = 0; r < TR; r++) {
            __m512i sum = s[r][0];
            for (int k = 1; k < NA; k++) sum = _mm512_add_epi32(sum, s[r][k]);
            if (I8 && FMT != PACKED_Q4) {  /* the codes' offset: 128 (Q8), 16 (Q5) */
                const int32_t offset = FMT == PACKED_Q8 ? 128 : 16;
                sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(offset * a->isx[(i0 + r) * nb + b]));
            }
            const __m512 scale = _mm512_mul_ps(db, _mm512_set1_ps(a->dx[(i0 + r) * nb + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
            if (MINS) acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(a->sx[(i0 + r) * nb + b]), acc[r]);
        }
    }
    strip_store(a, n0, i0, TR, acc);
}

/* Input pair p (0..15) of a PACKED_Q6 block's six words as int16 pairs of all 16 rows: the signed codes
 * q - 32 (the fields hold them as 6-bit two's complement, q ^ 32: shifted to the top of each half and
 * arithmetically back), or with UNSIGNED q itself (0..63: masked, then ^ 32). */
QG_ALWAYS_INLINE static inline __m512i q6_pair(const uint8_t *codes, int p, const int UNSIGNED) {
    const __m512i six = _mm512_set1_epi32(0x003F003F), bit5 = _mm512_set1_epi32(0x00200020);
    if (p < 12) {
        const __m512i u = _mm512_loadu_si512((const void *)(codes + 64 * (p / 2)));
        if (UNSIGNED)  /* (field & 63) ^ 32 */
            return _mm512_ternarylogic_epi32(p % 2 ? _mm512_srli_epi32(u, 6) : u, six, bit5, 0x6A);
        return _mm512_srai_epi16(_mm512_slli_epi16(u, p % 2 ? 4 : 10), 10);
    }
    const int m = p - 12;
    const __m512i lo = _mm512_loadu_si512((const void *)(codes + 64 * m));
    const __m512i hi = _mm512_loadu_si512((const void *)(codes + 64 * (4 + m / 2)));
    const __m512i nib = _mm512_srli_epi16(lo, 12);  /* the low 4 bits, zero above */
    if (UNSIGNED)  /* nib | (high bits at 4-5), then ^ 32 */
        return _mm512_xor_si512(_mm512_ternarylogic_epi32(nib, _mm512_srli_epi16(hi, 8 + 2 * (m % 2)),
                                                          _mm512_set1_epi32(0x00300030), 0xF8), bit5);
    /* the high bits at 14-15, arithmetically to 4-5 (sign above), bits 0-3 from nib */
    const __m512i top = _mm512_srai_epi16(m % 2 ? hi : _mm512_slli_epi16(hi, 2), 10);
    return _mm512_ternarylogic_epi32(nib, top, _mm512_set1_epi32(0x000F000F), 0xE4);
}

/* packed_rows for PACKED_Q6 (qgemm.h's QG_Q6): a block's 16 pairs (q6_pair) into the accumulators one
 * at a time, so few decoded vectors are live at once. Its two groups of 16 inputs (pairs 0-7, 8-15)
 * sum apart (1-3 rows: two accumulators each) as sum (q - 32) x, then in float32 t = sum0 * (d * s0),
 * t = sum1 * (d * s1) + t (an FMA), acc = t * dx + acc (an FMA). I8 (QG_INT8): two pairs' unsigned
 * codes as bytes against four activation bytes (vpdpbusd), 32 times the groups' code sums taken off. */
QG_ALWAYS_INLINE static inline void packed_rows_q6(const QArgs *a, const uint8_t *strip, int64_t n0, int64_t i0,
                                                   const int TR, const int I8) {
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    const int NA = TR < 4 ? 2 : 1;  /* accumulators per group: 4 to 12 chains of vpdpwssd, 8 to 16 registers */
    const uint8_t *ssc = strip + nb * 384, *dsc = ssc + 2 * nb * 16;
    const int64_t strip_bytes = nb * 420, per_block = 420;
    const int l2 = qg_prefetch_level() == QG_PREFETCH_L2;
    __m512 acc[QS_ROWS];
    const int32_t *x[QS_ROWS];
    for (int r = 0; r < TR; r++) {
        acc[r] = _mm512_setzero_ps();
        x[r] = I8 ? (const int32_t *)(a->qx8 + (i0 + r) * K) : (const int32_t *)(a->qx + (i0 + r) * K);
    }
    __m512 d = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *codes = strip + b * 384;
        packed_prefetch_block(strip, strip_bytes, per_block, b, l2);
        if (b % 8 == 0) d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dsc + b / 8 * 32)));
        __m512i s[QS_ROWS][2][2];
        for (int r = 0; r < TR; r++)
            for (int g = 0; g < 2; g++)
                for (int k = 0; k < NA; k++) s[r][g][k] = _mm512_setzero_si512();
        if (I8) {  /* pairs 2k and 2k + 1 as bytes (q2k, q2k+2, q2k+1, q2k+3: Q8's strip order) against four
                    * activation bytes in that order; the groups' chains in turn as below */
#pragma GCC unroll 8
            for (int q = 0; q < 8; q++) {
                const int k4 = (q % 2) * 4 + q / 2;  /* 0, 4, 1, 5, ...: inputs 4 k4 .. 4 k4 + 3 */
                const __m512i w = _mm512_or_si512(q6_pair(codes, 2 * k4, 1), _mm512_slli_epi32(q6_pair(codes, 2 * k4 + 1, 1), 8));
                const int g = k4 / 4, k = NA == 2 ? (q / 2) % 2 : 0;
                for (int r = 0; r < TR; r++)
                    s[r][g][k] = _mm512_dpbusd_epi32(s[r][g][k], w, _mm512_set1_epi32(x[r][b * (QK_BLOCK / 4) + k4]));
            }
        } else {
        /* pair by pair into the accumulators, so few decoded vectors are live at once, the two groups'
         * pairs taken in turn (0, 8, 1, 9, ...) so their chains of vpdpwssd overlap */
#pragma GCC unroll 16
        for (int q = 0; q < 16; q++) {
            const int p = (q % 2) * 8 + q / 2;
            const __m512i w = q6_pair(codes, p, 0);
            const int g = p / 8, k = NA == 2 ? (q / 2) % 2 : 0;
            for (int r = 0; r < TR; r++)
                s[r][g][k] = _mm512_dpwssd_epi32(s[r][g][k], w, _mm512_set1_epi32(x[r][b * (QK_BLOCK / 2) + p]));
        }
        }
        __m512 ds[2];
        for (int g = 0; g < 2; g++) {
            const __m128i sc = _mm_loadu_si128((const __m128i *)(ssc + (2 * b + g) * 16));
            ds[g] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        }
        for (int r = 0; r < TR; r++) {
            const int32_t *isx = I8 ? a->isx + (i0 + r) * (K / 16) + 2 * b : NULL;
            __m512 f[2];
            for (int g = 0; g < 2; g++) {
                __m512i sum = NA == 2 ? _mm512_add_epi32(s[r][g][0], s[r][g][1]) : s[r][g][0];
                if (I8) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(32 * isx[g]));  /* unsigned codes: q - 32 */
                f[g] = _mm512_cvtepi32_ps(sum);
            }
            const __m512 t = _mm512_fmadd_ps(f[1], ds[1], _mm512_mul_ps(f[0], ds[0]));
            acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(a->dx[(i0 + r) * nb + b]), acc[r]);
        }
    }
    strip_store(a, n0, i0, TR, acc);
}

typedef void (*PackedPass)(const QArgs *a, const uint8_t *strip, int64_t n0, int64_t i0, int64_t rows);

/* One pass of 1 .. QS_ROWS activation rows over a strip, in a function of its own per format (with
 * the passes of every count inlined beside the strip loop, the 8-row pass timed ~5% slower). */
#define QS_PACKED_PASS(NAME, MINS, FMT, I8)                                                             \
    __attribute__((noinline)) static void NAME(const QArgs *a, const uint8_t *strip, int64_t n0, int64_t i0, \
                                               int64_t rows) {                                          \
        enum { R_MINS = MINS, R_FMT = FMT, R_I8 = I8 };                                                 \
        switch (rows) {                                                                                 \
        QS_PASSES(QS_PACKED_PASS_CASE)                                                                  \
        default: break;                                                                                 \
        }                                                                                               \
    }
#define QS_PACKED_PASS_CASE(TR) case TR: packed_rows(a, strip, n0, i0, TR, R_MINS, R_FMT, R_I8); break;
QS_PACKED_PASS(packed_pass_q8_i8, 0, PACKED_Q8, 1)
QS_PACKED_PASS(packed_pass_q5i8_mins, 1, PACKED_Q5I8, 1)
QS_PACKED_PASS(packed_pass_q5i8, 0, PACKED_Q5I8, 1)
QS_PACKED_PASS(packed_pass_q4_mins_i8, 1, PACKED_Q4, 1)
QS_PACKED_PASS(packed_pass_q4_i8, 0, PACKED_Q4, 1)
QS_PACKED_PASS(packed_pass_q8, 0, PACKED_Q8, 0)
QS_PACKED_PASS(packed_pass_q5_mins, 1, PACKED_Q5, 0)
QS_PACKED_PASS(packed_pass_q5, 0, PACKED_Q5, 0)
QS_PACKED_PASS(packed_pass_q4_mins, 1, PACKED_Q4, 0)
QS_PACKED_PASS(packed_pass_q4, 0, PACKED_Q4, 0)
#undef QS_PACKED_PASS
#undef QS_PACKED_PASS_CASE
#define QS_Q6_PASS(NAME, I8)                                                                                  \
    __attribute__((noinline)) static void NAME(const QArgs *a, const uint8_t *strip, int64_t n0, int64_t i0,   \
                                               int64_t rows) {                                                \
        enum { R_I8 = I8 };                                                                                   \
        switch (rows) {                                                                                       \
        QS_PASSES(QS_Q6_PASS_CASE)                                                                            \
        default: break;                                                                                       \
        }                                                                                                     \
    }
#define QS_Q6_PASS_CASE(TR) case TR: packed_rows_q6(a, strip, n0, i0, TR, R_I8); break;
QS_Q6_PASS(packed_pass_q6, 0)
QS_Q6_PASS(packed_pass_q6_i8, 1)
#undef QS_Q6_PASS
#undef QS_Q6_PASS_CASE

/* Every activation row against one strip, in as few passes as QS_ROWS allows, of near-equal
 * counts (QS_SPLIT). */
static void packed_all_rows(const QArgs *a, const uint8_t *strip, int64_t n0, PackedPass pass) {
    QS_SPLIT(a->num_rows, pass(a, strip, n0, i0, rows))
}

/* Strips s0 .. s1 - 1 of a packed product (run_packed in qgemm.c). */
static void packed_range_avx512(const void *p, int64_t s0, int64_t s1, float *scratch) {
    (void)scratch;
    const QArgs *a = (const QArgs *)p;
    const int64_t strip_bytes = packed_strip_bytes(a->packed, a->num_cols / QK_BLOCK, a->half, a->has_mins);
    PackedPass pass;
    if (a->packed == PACKED_Q6) {
        pass = a->qx8 != NULL ? packed_pass_q6_i8 : packed_pass_q6;
    } else if (a->qx8 != NULL) {  /* QG_INT8 */
        if (a->packed == PACKED_Q8) pass = packed_pass_q8_i8;
        else if (a->packed == PACKED_Q5I8) pass = a->has_mins ? packed_pass_q5i8_mins : packed_pass_q5i8;
        else pass = a->has_mins ? packed_pass_q4_mins_i8 : packed_pass_q4_i8;
    } else if (a->packed == PACKED_Q8) {
        pass = packed_pass_q8;
    } else if (a->packed == PACKED_Q5) {
        pass = a->has_mins ? packed_pass_q5_mins : packed_pass_q5;
    } else {
        pass = a->has_mins ? packed_pass_q4_mins : packed_pass_q4;
    }
    for (int64_t s = s0; s < s1; s++) packed_all_rows(a, a->blocks + s * strip_bytes, s * QS_TILE, pass);
}
