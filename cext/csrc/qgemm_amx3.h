/* The amx3 route of qgemm.c over QG_PACKED strips (included once, inside a `#pragma GCC target`
 * region with AVX-512 BF16 and AMX-BF16, after qgemm_strip.h and qgemm_amx.h): three bfloat16
 * products on AMX tiles, float32 sums over the whole of K.
 *
 * Why not integer tiles: their block scales change every 32 inputs, so each block's int32 tiles
 * must leave the tile registers to be scaled (qgemm_amx.h), and that epilogue, not the multiply,
 * sets the pace. Here the scales go into the weights instead: each weight w = d * c (+ m), as the
 * float route dequantizes it in float32, is split into two bfloat16, w = wh + wl (wh = w rounded to
 * bfloat16, wl = w - wh rounded again), and so is each activation, x = xh + xl. Then
 *     y = xh . wh + xh . wl + xl . wh
 * on `tdpbf16ps`, which sums in float32; the C tiles stay in their registers from the first
 * block to the last, and only the final 16 x 16 sums are stored. Each of w and x keeps 16
 * significant bits (relative error <= 2^-17; the weights of Q4, Q5, Q8 and Q6 codes times fp16
 * scales have at most 15-17), and the dropped xl . wl is below 2^-16 of each term: the same order
 * as the int16 route's rounding of x to 2^-16 of its block's largest value. Every row's sums run
 * in the same order whatever the row count (rows of padding are zero), so a row's output does not
 * depend on the others.
 *
 * Work: the activations are split across cpu.h's pool (row tiles), then pairs of output strips of
 * 16. Per group of strips their weights are laid out once per call as bfloat16 tiles (a panel per
 * strip: per block of 32 inputs a 16 x 64-byte tile of wh, then one of wl, the tiles' pairs order:
 * row p = inputs 2p, 2p + 1 of the 16 outputs), then every 16-row tile of activations runs against
 * the group's strips two at a time (8 tiles: C for two strips, xh and xl, wh and wl of each strip).
 * Where the activations' tiles outgrow L2 (a long K: down products) K runs in chunks: per chunk the
 * group's panels are laid out for the chunk's blocks only (so they stay in L2 while the rows pass,
 * each block still laid out once), the pool's items are a few long runs of strips (each run reads
 * all the activations once per group), and the C tiles' float32 sums wait in memory between chunks
 * (stored and loaded as they are: the same bits as one pass). */

#define Q3_TILE 16
#define Q3_PANEL_BYTES (512 << 10)  /* a group's panels at most (L2), at least two strips */
#define Q3_ACT_BYTES (2 << 20)    /* activations' tiles up to this: K in one chunk (an AMX Xeon core's L2) */
#define Q3_CHUNK_ACT_BYTES (512 << 10)  /* else K in chunks of this much of the activations' tiles, */
#define Q3_CHUNK_PANEL_BYTES (1 << 20)  /* against groups of strips with this much of panels a chunk, */
#define Q3_ITEMS_PER_THREAD 2  /* in this many pool items a thread */

typedef struct {
    const QArgs *q;
    const void *x;            /* the activations, [M, K] at x_stride, float32 or bfloat16 */
    int64_t x_stride;
    uint16_t *xh, *xl;        /* [Mp, K] bfloat16 bits */
    int64_t padded_rows;
    int64_t group;            /* strips per panel group (even) */
    int64_t chunk;            /* blocks of K per chunk */
    int64_t pairs_per_item;   /* pairs of strips per pool item */
} Amx3Args;

/* float32 -> bfloat16 bits (round to nearest even). */
QG_ALWAYS_INLINE static inline __m256i q3_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

/* x [M, K] -> xh, xl bfloat16 in tile order: row i's block b (32 values) at ((i / 16) nb + b) 512 +
 * (i % 16) 32, so a tile load reads 1 KB in order; rows M .. Mp - 1 zero. bfloat16 x: xl = 0. */
