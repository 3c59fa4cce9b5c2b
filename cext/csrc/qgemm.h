/* Quantized weight products for decode batches and prompt chunks: y [M, N] = x [M, K] @ W.T (+ bias).
 * This header is the one description of the weights' byte layouts (engine/models/quant.py
 * builds them, qgemm.c reads them).
 *
 * Routes. Fewer than qg_get_float_rows() rows (a product bound by the bytes of weights it
 * reads): the activations are quantized per row in blocks of 32 to int16 codes (dx = max|x| /
 * 32767, round half to even: a relative error below 2^-15 per element, where llama.cpp's int8
 * codes move logprobs by tenths); the weights stay in their 4-, 5- or 8-bit codes, widened to
 * int16 in registers, and the integer dot products run 16 multiply-adds per instruction
 * (AVX2 madd_epi16). From there (bound by arithmetic; AVX2 and up): each pass of 4 weight rows
 * is decoded once to float32 and multiplied by the float32 activations with FMAs, the exact
 * float32 product of the dequantized weights. The instruction set is cpu.h's switch; the work
 * is split over output features on cpu.h's pool. QG_ROUTE_STRIP (AVX-512 VNNI, qgemm_strip.h)
 * sums the integer route's integers 16 outputs per vector, for prompt chunks; QG_ROUTE_AMX
 * (qgemm_amx.h) the same on AMX-INT8 tiles.
 *
 * Layouts (`layout` = QG_Q4, QG_Q5 or QG_Q8, plus QG_HALF and QG_NO_MINS). Blocks b of 32
 * inputs along K; a row's scales d and mins m are float32, or fp16 with QG_HALF.
 * - QG_Q4: w = d[b] * q + m[b], q in 0..15 (Q4_0, Q4_1 and Q4_K sub-blocks map onto this
 *   exactly: engine/loader/repack.py). Row n: d [K / 32], m [K / 32], then the codes in pairs
 *   of blocks (block 2p then 2p + 1: the pair's 64 elements), 32 bytes per pair: 16-bit word i
 *   (little-endian) holds elements i and 16 + i in its low byte's nibbles (low nibble first)
 *   and 32 + i and 48 + i in its high byte's, so shifts and masks give four runs of 16
 *   consecutive codes with no byte shuffles. 24 bytes per block (20 with QG_HALF). K: a
 *   multiple of 64. The m term uses the exact block sums of x. With QG_SUPER (Q4 only, not with
 *   QG_HALF; K a multiple of 256) the scales are stored as ggml's Q4_K stores them: per
 *   super-block of 8 blocks a 10-byte group, an fp16 factor f then 8 uint8 multipliers q, and
 *   d[b] = f * q[b] (exact in float32); the mins likewise in a second run of groups. 18.5
 *   bytes per block (Q4_K itself: 18).
 * - QG_Q5: w = d[b] * c + m[b] with a signed code c in -16..15 (ggml's Q5_0 d * (q - 16) is
 *   c = q - 16, m = 0; Q5_1 d * q + m is c = q - 16, m + 16 d). Row n: d, m as for Q4, then
 *   per pair of blocks 40 bytes: 16-bit word i of the first 32 holds the 5-bit two's
 *   complement codes of elements 48 + i (bits 11..15), 32 + i (bits 6..10), 16 + i (bits
 *   1..5) and the top (sign) bit of element i's code (bit 0); the 8 bytes after hold element
 *   i's low 4 bits as nibble i (byte i / 2, low nibble first). Shifts left then arithmetic
 *   shifts right give each run of 16 codes sign-extended. 28 bytes per block (24 with
 *   QG_HALF). With QG_NO_MINS (every m is 0: Q5_0) the rows hold no mins: 24 bytes per block
 *   (22 with QG_HALF, as Q5_0 itself), and the m term is skipped. K: a multiple of 64.
 * - QG_Q8: w = d[b] * q, int8 q [N, K] and the scales apart, d [N, K / 32] (ggml's Q8_0; fp16
 *   with QG_HALF: a Q8_0 file's own d). Within each block byte 2i is element i and byte
 *   2i + 1 element 16 + i, so 16-bit word i holds both (sign-extending shifts give two runs
 *   of 16). K: a multiple of 32.
 *
 * - QG_PACKED (with QG_Q4 in any of its scale modes, QG_Q5 or QG_Q8): the same codes, scales and mins, stored in
 *   strips of 16 rows for the strip route (qgemm_strip.h reads them with no decode pass): N a
 *   multiple of 16, strip s (rows 16s .. 16s + 15) at s * qg_packed_strip_bytes(layout, K).
 *   A strip holds per block b 256 bytes of codes, four 64-byte vectors v = 0..3 for inputs
 *   8v .. 8v + 7 of the block: little-endian uint32 j of vector v is row 16s + j's eight codes,
 *   nibble t (bits 4t .. 4t + 3) holding input 8v + 2t and nibble t + 4 input 8v + 2t + 1, so
 *   (u >> 4t) & 0x000F000F is the int16 pair (2t, 2t + 1) of all 16 rows. After the nb
 *   blocks' codes come the scales, then the mins: [nb][16] float32 or fp16 (QG_HALF) per row
 *   of the strip, or with QG_SUPER per group g of 8 blocks an fp16 factor per row [16] and the
 *   8 blocks' uint8 multipliers [8][16] (d = f * q, exact). 384 bytes per block and strip
 *   (float32), 320 (fp16), 296 (QG_SUPER): a row's bytes as in its row layout. With QG_Q8 the
 *   same with a byte per code: per block eight 64-byte vectors u = 0..7 for inputs 4u .. 4u + 3,
 *   bytes 0, 2, 1, 3 of lane j holding inputs 4u, 4u + 1, 4u + 2, 4u + 3 of row 16s + j (so two
 *   sign-extending shifts give the pairs (4u, 4u + 1) and (4u + 2, 4u + 3)), then the scales
 *   [nb][16] (float32 or fp16), no mins: 544 or 576 bytes per block and strip. With QG_Q5 (its
 *   signed codes c in -16..15): Q4's four vectors of nibbles hold c's low 4 bits, and 64 bytes
 *   after them sixteen sign masks, little-endian uint32 4v + t with bit 2j set where input
 *   8v + 2t of row j is negative and bit 2j + 1 for input 8v + 2t + 1 (a masked subtract of 16
 *   gives c); then scales and, without QG_NO_MINS, mins as Q4's: 352-448 bytes per block and
 *   strip, a row's bytes as in its row layout. qg_pack makes all three from the row layouts;
 *   only the strip route (and qg_dequantize) reads them.
 * - QG_Q6 (with QG_PACKED only; no row layout): ggml's Q6_K with its own codes and scales, w =
 *   d * s[g] * (q - 32), q in 0..63, an int8 s per group g of 16 inputs and an fp16 d per 256. K: a
 *   multiple of 256. Per block b of a strip 384 bytes of codes, six 64-byte words u = 0..5: lane j
 *   (little-endian uint32) of word u is row 16s + j's, its low 16 bits for even inputs, its high 16
 *   bits for odd ones, each code as q ^ 32 (q - 32 in 6-bit two's complement), so that shifts give
 *   the signed int16 pair (2p, 2p + 1) of all 16 rows:
 *   pairs p = 0..11 whole, bits 6 (p % 2) .. + 5 of each half of word p / 2; pairs 12 + m their low 4
 *   bits at bits 12..15 of each half of word m and their high 2 bits at bits 12 + 2 (m % 2) of each
 *   half of word 4 + m / 2. After the nb blocks the scales
 *   s, int8 [2 nb][16] (group g of row j at 16 g + j), then d, fp16 [nb / 8][16]: 420 bytes per block
 *   and strip, Q6_K's 6.5625 bits a weight. The kernel sums (q - 32) x per group of 16 (an int8
 *   scale times the codes would overflow int32 over a block of 32), then in float32 t = sum0 *
 *   (d * s0), t = sum1 * (d * s1) + t and acc = t * dx + acc (FMAs). With QG_INT8 the same strips
 *   serve: pairs 2k and 2k + 1 or'ed into bytes (q unsigned, 0..63: the field ^ 32) for vpdpbusd,
 *   and 32 times the groups' sums of the int8 codes taken off. qg_q6k_pack makes the strips from a file's Q6_K rows.
 *
 * x and y are float32 or bfloat16 (DT_FLOAT32 / DT_BFLOAT16, dtype.h), row-major with row
 * strides in elements; bias is float32 [N] or NULL.
 */
