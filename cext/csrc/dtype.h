/* Scalar dtype conversions, the one copy every kernel file uses (vector loops call these
 * inside `omp simd` loops, or use F16C/AVX-512 conversions that give the same values).
 * bfloat16 is the top half of a float32; float32 -> bfloat16 rounds to nearest even and keeps
 * a NaN a quiet NaN, as torch does. float16 -> float32 is exact (subnormals included). */
#ifndef DTYPE_H
#define DTYPE_H

#include <stdint.h>
#include <string.h>

/* Activation and KV cache dtype codes of the kernel modules' arguments. */
enum { DT_FLOAT32 = 0, DT_BFLOAT16 = 1, DT_FLOAT16 = 2 };

static inline float dt_bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t dt_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t is_nan = (u & 0x7fffffffu) > 0x7f800000u;
    return (uint16_t)(is_nan ? ((u >> 16) | 0x40u) : rounded);
}

static inline float dt_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24 */
        const float f = (float)mant * 5.9604644775390625e-8f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#endif