static void amx3_split_rows(const void *x, int64_t x_stride, int64_t num_rows, int64_t padded_rows, int64_t num_cols,
                            int dtype, uint16_t *xh, uint16_t *xl) {
    const int64_t nb = num_cols / QK_BLOCK;
    for (int64_t i = 0; i < padded_rows; i++) {
        for (int64_t b = 0; b < nb; b++) {
            const int64_t at = ((i / Q3_TILE) * nb + b) * 512 + (i % Q3_TILE) * QK_BLOCK;
            uint16_t *h = xh + at, *l = xl + at;
            if (i >= num_rows) {
                memset(h, 0, sizeof(uint16_t) * QK_BLOCK);
                memset(l, 0, sizeof(uint16_t) * QK_BLOCK);
            } else if (dtype != DT_FLOAT32) {
                memcpy(h, (const uint16_t *)x + i * x_stride + b * QK_BLOCK, sizeof(uint16_t) * QK_BLOCK);
                memset(l, 0, sizeof(uint16_t) * QK_BLOCK);
            } else {
                const float *row = (const float *)x + i * x_stride + b * QK_BLOCK;
                __m512i hv, lv;
                amx_split32(_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16), &hv, &lv);
                _mm512_storeu_si512((void *)h, hv);
                _mm512_storeu_si512((void *)l, lv);
            }
        }
    }
}

/* Pair p of a block as int16 pairs of the 16 rows (even input in each lane's low half) -> the
 * weights d * c + m (multiply, then add: as dequantize_packed) split into the panel's row p of
 * its wh tile and of its wl tile: bfloat16 pairs (even input in the low half of each 32-bit lane),
 * from vcvtne2ps2bf16's halves put in that order by one vpermw. */
QG_ALWAYS_INLINE static inline void q3_store_pair(__m512i pair, __m512 d, __m512 m, int mins, uint8_t *wh,
                                                 uint8_t *wl, int p) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high_half = _mm512_set1_epi32((int)0xFFFF0000u);
    __m512 even = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16)), d);
    __m512 odd = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(pair, 16)), d);
    if (mins) { even = _mm512_add_ps(even, m); odd = _mm512_add_ps(odd, m); }
    const __m512i hi = _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
    const __m512 he = _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16));  /* wh as float32 */
    const __m512 ho = _mm512_castsi512_ps(_mm512_and_si512(hi, high_half));
    const __m512i lo = _mm512_permutexvar_epi16(
        order, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(odd, ho), _mm512_sub_ps(even, he)));
    _mm512_store_si512((void *)(wh + 64 * p), hi);
    _mm512_store_si512((void *)(wl + 64 * p), lo);
}

/* Blocks b0 .. b1 - 1 of one strip -> its panel: block b at panel + 2048 (b - b0), the wh tile
 * then the wl tile. */
static void amx3_build_panel(const QArgs *a, const uint8_t *strip, uint8_t *panel, int64_t b0, int64_t b1) {
    const int64_t nb = a->num_cols / QK_BLOCK;
    const int packed = a->packed, half = a->half;
    const __m512i mask = _mm512_set1_epi32(0x000F000F), sixteen = _mm512_set1_epi16(16);
    if (packed == PACKED_Q6) {
        const uint8_t *sc = strip + nb * 384, *dd = sc + 2 * nb * 16;
        for (int64_t b = b0; b < b1; b++) {
            uint8_t *wh = panel + 2048 * (b - b0), *wl = wh + 1024;
            for (int g = 0; g < 2; g++) {  /* d * s per group of 16 inputs (pairs 8 g .. 8 g + 7) */
                const int64_t group = 2 * b + g;
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(dd + (group / 16) * 32)));
                const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + group * 16))));
                const __m512 scale = _mm512_mul_ps(d, s);
                for (int p = 8 * g; p < 8 * g + 8; p++)
                    q3_store_pair(q6_pair(strip + b * 384, p, 0), scale, scale, 0, wh, wl, p);
            }
        }
        return;
    }
    const int mins = packed_mins(packed, a->has_mins);
    const int64_t code_bytes = packed_code_bytes(packed);
    const uint8_t *dsc = strip + nb * code_bytes, *msc = dsc + packed_scale_bytes(nb, half);
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *codes = strip + b * code_bytes;
        uint8_t *wh = panel + 2048 * (b - b0), *wl = wh + 1024;
        const __m512 d = packed_block_scales(dsc, b, half);
        const __m512 m = mins ? packed_block_scales(msc, b, half) : _mm512_setzero_ps();
        if (packed == PACKED_Q8) {  /* vector u: pairs 2u (bytes 0, 2 of each lane) and 2u + 1 (1, 3) */
            for (int u = 0; u < 8; u++) {
                const __m512i c = _mm512_loadu_si512((const void *)(codes + 64 * u));
                q3_store_pair(_mm512_srai_epi16(_mm512_slli_epi16(c, 8), 8), d, m, 0, wh, wl, 2 * u);
                q3_store_pair(_mm512_srai_epi16(c, 8), d, m, 0, wh, wl, 2 * u + 1);
            }
            continue;
        }
        for (int v = 0; v < 4; v++) {  /* Q4, Q5: vector v, nibble pair t = pair 4 v + t */
            const __m512i c = _mm512_loadu_si512((const void *)(codes + 64 * v));
            for (int t = 0; t < 4; t++) {
                __m512i w = _mm512_and_si512(_mm512_srli_epi32(c, 4 * t), mask);
                if (packed == PACKED_Q5) {
                    const uint32_t *sign = (const uint32_t *)(codes + 256) + 4 * v;
                    w = _mm512_mask_sub_epi16(w, _cvtu32_mask32(sign[t]), w, sixteen);
                }
                q3_store_pair(w, d, m, mins, wh, wl, 4 * v + t);
            }
        }
    }
}

