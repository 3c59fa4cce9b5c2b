/* The packed strips (qgemm.h's QG_PACKED) on AVX2 (included once, inside qgemm.c's avx2 `#pragma GCC
 * target` region): the AVX-512 kernel's sums (qgemm_strip.h's packed_rows) with madd_epi16, 8 outputs
 * per vector, the same bits.
 *
 * A strip's 64-byte vectors hold 16 rows' lanes; a 256-bit vector is half of one: rows 0-7 (bytes 0-31)
 * or 8-15 (32-63). Each half of a strip runs as its own pass over the blocks (the second re-reads the
 * strip from L1 or L2). Per block and activation row: the codes widened to int16 pairs by the same
 * shifts and masks as the AVX-512 kernel, madd_epi16 against the row's pair of int16 codes (a 32-bit
 * broadcast) and add_epi32 (AVX2 has no vpdpwssd): the integer sum per output of qgemm_strip.h's, exact
 * in any order; then the same float32 operations in the same order (scale = d * dx, acc = sum * scale +
 * acc, acc = m * sx + acc, FMAs), so every ISA and every row count rounds alike. With QG_INT8, Q4 and
 * Q5 strips multiply bytes (packed8_rows_i8: maddubs_epi16, twice the multiply-adds of madd_epi16); Q8
 * and Q6_K strips sum the int8 codes stored as int16 in this kernel. Both are the same integers as
 * vpdpbusd's after its offset is taken off, so int8 activations give the AVX-512 kernel's bits.
 *
 * Per block, half and row the route issues 16 madd and 16 add over 256 multiply-adds (the int16 route
 * over row layouts: ~5 instructions per 64, with a cvt and an FMA per 8 lanes of partial sums), and the
 * decode (4 loads, 3 shifts, 4 ands per 64 codes) is shared by the pass's rows. */

/* Block b's 8 scales (or mins) of rows 8h .. 8h + 7 of a strip's scale region sc (packed_scale's
 * values; packed_block_scales' for a half). */
QG_ALWAYS_INLINE static inline __m256 packed8_block_scales(const uint8_t *sc, int64_t b, int half, int h) {
    if (half == QG_SCALES_SUPER) {
        const uint8_t *group = sc + b / 8 * 160;
        const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(group + 16 * h)));
        const __m128i q = _mm_loadl_epi64((const __m128i *)(group + 32 + (b % 8) * 16 + 8 * h));
        return _mm256_mul_ps(f, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)));
    }
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + b * 32 + 16 * h)));
    return _mm256_loadu_ps((const float *)sc + b * 16 + 8 * h);
}

/* acc [TR] (rows i0 .. i0 + TR - 1, outputs n0 .. n0 + 7) + bias -> y. */
QG_ALWAYS_INLINE static inline void packed8_store(const QArgs *a, int64_t n0, int64_t i0, const int TR, const __m256 *acc) {
    const __m256 bias = a->bias ? _mm256_loadu_ps(a->bias + n0) : _mm256_setzero_ps();
    for (int r = 0; r < TR; r++) {
        const __m256 out = _mm256_add_ps(acc[r], bias);
        if (a->dtype == DT_FLOAT32) {
            _mm256_storeu_ps((float *)a->y + (i0 + r) * a->y_stride + n0, out);
        } else {
            float v[8];
            _mm256_storeu_ps(v, out);
            uint16_t *dst = (uint16_t *)a->y + (i0 + r) * a->y_stride + n0;
            for (int n = 0; n < 8; n++) dst[n] = dt_f32_to_bf16(v[n]);
        }
    }
}

/* Q5's 16 sign bits of a half (bit k: 16-bit lane k) -> 16 where the bit is set, else 0. */
QG_ALWAYS_INLINE static inline __m256i packed8_sixteens(uint32_t bits) {
    const __m256i lane_bits = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                 16384, (short)0x8000);
    const __m256i m = _mm256_and_si256(_mm256_set1_epi16((short)bits), lane_bits);
    return _mm256_and_si256(_mm256_cmpeq_epi16(m, lane_bits), _mm256_set1_epi16(16));
}

/* PACKED_Q5I8's masks (qgemm.c's packed_sign8_at: bit 4j + k of a half's 32 bits set where byte k of
 * row j's lane holds a code that is not negative, byte k = t / 2 + 2p holding input 8v + 2t + p) -> for
 * shift t's pairs the int16 lanes (2j + p) of c - low = 16 * bit - 16. */
