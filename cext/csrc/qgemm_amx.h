/* The amx_int route of qgemm.c (included once, inside a `#pragma GCC target` region with
 * AVX-512 and AMX-INT8): the integer route's own numbers on AMX tiles.
 *
 * The activations are quantized exactly as for the int16 route (per row, blocks of 32, codes
 * q = round(x / dx) with |q| <= 32767, dx = max|x| / 32767), then each code is split into two
 * bytes, q = 256 * hi + lo with hi signed and lo unsigned. The weights' 4-, 5- or 8-bit codes
 * are bytes already. One block of 32 inputs is one tile pass: a [16 rows x 32 bytes] tile of
 * hi (and one of lo) against a [32 x 16] tile of weight codes gives two int32 tiles whose
 * 256 * C_hi + C_lo is the block's exact integer dot product (|sum| < 2^27), the same integer
 * the int16 route's vpdpwssd sums; the block's scale dx * d (and the min term m * sum(x)) is
 * then applied in float32 with AVX-512, so a product differs from the int16 route's only in
 * the order of the float32 additions over blocks. llama.cpp's AMX kernels make the same split
 * of work (integer tiles per block, scales after each pass) with int8 activations.
 *
 * Work: output features in strips of 16 across cpu.h's pool; per strip the weight codes are
 * laid out once as the tiles' VNNI order (a panel: per block 8 rows of 16 x 4 bytes) with the
 * scales and mins as float32 vectors, then every 16-row tile of activations runs against it.
 * Rows beyond M are zero padding (their outputs are dropped). Needs N a multiple of 16. */

#define QA_TILE 16

typedef struct {
    const QArgs *q;       /* the product (weights, bias, y) */
    const int8_t *hi;     /* [Mp, K] high bytes of the activation codes */
    const uint8_t *lo;    /* [Mp, K] low bytes */
    const float *dx, *sx; /* [Mp, nb] */
    int64_t padded_rows;  /* Mp: M rounded up to QA_TILE */
    int is_q4;
} AmxArgs;

/* Tiles: 0, 1, 5, 6 C (hi, lo sums; 16 x 16 int32), 2, 3 A (hi, lo; 16 rows x 32 bytes), 4, 7 B
 * (8 rows of 16 x 4 bytes: 32 inputs x 16 outputs). */
static void amx_configure(void) {
    AmxConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }  /* C: 0, 1, 5, 6 */
    for (int t = 2; t < 4; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 32; }
    cfg.rows[4] = cfg.rows[7] = 8;  /* B: 4, 7 */
    _tile_loadconfig(&cfg);
}

/* x [M, K] -> hi, lo [Mp, K], dx, sx [Mp, nb] (rows M .. Mp - 1 zero): quantize_rows' codes
 * (strip_quantize_block: the same rounding, round half to even) split into bytes. */
static void amx_quantize_rows(const void *x, int64_t x_stride, int64_t num_rows, int64_t padded_rows,
                              int64_t num_cols, int dtype, int8_t *hi, uint8_t *lo, float *dx, float *sx) {
    const int64_t nb = num_cols / QK_BLOCK;
    for (int64_t i = 0; i < num_rows; i++) {
        for (int64_t b = 0; b < nb; b++) {
            __m512i q0, q1;
            strip_quantize_block(x, i * x_stride + b * QK_BLOCK, dtype, &q0, &q1, dx + i * nb + b, sx + i * nb + b,
                                 QG_XMAX);
            const int64_t o = i * num_cols + b * QK_BLOCK;
            _mm_storeu_si128((__m128i *)(hi + o), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q0, 8)));
            _mm_storeu_si128((__m128i *)(hi + o + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q1, 8)));
            _mm_storeu_si128((__m128i *)(lo + o), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(lo + o + 16), _mm512_cvtepi32_epi8(q1));
        }
    }
    const int64_t pad = padded_rows - num_rows;
    memset(hi + num_rows * num_cols, 0, (size_t)(pad * num_cols));
    memset(lo + num_rows * num_cols, 0, (size_t)(pad * num_cols));
    memset(dx + num_rows * nb, 0, sizeof(float) * (size_t)(pad * nb));
    memset(sx + num_rows * nb, 0, sizeof(float) * (size_t)(pad * nb));
}