/* y rows i0 .. i0 + 15 (those below M), outputs n0 .. n0 + 15, from the sums c (16 rows of 16). */
static void amx3_store(const QArgs *a, const float *c, int64_t i0, int64_t n0) {
    const __m512 bias = a->bias ? _mm512_loadu_ps(a->bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < Q3_TILE && i0 + r < a->num_rows; r++) {
        const __m512 out = _mm512_add_ps(_mm512_load_ps(c + 16 * r), bias);
        if (a->dtype == DT_FLOAT32) {
            _mm512_storeu_ps((float *)a->y + (i0 + r) * a->y_stride + n0, out);
        } else {
            _mm256_storeu_si256((__m256i *)((uint16_t *)a->y + (i0 + r) * a->y_stride + n0), q3_bf16(out));
        }
    }
}

/* Where the C tiles of (strip s of the group, rows i0 .. i0 + 31) keep their sums between K chunks
 * (K in one chunk: the same 2 KB for every strip, stored once each). */
static inline float *q3_sums(const Amx3Args *aa, float *sums, int64_t s, int64_t i0) {
    const int64_t nb = aa->q->num_cols / QK_BLOCK;
    return aa->chunk >= nb ? sums + (s & 1) * 2 * 256 : sums + (s * aa->padded_rows + i0) * Q3_TILE;
}

/* Floats of a range's sums: [group][Mp][16], or four C tiles where K is one chunk. */
static inline int64_t q3_sums_floats(const Amx3Args *aa) {
    const int64_t nb = aa->q->num_cols / QK_BLOCK;
    return aa->chunk >= nb ? 4 * 256 : aa->group * aa->padded_rows * Q3_TILE;
}

/* One 16-row tile of activations against one or two strips' panels (p1 NULL: one strip; block pb
 * first in them) over blocks b0 .. b1 - 1, in the order amx3_tile_rows2 sums each C tile (xh . wl,
 * xh . wh, xl . wh per block): the same bits a row. The C tiles start at zero (b0 = 0) or from
 * their sums (s0, s1) and end there, or in y after the last block. */