QG_ALWAYS_INLINE static inline __m256i packed8_q5i8_offsets(uint32_t bits, int t_half) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)bits), _mm256_add_epi32(shifts, _mm256_set1_epi32(t_half)));
    /* bit 0 -> 16 in the low half (p = 0), bit 2 -> 16 in the high half (p = 1) */
    const __m256i plus = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(1)), 4),
                                         _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(4)), 18));
    return _mm256_sub_epi16(plus, _mm256_set1_epi16(16));
}

/* Pair 4v + t of a Q4 / Q5 / Q5I8 block's half h (codes: the block's bytes, c: its vector v's 32 bytes):
 * the nibbles (c >> 4t) & 0x000F000F, Q5's minus 16 where its sign mask is set, Q5I8's plus 16 * bit - 16. */
QG_ALWAYS_INLINE static inline __m256i packed8_nibble_pair(const uint8_t *codes, __m256i c, int v, int t, int h,
                                                           const int FMT) {
    __m256i w = _mm256_and_si256(t ? _mm256_srli_epi32(c, 4 * t) : c, _mm256_set1_epi32(0x000F000F));
    if (FMT == PACKED_Q5) {
        uint32_t sign;
        memcpy(&sign, codes + 256 + 4 * (4 * v + t), 4);
        w = _mm256_sub_epi16(w, packed8_sixteens(sign >> (16 * h)));
    } else if (FMT == PACKED_Q5I8) {
        uint32_t plus;  /* half h's 32 bits of the vector's uint64 for t's parity */
        memcpy(&plus, codes + 256 + 16 * v + 8 * (t % 2) + 4 * h, 4);
        w = _mm256_add_epi16(w, packed8_q5i8_offsets(plus, t / 2));
    }
    return w;
}

/* Activation rows i0 .. i0 + TR - 1 against half h of one strip: y [i, n0 + 8h .. n0 + 8h + 7]. One row
 * sums into four accumulators, 2-3 rows into two each (add_epi32 chains), added exactly at the block's
 * end. FMT: PACKED_Q4, PACKED_Q5 or PACKED_Q8 (qgemm_strip.h's packed_rows; PACKED_Q5I8: packed8_rows_i8). */
QG_ALWAYS_INLINE static inline void packed8_rows(const QArgs *a, const uint8_t *strip, int64_t n0, int h, int64_t i0,
                                                 const int TR, const int MINS, const int FMT) {
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    const int half = a->half;
    const int NA = TR == 1 ? 4 : TR < 4 ? 2 : 1;
    const int64_t code_bytes = packed_code_bytes(FMT);
    const uint8_t *dsc = strip + nb * code_bytes, *msc = dsc + packed_scale_bytes(nb, half);
    const int64_t strip_bytes = packed_strip_bytes(FMT, nb, half, MINS), per_block = strip_bytes / nb;
    const int l2 = qg_prefetch_level() == QG_PREFETCH_L2;
    __m256 acc[QS_ROWS];
    const int32_t *x[QS_ROWS];
    for (int r = 0; r < TR; r++) {
        acc[r] = _mm256_setzero_ps();
        x[r] = (const int32_t *)(a->qx + (i0 + r) * K);  /* pairs of codes as words */
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *codes = strip + b * code_bytes;
        if (h == 0) packed_prefetch_block(strip, strip_bytes, per_block, b, l2);
        __m256i s[QS_ROWS][4];
        for (int r = 0; r < TR; r++)
            for (int k = 0; k < NA; k++) s[r][k] = _mm256_setzero_si256();
        if (FMT == PACKED_Q8) {
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) {
                const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + 64 * u + 32 * h));
                const __m256i w0 = _mm256_srai_epi16(_mm256_slli_epi16(c, 8), 8), w1 = _mm256_srai_epi16(c, 8);
                const int k = NA == 4 ? u % 4 : NA == 2 ? u % 2 : 0;
                for (int r = 0; r < TR; r++) {
                    const int32_t *xp = x[r] + b * (QK_BLOCK / 2) + 2 * u;
                    s[r][k] = _mm256_add_epi32(s[r][k], _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_set1_epi32(xp[0])),
                                                                         _mm256_madd_epi16(w1, _mm256_set1_epi32(xp[1]))));
                }
            }
        } else {
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) {
                const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + 64 * v + 32 * h));
                __m256i w[4];
                for (int t = 0; t < 4; t++) w[t] = packed8_nibble_pair(codes, c, v, t, h, FMT);
                const int k = NA == 4 ? v : NA == 2 ? v % 2 : 0;
                for (int r = 0; r < TR; r++) {
                    const int32_t *xp = x[r] + b * (QK_BLOCK / 2) + 4 * v;
                    const __m256i p01 = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_set1_epi32(xp[0])),
                                                         _mm256_madd_epi16(w[1], _mm256_set1_epi32(xp[1])));
                    const __m256i p23 = _mm256_add_epi32(_mm256_madd_epi16(w[2], _mm256_set1_epi32(xp[2])),
                                                         _mm256_madd_epi16(w[3], _mm256_set1_epi32(xp[3])));
                    s[r][k] = _mm256_add_epi32(s[r][k], _mm256_add_epi32(p01, p23));
                }
            }
        }
        const __m256 db = packed8_block_scales(dsc, b, half, h);
        const __m256 mb = MINS ? packed8_block_scales(msc, b, half, h) : _mm256_setzero_ps();
        for (int r = 0; r < TR; r++) {
            __m256i sum = s[r][0];
            for (int k = 1; k < NA; k++) sum = _mm256_add_epi32(sum, s[r][k]);
            const __m256 scale = _mm256_mul_ps(db, _mm256_set1_ps(a->dx[(i0 + r) * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r]);
            if (MINS) acc[r] = _mm256_fmadd_ps(mb, _mm256_set1_ps(a->sx[(i0 + r) * nb + b]), acc[r]);
        }
    }
    packed8_store(a, n0 + 8 * h, i0, TR, acc);
}