/* The panel of output rows n0 .. n0 + 15: per block b, codes at panel + b * 512 in the tiles'
 * order (byte 64 * (k / 4) + 4 * n + k % 4 = input k of the block, output n), then scales
 * d [nb][16] and (has_mins) mins [nb][16] as float32. */
static void amx_build_panel(const AmxArgs *aa, int64_t n0, uint8_t *panel, float *d, float *m) {
    const QArgs *a = aa->q;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    uint32_t codes[QK_BLOCK / 4];  /* one row's block in input order, 4 codes per word */
    for (int n = 0; n < QA_TILE; n++) {
        if (aa->is_q4) {
            const uint8_t *row = a->blocks + (n0 + n) * q4_row_bytes(nb, a->half, a->high, a->has_mins);
            const uint8_t *pairs = row + q4_codes_offset(nb, a->half, a->has_mins);
            const int64_t pair_bytes = q4_pair_bytes(a->high);
            for (int64_t p = 0; p < nb / 2; p++) {
                __m256i w[4];
                if (a->high) q45_decode_pair_avx512(pairs + p * pair_bytes, 1, w);
                else q45_decode_pair_avx512(pairs + p * pair_bytes, 0, w);
                for (int half_pair = 0; half_pair < 2; half_pair++) {
                    const int64_t b = 2 * p + half_pair;
                    _mm_storeu_si128((__m128i *)codes, _mm256_cvtepi16_epi8(w[2 * half_pair]));
                    _mm_storeu_si128((__m128i *)codes + 1, _mm256_cvtepi16_epi8(w[2 * half_pair + 1]));
                    uint32_t *dst = (uint32_t *)(panel + b * 512);
                    for (int kk = 0; kk < QK_BLOCK / 4; kk++) dst[kk * QA_TILE + n] = codes[kk];
                }
            }
            for (int64_t b = 0; b < nb; b++) {
                d[b * QA_TILE + n] = block_scale_f16c_avx512(row, nb, b, a->half, 0);
                if (a->has_mins) m[b * QA_TILE + n] = block_scale_f16c_avx512(row, nb, b, a->half, 1);
            }
        } else {  /* Q8: byte 2i = element i, 2i + 1 = element 16 + i */
            const int8_t *row = a->q8 + (n0 + n) * K;
            const uint8_t *sc = a->scales + (n0 + n) * nb * (a->half ? 2 : 4);
            const __m256i order = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                                   0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
            for (int64_t b = 0; b < nb; b++) {
                /* per 128-bit lane: the even bytes (elements i) then the odd (16 + i); then
                 * the lanes' halves regrouped: elements 0-7, 8-15, 16-23, 24-31 */
                const __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(row + b * QK_BLOCK)), order);
                _mm256_storeu_si256((__m256i *)codes, _mm256_permute4x64_epi64(v, 0xD8));
                uint32_t *dst = (uint32_t *)(panel + b * 512);
                for (int kk = 0; kk < QK_BLOCK / 4; kk++) dst[kk * QA_TILE + n] = codes[kk];
                d[b * QA_TILE + n] = block_scale(sc, nb, b, a->half, 0);
            }
        }
    }
}

/* One block's two byte products into the C tiles HI, LO (A: tiles 2, 3; B: tile 4). Signed
 * weight codes (Q5, Q8) or unsigned (Q4: 0..15) take their own instructions. */
#define QA_PASS(SIGNED_W, HI, LO)                                              \
    do {                                                                       \
        if (SIGNED_W) { _tile_dpbssd(HI, 2, 4); _tile_dpbusd(LO, 3, 4); }      \
        else { _tile_dpbsud(HI, 2, 4); _tile_dpbuud(LO, 3, 4); }               \
    } while (0)