static void amx3_tile_rows(const Amx3Args *aa, int64_t i0, int64_t n0, int64_t b0, int64_t b1, const uint8_t *p0,
                           const uint8_t *p1, int64_t pb, float *s0, float *s1) {
    const QArgs *a = aa->q;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    const uint16_t *xh = aa->xh + i0 * K, *xl = aa->xl + i0 * K;  /* tile order: block b at b * 512 */
    if (b0 == 0) _tile_zero(0); else _tile_loadd(0, s0, 64);
    if (p1 != NULL) {
        if (b0 == 0) _tile_zero(1); else _tile_loadd(1, s1, 64);
        for (int64_t b = b0; b < b1; b++) {
            _tile_loadd(4, xh + b * 512, 64);
            _tile_loadd(5, xl + b * 512, 64);
            _tile_loadd(6, p0 + 2048 * (b - pb) + 1024, 64);
            _tile_loadd(7, p1 + 2048 * (b - pb) + 1024, 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, p0 + 2048 * (b - pb), 64);
            _tile_loadd(7, p1 + 2048 * (b - pb), 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(0, 5, 6); _tile_dpbf16ps(1, 5, 7);
        }
        _tile_stored(1, s1, 64);
        if (b1 == nb) amx3_store(a, s1, i0, n0 + Q3_TILE);
    } else {
        for (int64_t b = b0; b < b1; b++) {
            _tile_loadd(4, xh + b * 512, 64);
            _tile_loadd(5, xl + b * 512, 64);
            _tile_loadd(7, p0 + 2048 * (b - pb) + 1024, 64);
            _tile_loadd(6, p0 + 2048 * (b - pb), 64);
            _tile_dpbf16ps(0, 4, 7);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(0, 5, 6);
        }
    }
    _tile_stored(0, s0, 64);
    if (b1 == nb) amx3_store(a, s0, i0, n0);
}

/* Two 16-row tiles of activations (rows i0 .. i0 + 31) against two strips' panels (block pb first
 * in them) over blocks b0 .. b1 - 1: four C tiles, each block's tiles loaded into the four operand
 * registers in an order that keeps each loaded tile for two or four products (8 loads for 12
 * products): xh . wl, then xh . wh, then xl . wh. Sums of strip 0 at s0 (rows i0 ..), of strip 1 at
 * s1. */
static void amx3_tile_rows2(const Amx3Args *aa, int64_t i0, int64_t n0, int64_t b0, int64_t b1, const uint8_t *p0,
                            const uint8_t *p1, int64_t pb, float *s0, float *s1) {
    const QArgs *a = aa->q;
    const int64_t K = a->num_cols, nb = K / QK_BLOCK;
    const uint16_t *xh0 = aa->xh + i0 * K, *xl0 = aa->xl + i0 * K;
    const uint16_t *xh1 = xh0 + Q3_TILE * K, *xl1 = xl0 + Q3_TILE * K;
    float *c[4] = {s0, s1, s0 + 256, s1 + 256};  /* C (row tile, strip): 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1) */
    if (b0 == 0) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    } else {
        _tile_loadd(0, c[0], 64); _tile_loadd(1, c[1], 64); _tile_loadd(2, c[2], 64); _tile_loadd(3, c[3], 64);
    }
    for (int64_t b = b0; b < b1; b++) {
        _tile_loadd(4, xh0 + b * 512, 64);
        _tile_loadd(5, xh1 + b * 512, 64);
        _tile_loadd(6, p0 + 2048 * (b - pb) + 1024, 64);
        _tile_loadd(7, p1 + 2048 * (b - pb) + 1024, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(6, p0 + 2048 * (b - pb), 64);
        _tile_loadd(7, p1 + 2048 * (b - pb), 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(4, xl0 + b * 512, 64);
        _tile_loadd(5, xl1 + b * 512, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64); _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
    if (b1 == nb)
        for (int t = 0; t < 4; t++) amx3_store(a, c[t], i0 + Q3_TILE * (t / 2), n0 + Q3_TILE * (t % 2));
}

/* Pool items p0 .. p1 - 1 (pairs of strips, aa->pairs_per_item an item; strips 2 p0 .. min(2 p1,
 * strips) - 1 at one pair an item): in groups of aa->group strips, per chunk of aa->chunk blocks of
 * K, the group's panels for the chunk's blocks built, then every pair of strips against every row
 * tile (two at a time), the C tiles' sums kept between chunks in the group's sums buffer. Each
 * strip's blocks are laid out once per call, and a chunk's panels stay in L2 while the rows pass. */
static void amx3_range(const void *p, int64_t p0, int64_t p1, float *scratch) {
    const Amx3Args *aa = (const Amx3Args *)p;
    const QArgs *a = aa->q;
    const int64_t nb = a->num_cols / QK_BLOCK, strips = a->num_out / Q3_TILE, Mp = aa->padded_rows;
    const int64_t strip_bytes = packed_strip_bytes(a->packed, nb, a->half, a->has_mins);
    const int64_t s0 = 2 * p0 * aa->pairs_per_item, e1 = 2 * p1 * aa->pairs_per_item, s1 = e1 < strips ? e1 : strips;
    float *sums = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);  /* [group][Mp][16] */
    uint8_t *panels = (uint8_t *)(sums + q3_sums_floats(aa));  /* [group][chunk] blocks of 2 KB */
    amx_configure_square();  /* 0-3 C; 4-7 A and B (amx3_tile_rows2) */
    for (int64_t g0 = s0; g0 < s1; g0 += aa->group) {
        const int64_t g1 = g0 + aa->group < s1 ? g0 + aa->group : s1;
        for (int64_t b0 = 0; b0 < nb; b0 += aa->chunk) {
            const int64_t b1 = b0 + aa->chunk < nb ? b0 + aa->chunk : nb, span = (b1 - b0) * 2048;
            for (int64_t s = g0; s < g1; s++)
                amx3_build_panel(a, a->blocks + s * strip_bytes, panels + (s - g0) * span, b0, b1);
            for (int64_t i0 = 0; i0 < Mp; i0 += 2 * Q3_TILE) {
                const int two_tiles = i0 + Q3_TILE < Mp;
                for (int64_t s = g0; s < g1; s += 2) {
                    const uint8_t *q0 = panels + (s - g0) * span, *q1 = s + 1 < g1 ? q0 + span : NULL;
                    float *c0 = q3_sums(aa, sums, s - g0, i0), *c1 = q3_sums(aa, sums, s + 1 - g0, i0);
                    if (two_tiles && q1 != NULL) {
                        amx3_tile_rows2(aa, i0, s * Q3_TILE, b0, b1, q0, q1, b0, c0, c1);
                    } else {
                        amx3_tile_rows(aa, i0, s * Q3_TILE, b0, b1, q0, q1, b0, c0, c1);
                        if (two_tiles)
                            amx3_tile_rows(aa, i0 + Q3_TILE, s * Q3_TILE, b0, b1, q0, q1, b0, c0 + 256, c1 + 256);
                    }
                }
            }
        }
    }
    _tile_release();
}

/* Row tiles t0 .. t1 - 1 of x split into xh and xl (amx3_split_rows). */
static void amx3_split_range(const void *p, int64_t t0, int64_t t1, float *scratch) {
    const Amx3Args *aa = (const Amx3Args *)p;
    const QArgs *a = aa->q;
    const int64_t K = a->num_cols, first = t0 * Q3_TILE;
    const int64_t rows = a->num_rows - first < (t1 - t0) * Q3_TILE ? a->num_rows - first : (t1 - t0) * Q3_TILE;
    (void)scratch;
    amx3_split_rows((const char *)aa->x + first * aa->x_stride * (a->dtype == DT_FLOAT32 ? 4 : 2), aa->x_stride,
                    rows, (t1 - t0) * Q3_TILE, K, a->dtype, aa->xh + first * K, aa->xl + first * K);
}

/* The amx3 route of qg_matmul over packed strips (QG_PACKED | QG_ROUTE_AMX): QG_BAD_LAYOUT where the
 * CPU lacks AMX-BF16 or the strips are QG_INT8's. Blocking: where all the activations' tiles fit
 * Q3_ACT_BYTES (L2) the whole of K is one chunk and a group's panels take at most Q3_PANEL_BYTES;
 * else (a long K, many rows) groups take up to Q3_GROUP_BYTES of panels and K goes in chunks
 * whose activations and panels take Q3_CHUNK_BYTES, so that each chunk's activations are read
 * from L2 for every strip of the group rather than from memory. */
static int run_amx3(QArgs *a, const void *x, int64_t x_stride) {
    const int64_t M = a->num_rows, K = a->num_cols, nb = K / QK_BLOCK;
    if (!cpu_allows(CPU_HAS_AMX_BF16) || a->int8) return QG_BAD_LAYOUT;
    const int64_t Mp = (M + Q3_TILE - 1) / Q3_TILE * Q3_TILE, strips = a->num_out / Q3_TILE;
    uint16_t *buf = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 2 * (size_t)(Mp * K));
    if (buf == NULL) return QG_NO_MEMORY;
    Amx3Args aa = {a, x, x_stride, buf, buf + Mp * K, Mp, 2, nb, 1};
    int rc = cpu_parallel_for(amx3_split_range, &aa, Mp / Q3_TILE, Mp * K, 0);
    if (rc == CPU_OK) {
        int64_t group, chunk = nb, pairs = (strips + 1) / 2;
        if (Mp * K * 4 <= Q3_ACT_BYTES) {
            group = Q3_PANEL_BYTES / (nb * 2048);
        } else {
            chunk = Q3_CHUNK_ACT_BYTES / (Mp * 128);  /* at least 4 blocks: the C tiles wait in memory between */
            chunk = chunk < 4 ? 4 : chunk;
            chunk = chunk > nb ? nb : chunk;
            group = Q3_CHUNK_PANEL_BYTES / (chunk * 2048);
            /* a few large items (each reads all the activations once per group), the groups no
             * larger than an item */
            const int64_t items = (int64_t)cpu_num_threads() * Q3_ITEMS_PER_THREAD;
            aa.pairs_per_item = (pairs + items - 1) / items;
            group = group > 2 * aa.pairs_per_item ? 2 * aa.pairs_per_item : group;
        }
        group = group > strips + 1 ? strips + 1 : group;  /* no more room than the strips take */
        aa.group = group < 2 ? 2 : group / 2 * 2;
        aa.chunk = chunk;
        const size_t floats = 16 + (size_t)q3_sums_floats(&aa) + (size_t)(aa.group * chunk * 2048 / 4);
        rc = cpu_parallel_for(amx3_range, &aa, (pairs + aa.pairs_per_item - 1) / aa.pairs_per_item,
                              Mp * a->num_out * K, floats);
    }
    free(buf);
    return rc;
}