/* PACKED_Q5I8's masks of one half (bit 4j + k: byte k of row j's lane) -> 16 in each byte whose bit is set. */
QG_ALWAYS_INLINE static inline __m256i packed8_plus16(uint32_t bits) {
    const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i m = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), which), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(m, bit), _mm256_set1_epi8(16));
}

/* QG_INT8 on AVX2 for Q4 and PACKED_Q5I8 strips: the AVX-512 kernel's unsigned weight bytes (the nibbles
 * & 0x0F0F0F0F, then >> 4; Q5I8's plus 16 where the code is not negative) against four activation bytes
 * (qx8 in strip_quantize_rows8's order) by maddubs_epi16, vpdpbusd's products in int16 pairs: a pair is
 * at most 2 * 31 * 127 = 7874, so Q4's eight per block (30480) and Q5I8's four (31496) add up in int16
 * before one madd_epi16 by ones widens them. Exact integers, so the AVX-512 kernel's sums and bits (the
 * Q5I8 offset 16 times the block's code sum taken off the same way), with 9-10 multiplies per block
 * and row where the int16 codes take 16. */
QG_ALWAYS_INLINE static inline void packed8_rows_i8(const QArgs *a, const uint8_t *strip, int64_t n0, int h,
                                                    int64_t i0, const int TR, const int MINS, const int FMT) {
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    const int half = a->half;
    const int64_t code_bytes = packed_code_bytes(FMT);
    const uint8_t *dsc = strip + nb * code_bytes, *msc = dsc + packed_scale_bytes(nb, half);
    const int64_t strip_bytes = packed_strip_bytes(FMT, nb, half, MINS), per_block = strip_bytes / nb;
    const int l2 = qg_prefetch_level() == QG_PREFETCH_L2;
    const __m256i nibbles = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[QS_ROWS];
    const int32_t *x[QS_ROWS];
    for (int r = 0; r < TR; r++) {
        acc[r] = _mm256_setzero_ps();
        x[r] = (const int32_t *)(a->qx8 + (i0 + r) * K);  /* four codes a word */
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *codes = strip + b * code_bytes;
        if (h == 0) packed_prefetch_block(strip, strip_bytes, per_block, b, l2);
        __m256i s[QS_ROWS], p[QS_ROWS];
        for (int r = 0; r < TR; r++) s[r] = p[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + 64 * v + 32 * h));
            __m256i w0 = _mm256_and_si256(c, nibbles), w1 = _mm256_and_si256(_mm256_srli_epi16(c, 4), nibbles);
            if (FMT == PACKED_Q5I8) {
                uint64_t plus[2];  /* qg_pack_int8's masks of the vector's 16 rows: half h's 32 bits each */
                memcpy(plus, codes + 256 + 16 * v, sizeof plus);
                w0 = _mm256_add_epi8(w0, packed8_plus16((uint32_t)(plus[0] >> (32 * h))));
                w1 = _mm256_add_epi8(w1, packed8_plus16((uint32_t)(plus[1] >> (32 * h))));
            }
            for (int r = 0; r < TR; r++) {
                const int32_t *xp = x[r] + b * (QK_BLOCK / 4) + 2 * v;
                p[r] = _mm256_add_epi16(p[r], _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(xp[0])),
                                                               _mm256_maddubs_epi16(w1, _mm256_set1_epi32(xp[1]))));
            }
            if (v == 3 || (FMT == PACKED_Q5I8 && v == 1)) {  /* Q5I8: four pairs of up to 7874 at most */
                for (int r = 0; r < TR; r++) {
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p[r], ones));
                    p[r] = _mm256_setzero_si256();
                }
            }
        }
        const __m256 db = packed8_block_scales(dsc, b, half, h);
        const __m256 mb = MINS ? packed8_block_scales(msc, b, half, h) : _mm256_setzero_ps();
        for (int r = 0; r < TR; r++) {
            __m256i sum = s[r];
            if (FMT == PACKED_Q5I8) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(16 * a->isx[(i0 + r) * nb + b]));
            const __m256 scale = _mm256_mul_ps(db, _mm256_set1_ps(a->dx[(i0 + r) * nb + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r]);
            if (MINS) acc[r] = _mm256_fmadd_ps(mb, _mm256_set1_ps(a->sx[(i0 + r) * nb + b]), acc[r]);
        }
    }
    packed8_store(a, n0 + 8 * h, i0, TR, acc);
}