#ifndef QGEMM_H
#define QGEMM_H

#include <stdint.h>

#define QK_BLOCK 32

enum { QG_Q4 = 0, QG_Q5 = 1, QG_Q8 = 2, QG_Q6 = 3 };
#define QG_FORMAT_MASK 3
#define QG_HALF 4     /* fp16 scales and mins */
#define QG_NO_MINS 8  /* Q5 rows without mins */
#define QG_SUPER 64   /* Q4 rows with scales and mins as uint8 multiples of per-256 fp16 factors */
/* qg_matmul only: the route, else the integer route below qg_get_float_rows() rows and the
 * float route from there (the float route needs AVX2: without it the integer route runs). */
#define QG_ROUTE_INT 16
#define QG_ROUTE_FLOAT 32
/* The integer route's sums on AMX-INT8 tiles (qgemm_amx.h): needs AMX-INT8 and N a multiple of
 * 16, else QG_BAD_LAYOUT. */
#define QG_ROUTE_AMX 128
/* The integer route's sums with AVX-512 VNNI in strips of 16 outputs (qgemm_strip.h): needs N a
 * multiple of 16, else QG_BAD_LAYOUT; without AVX-512 VNNI (or with the switch below AVX-512) the
 * integer route runs (the same integers). */
#define QG_ROUTE_STRIP 256
#define QG_ROUTE_MASK (QG_ROUTE_INT | QG_ROUTE_FLOAT | QG_ROUTE_AMX | QG_ROUTE_STRIP)
/* Rows in strips of 16 (the layout above): with no route or QG_ROUTE_STRIP (else QG_BAD_LAYOUT); N a
 * multiple of 16. Without AVX-512 VNNI (or with the switch below AVX-512) AVX2's kernel (qgemm_packed_avx2.h:
 * madd_epi16 over half a strip at a time), and below AVX2 a portable one, compute the same numbers, bit for
 * bit; qg_dequantize reads the strips 16 values at a time from AVX2 up. With QG_ROUTE_AMX (where the CPU has AMX-BF16, not with QG_INT8) the amx3
 * route (qgemm_amx3.h): each weight as qg_dequantize gives it and each activation split into two
 * bfloat16, three bfloat16 products on AMX tiles with float32 sums over the whole of K. */
