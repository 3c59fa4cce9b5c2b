/* Quantized weight products for decode batches and prompt chunks: y [M, N] = x [M, K] @ W.T (+ bias).
 *
 * Fewer than fk_qgemm_get_float_rows() rows (a product bound by the bytes of weights it
 * reads): the activations are quantized per row in blocks of 32 to int16 codes (dx = max|x| /
 * 32767, round half to even: a relative error below 2^-15 per element, where llama.cpp's int8
 * codes move logprobs by tenths); the weights stay in their 4-, 5- or 8-bit codes, widened to
 * int16 in registers, and the integer dot products run 16 multiply-adds per instruction
 * (AVX2 madd_epi16). From there (bound by arithmetic; AVX2 only): each pass of 4 weight rows is
 * decoded once to float32 and multiplied by the float32 activations with FMAs, the exact
 * float32 product of the dequantized weights. Weights:
 *
 * - Q4 rows: for K / 32 blocks b of 32 inputs, w = d[b] * q + m[b] with q in 0..15 (Q4_0,
 *   Q4_1 and Q4_K sub-blocks map onto this exactly: engine/loader/repack.py). Row n is
 *   d [K / 32], m [K / 32] (float32, or fp16 when `half`: 24 or 20 bytes per block in all),
 *   then the codes in pairs of blocks, 32 bytes per pair: 16-bit word i of a pair holds
 *   elements i and 16 + i in its low byte's nibbles and 32 + i and 48 + i in its high byte's
 *   (the pair's 64 elements: block 2p then 2p + 1), so shifts and masks give four runs of 16
 *   consecutive codes with no byte shuffles. K must be a multiple of 64. The m term uses the
 *   exact block sum of x.
 * - Q5 rows (`high`): w = d[b] * c + m[b] with a signed code c in -16..15 (ggml's Q5_0
 *   d * (q - 16) is c = q - 16, m = 0; Q5_1 d * q + m is m + 16 d). Per pair of blocks 40
 *   bytes: 16-bit word i holds the 5-bit two's complement codes of elements 48 + i (bits
 *   11..15), 32 + i (6..10), 16 + i (1..5) and the top bit of element i (bit 0); the 8 bytes
 *   after hold element i's low 4 bits as nibble i (byte i / 2, low nibble first). Shifts
 *   left then arithmetic shifts right give each run of 16 codes, sign-extended. 24 (half)
 *   or 28 bytes per block of 32 in all, against int8's 36.
 * - Q8 rows: int8 q [N, K] and scales [N, K / 32] (fp16 when `half`: a Q8_0 file's own d, else
 *   float32): w = q * scale per block of 32
 *   (ggml's Q8_0), each block's bytes interleaved as word i = elements i and 16 + i (again
 *   two runs of 16 from shifts alone).
 *
 * For Q8, K must be a multiple of 32. x and y are float32 or bfloat16 (FK_FLOAT32 / FK_BFLOAT16),
 * row-major with row strides in elements; bias is float32 [N] or NULL. Work is split over
 * output features across the fused kernels' pool (fused_kernels.h).
 */
#ifndef QGEMM_H
#define QGEMM_H

#include <stdint.h>

#define QK_BLOCK 32

/* fk_q4_matmul's layout flags: Q5 rows (else Q4), and mins that are all 0 (Q5_0): the rows then
 * hold no mins (scales, then the codes: 22 bytes per block of 32 with fp16 scales, as Q5_0 itself)
 * and the m term is skipped. */
#define FK_Q5 1
#define FK_NO_MINS 2

int fk_q4_matmul(const void *x, int64_t x_stride, int64_t num_rows, int64_t num_cols,
                 const uint8_t *blocks, int half, int layout, int64_t num_out, const float *bias,
                 void *y, int64_t y_stride, int dtype);

int fk_q8_matmul(const void *x, int64_t x_stride, int64_t num_rows, int64_t num_cols,
                 const int8_t *q, const void *scales, int half, int64_t num_out, const float *bias,
                 void *y, int64_t y_stride, int dtype);

/* Q5 rows' codes from ggml's order: packed [N, K / 2] (per block of 32, byte j = element j's
 * low nibble, element 16 + j's high), high [N, K / 8] (per block a little-endian uint32, bit j
 * = element j's fifth bit) -> per row the 40-byte pair records at out + n * out_stride. */
int fk_q5_pack(const uint8_t *packed, const uint8_t *high, int64_t num_rows, int64_t num_cols, uint8_t *out,
               int64_t out_stride);

/* From how many activation rows (M) the AVX2 products take the float path: each pass's
 * weight rows decoded to float32 once, float32 activations, FMAs (qgemm.c). */
void fk_qgemm_set_float_rows(int64_t rows);
int64_t fk_qgemm_get_float_rows(void);

/* Q4 or Q5 rows (layout: as fk_q4_matmul's) -> float32 w [N, K]. */
int fk_q4_dequantize(const uint8_t *blocks, int half, int layout, int64_t num_out, int64_t num_cols, float *w);

#endif