/* Input pair p (0..15) of a PACKED_Q6 block's six words as signed int16 pairs q - 32 of rows 8h .. 8h + 7
 * (qgemm_strip.h's q6_pair, signed). */
QG_ALWAYS_INLINE static inline __m256i q6_pair8(const uint8_t *codes, int p, int h) {
    if (p < 12) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(codes + 64 * (p / 2) + 32 * h));
        return _mm256_srai_epi16(_mm256_slli_epi16(u, p % 2 ? 4 : 10), 10);
    }
    const int m = p - 12;
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(codes + 64 * m + 32 * h));
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(codes + 64 * (4 + m / 2) + 32 * h));
    const __m256i nib = _mm256_srli_epi16(lo, 12);  /* the low 4 bits, zero above */
    const __m256i top = _mm256_srai_epi16(m % 2 ? hi : _mm256_slli_epi16(hi, 2), 10);  /* bits 4-5, sign above */
    return _mm256_or_si256(nib, _mm256_andnot_si256(_mm256_set1_epi32(0x000F000F), top));
}

/* packed8_rows for PACKED_Q6 (qgemm_strip.h's packed_rows_q6): each group of 16 inputs sums apart, then
 * t = sum0 * (d * s0), t = sum1 * (d * s1) + t, acc = t * dx + acc. */