/* Block b's 16 x 16 sums (c: hi then lo, as the tiles stored them) into acc, scaled. */
QG_ALWAYS_INLINE static inline void amx_epilogue(__m512 acc[QA_TILE], const int32_t *c, const float *d,
                                                 const float *m, const float *dx, const float *sx,
                                                 int64_t nb, int64_t b, int mins) {
    const __m512 db = _mm512_loadu_ps(d + b * QA_TILE);
    const __m512 mb = mins ? _mm512_loadu_ps(m + b * QA_TILE) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < QA_TILE; r++) {
        const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c + 16 * r), 8),
                                             _mm512_load_si512(c + 256 + 16 * r));
        const __m512 scale = _mm512_mul_ps(db, _mm512_set1_ps(dx[r * nb + b]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
        if (mins) acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(sx[r * nb + b]), acc[r]);
    }
}

/* Block b's tile pass into the C tiles HI, LO, stored at c. */
#define QA_BLOCK(SIGNED_W, HI, LO, b, c)                                       \
    do {                                                                       \
        _tile_zero(HI);                                                        \
        _tile_zero(LO);                                                        \
        _tile_loadd(2, hi + (b) * QK_BLOCK, K);                                \
        _tile_loadd(3, lo + (b) * QK_BLOCK, K);                                \
        _tile_loadd(4, panel + (b) * 512, 64);                                 \
        QA_PASS(SIGNED_W, HI, LO);                                             \
        _tile_stored(HI, (c), 64);                                             \
        _tile_stored(LO, (c) + 256, 64);                                       \
    } while (0)

QG_ALWAYS_INLINE static inline void amx_strip(const AmxArgs *aa, int64_t n0, const uint8_t *panel,
                                              const float *d, const float *m, int32_t *c, const int SIGNED_W) {
    const QArgs *a = aa->q;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK, M = a->num_rows;
    const int mins = aa->is_q4 && a->has_mins;
    const __m512 bias = a->bias ? _mm512_loadu_ps(a->bias + n0) : _mm512_setzero_ps();
    for (int64_t i0 = 0; i0 < aa->padded_rows; i0 += QA_TILE) {
        __m512 acc[QA_TILE];
#pragma GCC unroll 16
        for (int r = 0; r < QA_TILE; r++) acc[r] = _mm512_setzero_ps();
        const int8_t *hi = aa->hi + i0 * K;
        const uint8_t *lo = aa->lo + i0 * K;
        const float *dx = aa->dx + i0 * nb, *sx = aa->sx + i0 * nb;
        /* two sets of C tiles (0, 1 and 5, 6) and of their buffers: block b's tile work runs
         * while block b - 1's sums are scaled */
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            QA_BLOCK(SIGNED_W, 0, 1, b, c);
            if (b > 0) amx_epilogue(acc, c + 512, d, m, dx, sx, nb, b - 1, mins);
            QA_BLOCK(SIGNED_W, 5, 6, b + 1, c + 512);
            amx_epilogue(acc, c, d, m, dx, sx, nb, b, mins);
        }
        if (b < nb) {
            QA_BLOCK(SIGNED_W, 0, 1, b, c);
            if (b > 0) amx_epilogue(acc, c + 512, d, m, dx, sx, nb, b - 1, mins);
            amx_epilogue(acc, c, d, m, dx, sx, nb, b, mins);
        } else {
            amx_epilogue(acc, c + 512, d, m, dx, sx, nb, b - 1, mins);
        }
        for (int r = 0; r < QA_TILE && i0 + r < M; r++) {
            const __m512 out = _mm512_add_ps(acc[r], bias);
            if (a->dtype == DT_FLOAT32) {
                _mm512_storeu_ps((float *)a->y + (i0 + r) * a->y_stride + n0, out);
            } else {  /* round to nearest even, as dt_f32_to_bf16 */
                _mm256_storeu_si256((__m256i *)((uint16_t *)a->y + (i0 + r) * a->y_stride + n0),
                                    (__m256i)_mm512_cvtneps_pbh(out));
            }
        }
    }
}

/* Two strips at once (output rows n0 .. n0 + 31, panels p0 and p1 with their scales): each
 * block's activation tiles are loaded once for four independent products (C tiles 0, 1 for the
 * first strip, 5, 6 for the second; B tiles 4 and 7), and block b's sums are scaled after block
 * b + 1's tile work is issued (two buffers), so the tiles' latency overlaps the scaling. The
 * accumulators live in acc [16][32] (L1). */