#define QG_PACKED 512
/* With QG_PACKED only (else QG_BAD_LAYOUT): the activations quantized to int8 codes (|q| <= 127, dx =
 * max|x| / 127, the same rounding) where the default is int16, so the strip route's AVX-512 kernel
 * multiplies bytes (vpdpbusd, unsigned weight bytes times signed activation bytes: 64 multiply-adds an
 * instruction, twice vpdpwssd's). Q4's nibbles are unsigned; Q5's codes are offset by 16 (its strips
 * made ready by qg_pack_int8 first) and Q8's by 128, and the offset times the block's sum of
 * activation codes is taken off. Q4's and Q5's min term takes the sum of the dequantized codes, dx *
 * sum(q), where int16 codes take the exact sum of x: the product is then W x' for the dequantized x',
 * whose errors meet the weights centred (with the exact sum they met d * q, biased by the min: on
 * SmolLM2's down_proj 3x the error). Every row count still sums the same integers in the same float32
 * order, and AVX2's kernel (madd_epi16 over the int8 codes as int16: the same integers, int16's speed) and
 * the portable one compute the same bits. The precision is llama.cpp's (its Q8_0
 * activations): an opt-in, engine option activations="int8". */
#define QG_INT8 1024

/* Error codes (as cext.ops'): K not a multiple of the layout's block, a layout unknown, no memory. */
enum { QG_OK = 0, QG_BAD_LENGTH = 4, QG_NO_MEMORY = 5, QG_BAD_LAYOUT = 6 };