QG_ALWAYS_INLINE static inline void packed8_rows_q6(const QArgs *a, const uint8_t *strip, int64_t n0, int h, int64_t i0,
                                                    const int TR) {
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    const int NA = TR < 4 ? 2 : 1;
    const uint8_t *ssc = strip + nb * 384, *dsc = ssc + 2 * nb * 16;
    const int64_t strip_bytes = nb * 420, per_block = 420;
    const int l2 = qg_prefetch_level() == QG_PREFETCH_L2;
    __m256 acc[QS_ROWS];
    const int32_t *x[QS_ROWS];
    for (int r = 0; r < TR; r++) {
        acc[r] = _mm256_setzero_ps();
        x[r] = (const int32_t *)(a->qx + (i0 + r) * K);
    }
    __m256 d = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *codes = strip + b * 384;
        if (h == 0) packed_prefetch_block(strip, strip_bytes, per_block, b, l2);
        if (b % 8 == 0) d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(dsc + b / 8 * 32 + 16 * h)));
        __m256i s[QS_ROWS][2][2];
        for (int r = 0; r < TR; r++)
            for (int g = 0; g < 2; g++)
                for (int k = 0; k < NA; k++) s[r][g][k] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int q = 0; q < 16; q++) {
            const int p = (q % 2) * 8 + q / 2;  /* the groups' pairs in turn: 0, 8, 1, 9, ... */
            const __m256i w = q6_pair8(codes, p, h);
            const int g = p / 8, k = NA == 2 ? (q / 2) % 2 : 0;
            for (int r = 0; r < TR; r++)
                s[r][g][k] = _mm256_add_epi32(s[r][g][k], _mm256_madd_epi16(w, _mm256_set1_epi32(x[r][b * (QK_BLOCK / 2) + p])));
        }
        __m256 ds[2];
        for (int g = 0; g < 2; g++) {
            const __m128i sc = _mm_loadl_epi64((const __m128i *)(ssc + (2 * b + g) * 16 + 8 * h));
            ds[g] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        }
        for (int r = 0; r < TR; r++) {
            __m256 f[2];
            for (int g = 0; g < 2; g++)
                f[g] = _mm256_cvtepi32_ps(NA == 2 ? _mm256_add_epi32(s[r][g][0], s[r][g][1]) : s[r][g][0]);
            const __m256 t = _mm256_fmadd_ps(f[1], ds[1], _mm256_mul_ps(f[0], ds[0]));
            acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(a->dx[(i0 + r) * nb + b]), acc[r]);
        }
    }
    packed8_store(a, n0 + 8 * h, i0, TR, acc);
}

typedef void (*Packed8Pass)(const QArgs *a, const uint8_t *strip, int64_t n0, int h, int64_t i0, int64_t rows);

/* One pass of 1 .. QS_ROWS activation rows over half a strip, in a function of its own per format. */
#define QS_PACKED8_PASS(NAME, MINS, FMT)                                                                  \
    __attribute__((noinline)) static void NAME(const QArgs *a, const uint8_t *strip, int64_t n0, int h,   \
                                               int64_t i0, int64_t rows) {                                \
        enum { R_MINS = MINS, R_FMT = FMT };                                                              \
        switch (rows) {                                                                                   \
        QS_PASSES(QS_PACKED8_PASS_CASE)                                                                   \
        default: break;                                                                                   \
        }                                                                                                 \
    }
#define QS_PACKED8_PASS_CASE(TR) case TR: packed8_rows(a, strip, n0, h, i0, TR, R_MINS, R_FMT); break;
QS_PACKED8_PASS(packed8_pass_q8, 0, PACKED_Q8)
QS_PACKED8_PASS(packed8_pass_q5_mins, 1, PACKED_Q5)
QS_PACKED8_PASS(packed8_pass_q5, 0, PACKED_Q5)
QS_PACKED8_PASS(packed8_pass_q4_mins, 1, PACKED_Q4)
QS_PACKED8_PASS(packed8_pass_q4, 0, PACKED_Q4)
#undef QS_PACKED8_PASS_CASE
#define QS_PACKED8_PASS_CASE(TR) case TR: packed8_rows_i8(a, strip, n0, h, i0, TR, R_MINS, R_FMT); break;
QS_PACKED8_PASS(packed8_pass_q5i8_bytes_mins, 1, PACKED_Q5I8)
QS_PACKED8_PASS(packed8_pass_q5i8_bytes, 0, PACKED_Q5I8)
QS_PACKED8_PASS(packed8_pass_q4_bytes_mins, 1, PACKED_Q4)
QS_PACKED8_PASS(packed8_pass_q4_bytes, 0, PACKED_Q4)
#undef QS_PACKED8_PASS
#undef QS_PACKED8_PASS_CASE
__attribute__((noinline)) static void packed8_pass_q6(const QArgs *a, const uint8_t *strip, int64_t n0, int h,
                                                      int64_t i0, int64_t rows) {
    switch (rows) {
#define QS_Q6_PASS8_CASE(TR) case TR: packed8_rows_q6(a, strip, n0, h, i0, TR); break;
    QS_PASSES(QS_Q6_PASS8_CASE)
#undef QS_Q6_PASS8_CASE
    default: break;
    }
}

/* Strips s0 .. s1 - 1 of a packed product (run_packed in qgemm.c): each half of a strip
 * against every activation row, in as few passes as QS_ROWS allows (QS_SPLIT). */