#define QA_PAIR_BLOCK(SIGNED_W, b, cb)                                                     \
    do {                                                                                   \
        _tile_zero(0); _tile_zero(1); _tile_zero(5); _tile_zero(6);                        \
        _tile_loadd(2, hi + (b) * QK_BLOCK, K);                                            \
        _tile_loadd(3, lo + (b) * QK_BLOCK, K);                                            \
        _tile_loadd(4, p0 + (b) * 512, 64);                                                \
        _tile_loadd(7, p1 + (b) * 512, 64);                                                \
        if (SIGNED_W) {                                                                    \
            _tile_dpbssd(0, 2, 4); _tile_dpbusd(1, 3, 4);                                  \
            _tile_dpbssd(5, 2, 7); _tile_dpbusd(6, 3, 7);                                  \
        } else {                                                                           \
            _tile_dpbsud(0, 2, 4); _tile_dpbuud(1, 3, 4);                                  \
            _tile_dpbsud(5, 2, 7); _tile_dpbuud(6, 3, 7);                                  \
        }                                                                                  \
        _tile_stored(0, (cb), 64); _tile_stored(1, (cb) + 256, 64);                        \
        _tile_stored(5, (cb) + 512, 64); _tile_stored(6, (cb) + 768, 64);                  \
    } while (0)

QG_ALWAYS_INLINE static inline void amx_pair_epilogue(float *acc, const int32_t *c, const float *d0,
                                                      const float *m0, const float *d1, const float *m1,
                                                      const float *dx, const float *sx, int64_t nb, int64_t b,
                                                      int mins) {
    const __m512 db0 = _mm512_loadu_ps(d0 + b * QA_TILE), db1 = _mm512_loadu_ps(d1 + b * QA_TILE);
    const __m512 mb0 = mins ? _mm512_loadu_ps(m0 + b * QA_TILE) : _mm512_setzero_ps();
    const __m512 mb1 = mins ? _mm512_loadu_ps(m1 + b * QA_TILE) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < QA_TILE; r++) {
        const __m512 xs = _mm512_set1_ps(dx[r * nb + b]);
        const __m512i s0 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c + 16 * r), 8),
                                            _mm512_load_si512(c + 256 + 16 * r));
        const __m512i s1 = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(c + 512 + 16 * r), 8),
                                            _mm512_load_si512(c + 768 + 16 * r));
        __m512 a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_mul_ps(db0, xs), _mm512_load_ps(acc + 32 * r));
        __m512 a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_mul_ps(db1, xs), _mm512_load_ps(acc + 32 * r + 16));
        if (mins) {
            const __m512 ss = _mm512_set1_ps(sx[r * nb + b]);
            a0 = _mm512_fmadd_ps(mb0, ss, a0);
            a1 = _mm512_fmadd_ps(mb1, ss, a1);
        }
        _mm512_store_ps(acc + 32 * r, a0);
        _mm512_store_ps(acc + 32 * r + 16, a1);
    }
}

QG_ALWAYS_INLINE static inline void amx_strip_pair(const AmxArgs *aa, int64_t n0, const uint8_t *p0,
                                                   const float *d0, const float *m0, const uint8_t *p1,
                                                   const float *d1, const float *m1, int32_t *c, float *acc,
                                                   const int SIGNED_W) {
    const QArgs *a = aa->q;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK, M = a->num_rows;
    const int mins = aa->is_q4 && a->has_mins;
    for (int64_t i0 = 0; i0 < aa->padded_rows; i0 += QA_TILE) {
        memset(acc, 0, sizeof(float) * QA_TILE * 2 * QA_TILE);
        const int8_t *hi = aa->hi + i0 * K;
        const uint8_t *lo = aa->lo + i0 * K;
        const float *dx = aa->dx + i0 * nb, *sx = aa->sx + i0 * nb;
        for (int64_t b = 0; b < nb; b++) {
            int32_t *cb = c + (b & 1) * 1024;
            QA_PAIR_BLOCK(SIGNED_W, b, cb);
            if (b > 0) amx_pair_epilogue(acc, c + ((b - 1) & 1) * 1024, d0, m0, d1, m1, dx, sx, nb, b - 1, mins);
        }
        amx_pair_epilogue(acc, c + ((nb - 1) & 1) * 1024, d0, m0, d1, m1, dx, sx, nb, nb - 1, mins);
        for (int r = 0; r < QA_TILE && i0 + r < M; r++) {
            for (int h = 0; h < 2; h++) {
                const int64_t n = n0 + 16 * h;
                const __m512 bias = a->bias ? _mm512_loadu_ps(a->bias + n) : _mm512_setzero_ps();
                const __m512 out = _mm512_add_ps(_mm512_load_ps(acc + 32 * r + 16 * h), bias);
                if (a->dtype == DT_FLOAT32) {
                    _mm512_storeu_ps((float *)a->y + (i0 + r) * a->y_stride + n, out);
                } else {
                    _mm256_storeu_si256((__m256i *)((uint16_t *)a->y + (i0 + r) * a->y_stride + n),
                                        (__m256i)_mm512_cvtneps_pbh(out));
                }
            }
        }
    }
}

