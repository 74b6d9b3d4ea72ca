/* bf16 <-> fp32 one value at a time, as torch converts (dense.c, linear_amx.c) */
#ifndef KVL_BF16_H
#define KVL_BF16_H
#include <stdint.h>

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16, round to nearest even; a NaN stays a (quiet) NaN: torch's conversion, bit for bit */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