static void packed_range_avx2(const void *p, int64_t s0, int64_t s1, float *scratch) {
    (void)scratch;
    const QArgs *a = (const QArgs *)p;
    const int64_t strip_bytes = packed_strip_bytes(a->packed, a->num_cols / QK_BLOCK, a->half, a->has_mins);
    Packed8Pass pass;
    if (a->packed == PACKED_Q6) pass = packed8_pass_q6;
    else if (a->packed == PACKED_Q8) pass = packed8_pass_q8;
    else if (a->packed == PACKED_Q5) pass = a->has_mins ? packed8_pass_q5_mins : packed8_pass_q5;
    else if (a->packed == PACKED_Q5I8) pass = a->has_mins ? packed8_pass_q5i8_bytes_mins : packed8_pass_q5i8_bytes;
    else if (a->qx8) pass = a->has_mins ? packed8_pass_q4_bytes_mins : packed8_pass_q4_bytes;
    else pass = a->has_mins ? packed8_pass_q4_mins : packed8_pass_q4;
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t *strip = a->blocks + s * strip_bytes;
        for (int h = 0; h < 2; h++) QS_SPLIT(a->num_rows, pass(a, strip, s * QS_TILE, h, i0, rows))
    }
}

/* x [M, K] -> qx [M, K] int16, dx, sx [M, K / 32]: quantize_rows' codes and scales with strip_order
 * (codes round half to even through MXCSR, as nearbyintf; sx in strip_order_sum's order, the exact
 * sum; int8: |q| <= 127 and sx = dx * the codes' sum), 8 lanes at a time. With qx8 (int8 only) the
 * codes go there as bytes instead, in strip_quantize_rows8's order for Q4 and Q5 strips (per 8 inputs
 * e0 e4 e1 e5 e2 e6 e3 e7), and each block's code sum to isx. */
static void packed_quantize_rows_avx2(const void *x, int64_t x_stride, int64_t num_rows, int64_t num_cols, int dtype,
                                      int16_t *qx, float *dx, float *sx, int int8, int8_t *qx8, int32_t *isx) {
    const __m256i order = _mm256_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
                                           0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    const int64_t nb = num_cols / QK_BLOCK;
    const float xmax = int8 ? 127.0f : QG_XMAX;
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int64_t i = 0; i < num_rows; i++) {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = i * x_stride + b * QK_BLOCK;
            __m256 v[4];
            for (int k = 0; k < 4; k++) {
                if (dtype == DT_FLOAT32) {
                    v[k] = _mm256_loadu_ps((const float *)x + at + 8 * k);
                } else {
                    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at + 8 * k));
                    v[k] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
                }
            }
            __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], sign), _mm256_and_ps(v[1], sign)),
                                     _mm256_max_ps(_mm256_and_ps(v[2], sign), _mm256_and_ps(v[3], sign)));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            const float d = amax / xmax;
            const __m256 inv = _mm256_set1_ps(amax > 0.0f ? xmax / amax : 0.0f);
            __m256i q[4];
            for (int k = 0; k < 4; k++) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));
            /* packs interleave 128-bit lanes: 0xD8 puts them back */
            const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
            const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
            if (qx8) {
                const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(lo, hi), 0xD8);
                _mm256_storeu_si256((__m256i *)(qx8 + i * num_cols + b * QK_BLOCK), _mm256_shuffle_epi8(bytes, order));
            } else {
                int16_t *codes = qx + i * num_cols + b * QK_BLOCK;
                _mm256_storeu_si256((__m256i *)codes, lo);
                _mm256_storeu_si256((__m256i *)(codes + 16), hi);
            }
            dx[i * nb + b] = d;
            if (int8) {
                const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
                const int32_t code_sum = _mm_cvtsi128_si32(s4);
                if (isx) isx[i * nb + b] = code_sum;
                sx[i * nb + b] = d * (float)code_sum;
            } else {  /* strip_order_sum: t[i] = v[i] + v[16 + i], then t[8 + i] + t[i], t[4 + i] + t[i], pairs */
                const __m256 t = _mm256_add_ps(_mm256_add_ps(v[1], v[3]), _mm256_add_ps(v[0], v[2]));
                const __m128 t4 = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
                float f[4];
                _mm_storeu_ps(f, t4);
                sx[i * nb + b] = (f[0] + f[2]) + (f[1] + f[3]);
            }
        }
    }
}