/* y [M, N] = x [M, K] @ W.T + bias. w: the rows (Q4/Q5: scales, mins and codes; Q8: the codes),
 * scales: Q8's scales (NULL for Q4/Q5). */
int qg_matmul(int layout, const void *x, int64_t x_stride, int64_t num_rows, int64_t num_cols,
              const void *w, const void *scales, int64_t num_out, const float *bias,
              void *y, int64_t y_stride, int dtype);

/* Bytes of one strip of 16 rows of a QG_PACKED layout with K inputs (0: no packed form). */
int64_t qg_packed_strip_bytes(int layout, int64_t num_cols);

/* Q4, Q5 or Q8 rows in their row layout (`layout` without QG_PACKED; Q8: codes [N, K] and scales) -> the
 * QG_PACKED strips at out (N / 16 * qg_packed_strip_bytes). N a multiple of 16. */
int qg_pack(int layout, const void *rows, const void *scales, int64_t num_rows, int64_t num_cols, uint8_t *out);

/* Rows first .. first + count - 1 of W -> out [count, K] in out_dtype (float32 or bfloat16). */
int qg_dequantize(int layout, const void *w, const void *scales, int64_t first, int64_t count,
                  int64_t num_cols, void *out, int out_dtype);

/* Packed strips (layout with QG_PACKED, without QG_INT8) made ready for QG_INT8 products, in place:
 * Q5's sign masks rewritten in the int8 kernel's byte order (qgemm.c's packed_sign8_at: per input
 * vector two uint64 with a bit set where the code is not negative, so one masked add of 16 per
 * 64 bytes gives c + 16); Q4 and Q8 strips are left as they are. From then on the layout is read
 * with QG_INT8 only (products and qg_dequantize). */
int qg_pack_int8(int layout, uint8_t *strips, int64_t num_rows, int64_t num_cols);

/* ggml Q6_K rows (num_cols / 256 blocks of 210 bytes each: ql [128], qh [64], scales int8 [16], d fp16)
 * -> the QG_Q6 | QG_PACKED strips at out (N / 16 * qg_packed_strip_bytes). N a multiple of 16, K of 256. */
int qg_q6k_pack(const uint8_t *raw, int64_t num_rows, int64_t num_cols, uint8_t *out);

/* Q5 rows' codes from ggml's order: packed [N, K / 2] (per block of 32, byte j = element j's
 * low nibble, element 16 + j's high), high [N, K / 8] (per block a little-endian uint32, bit j
 * = element j's fifth bit) -> per row the 40-byte pair records at out + n * out_stride. */
int qg_q5_pack(const uint8_t *packed, const uint8_t *high, int64_t num_rows, int64_t num_cols, uint8_t *out,
               int64_t out_stride);

/* Which cache the kernels' weight prefetch fills: L1 (prefetcht0) or L2 (prefetcht1); set 0 for
 * the CPU's default (L2 on AMD, L1 elsewhere). The level changes speed only, never a result. */
enum { QG_PREFETCH_L1 = 1, QG_PREFETCH_L2 = 2 };
int qg_prefetch_level(void);
void qg_set_prefetch_level(int level);
/* On (the default): products of up to 5 rows (decode steps) issue each pass's prefetch a few lines
 * per block step instead of in one burst at the pass's start. Speed only, never a result. */
int qg_prefetch_spread(void);
void qg_set_prefetch_spread(int on);

/* From how many activation rows (M) the products take the float route (AVX2 and up). */
void qg_set_float_rows(int64_t rows);
int64_t qg_get_float_rows(void);

#endif
