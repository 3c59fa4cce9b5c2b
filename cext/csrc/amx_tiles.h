/* What the AMX kernels share (qgemm_amx.h, qgemm_amx3.h, prefill_attention_amx.h): the tile
 * configuration's layout, the configuration of eight 16 x 64-byte tiles, and the split of float32
 * values into two bfloat16 (v = h + l: h = v rounded to nearest even, l = the rest rounded again;
 * 16 significant bits). Include inside a `#pragma GCC target` region with AVX-512 BF16 and AMX. */
#ifndef AMX_TILES_H
#define AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) AmxConfig;

/* Tiles 0-7, each 16 rows of 64 bytes (16 x 16 float32 sums, or 16 x 32 bfloat16). */
static inline void amx_configure_square(void) {
    AmxConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
}

/* bfloat16 bits (16 in a __m256i) widened back to float32. */
static inline __m512 amx_widen_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 32 float32 (a: the first 16, b: the next) -> h, l: their bfloat16 high parts and residuals, each
 * 32 values in order. */
static inline void amx_split32(__m512 a, __m512 b, __m512i *h, __m512i *l) {
    const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    const __m512 ah = amx_widen_bf16(_mm512_castsi512_si256(hi));
    const __m512 bh = amx_widen_bf16(_mm512_extracti64x4_epi64(hi, 1));
    *h = hi;
    *l = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, bh), _mm512_sub_ps(a, ah));
}

#endif