/* Block b of half h of a strip (format FMT) -> its 16 int16 pair vectors: lane 2j + p of pairs[P] holds
 * input 2P + p of row 8h + j (the kernels' shifts and masks). */
static void packed8_block_pairs(const uint8_t *strip, int64_t b, int h, int FMT, __m256i *pairs) {
    const uint8_t *codes = strip + b * packed_code_bytes(FMT);
    if (FMT == PACKED_Q6) {
        for (int p = 0; p < 16; p++) pairs[p] = q6_pair8(codes, p, h);
        return;
    }
    if (FMT == PACKED_Q8) {
        for (int u = 0; u < 8; u++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + 64 * u + 32 * h));
            pairs[2 * u] = _mm256_srai_epi16(_mm256_slli_epi16(c, 8), 8);
            pairs[2 * u + 1] = _mm256_srai_epi16(c, 8);
        }
        return;
    }
    for (int v = 0; v < 4; v++) {
        const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + 64 * v + 32 * h));
        for (int t = 0; t < 4; t++) pairs[4 * v + t] = packed8_nibble_pair(codes, c, v, t, h, FMT);
    }
}

typedef struct {
    int packed, half, has_mins;
    const uint8_t *w;
    int64_t first, count, num_cols;
    void *out;
    int out_dtype;
} PackedDqArgs;

/* Strips first / 16 + [s0, s1) of a dequantize call (PackedDqArgs) -> their rows within first .. first +
 * count - 1: dequantize_packed's values (d * q, then + m; Q6: (d * s) * q), 16 at a time. */
static void dequantize_packed_range_avx2(const void *p, int64_t s0, int64_t s1, float *scratch) {
    (void)scratch;
    const PackedDqArgs *a = (const PackedDqArgs *)p;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK, end = a->first + a->count;
    const int packed = a->packed, mins = packed_mins(packed, a->has_mins);
    const int64_t strip_bytes = packed_strip_bytes(packed, nb, a->half, a->has_mins);
    for (int64_t s = a->first / 16 + s0; s < a->first / 16 + s1; s++) {
        const uint8_t *strip = a->w + s * strip_bytes;
        for (int h = 0; h < 2; h++) {
            const int64_t lo = 16 * s + 8 * h < a->first ? a->first : 16 * s + 8 * h;
            const int64_t hi = 16 * s + 8 * h + 8 > end ? end : 16 * s + 8 * h + 8;
            if (lo >= hi) continue;
            for (int64_t b = 0; b < nb; b++) {
                uint32_t words[16][8];  /* [pair][row]: a row's two codes of the pair */
                __m256i pairs[16];
                packed8_block_pairs(strip, b, h, packed, pairs);
                for (int q = 0; q < 16; q++) _mm256_storeu_si256((__m256i *)words[q], pairs[q]);
                for (int64_t n = lo; n < hi; n++) {
                    const int j = (int)(n - 16 * s);
                    uint32_t row[16];
                    for (int q = 0; q < 16; q++) row[q] = words[q][j - 8 * h];
                    const __m256i c0 = _mm256_loadu_si256((const __m256i *)row);
                    const __m256i c1 = _mm256_loadu_si256((const __m256i *)(row + 8));
                    const int64_t at = (n - a->first) * K + b * QK_BLOCK;
                    if (packed == PACKED_Q6) {
                        store16_avx2(c0, _mm256_set1_ps(q6_packed_scale(strip, nb, 2 * b, j)), _mm256_setzero_ps(),
                                     a->out, at, a->out_dtype);
                        store16_avx2(c1, _mm256_set1_ps(q6_packed_scale(strip, nb, 2 * b + 1, j)), _mm256_setzero_ps(),
                                     a->out, at + 16, a->out_dtype);
                    } else {
                        const __m256 d = _mm256_set1_ps(packed_scale(packed, strip, nb, b, j, a->half, 0));
                        const __m256 m = mins ? _mm256_set1_ps(packed_scale(packed, strip, nb, b, j, a->half, 1))
                                              : _mm256_setzero_ps();
                        store16_avx2(c0, d, m, a->out, at, a->out_dtype);
                        store16_avx2(c1, d, m, a->out, at + 16, a->out_dtype);
                    }
                }
            }
        }
    }
}