/* Strips s0 .. s1 - 1 (16 output rows each). */
static void amx_range(const void *p, int64_t s0, int64_t s1, float *scratch) {
    const AmxArgs *aa = (const AmxArgs *)p;
    const int64_t nb = aa->q->num_cols / QK_BLOCK;
    /* scratch, 64-byte aligned: two buffers of four C tiles (8 KB), the accumulators (2 KB), per
     * strip of a pair its panel (512 B per block), scales and mins */
    int32_t *c = (int32_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    float *acc = (float *)(c + 2048);
    uint8_t *panel0 = (uint8_t *)(acc + 512), *panel1 = panel0 + nb * 512;
    float *d0 = (float *)(panel1 + nb * 512), *m0 = d0 + nb * QA_TILE, *d1 = m0 + nb * QA_TILE, *m1 = d1 + nb * QA_TILE;
    const int signed_w = !aa->is_q4 || aa->q->high;
    amx_configure();
    int64_t s = s0;
    for (; s + 2 <= s1; s += 2) {
        amx_build_panel(aa, s * QA_TILE, panel0, d0, m0);
        amx_build_panel(aa, (s + 1) * QA_TILE, panel1, d1, m1);
        if (signed_w) amx_strip_pair(aa, s * QA_TILE, panel0, d0, m0, panel1, d1, m1, c, acc, 1);
        else amx_strip_pair(aa, s * QA_TILE, panel0, d0, m0, panel1, d1, m1, c, acc, 0);
    }
    if (s < s1) {
        amx_build_panel(aa, s * QA_TILE, panel0, d0, m0);
        if (signed_w) amx_strip(aa, s * QA_TILE, panel0, d0, m0, c, 1);
        else amx_strip(aa, s * QA_TILE, panel0, d0, m0, c, 0);
    }
    _tile_release();
}

/* The amx_int route of qg_matmul (qgemm.h): QG_BAD_LAYOUT when the CPU lacks AMX-INT8 or N is
 * not a multiple of 16. */
static int run_amx(QArgs *a, const void *x, int64_t x_stride, int is_q4) {
    const int64_t M = a->num_rows, K = a->num_cols, nb = K / QK_BLOCK, N = a->num_out;
    if (!cpu_allows(CPU_HAS_AMX_INT8) || N % QA_TILE != 0) return QG_BAD_LAYOUT;
    const int64_t Mp = (M + QA_TILE - 1) / QA_TILE * QA_TILE;
    char *buf = (char *)malloc(2 * (size_t)(Mp * K) + sizeof(float) * 2 * (size_t)(Mp * nb));
    if (buf == NULL) return QG_NO_MEMORY;
    float *dx = (float *)buf, *sx = dx + Mp * nb;
    int8_t *hi = (int8_t *)(sx + Mp * nb);
    uint8_t *lo = (uint8_t *)(hi + Mp * K);
    amx_quantize_rows(x, x_stride, M, Mp, K, a->dtype, hi, lo, dx, sx);
    AmxArgs aa = {a, hi, lo, dx, sx, Mp, is_q4};
    const size_t floats = 16 + 2048 + 512 + (size_t)nb * 2 * (512 / 4 + 2 * QA_TILE);
    int rc = cpu_parallel_for(amx_range, &aa, N / QA_TILE, Mp * N * K, floats);
    free(buf);
    return rc;
}
