/* e^y for the kernels' loops, inline so that a loop over values vectorizes (glibc's expf is a call
   per value: a bf16 prefill's MLP spent 8 % of its time in silu's; the tiny model's decode attention
   call is about a tenth faster with it). Cephes' expf: y = n ln2 + r, |r| <= ln2 / 2, a degree-6
   polynomial for e^r, 2^n put in the exponent bits; within 2 ulp of expf (tests/test_kernels.py).
   n is rounded with the 1.5 * 2^23 trick (round to nearest, no call); below -87.3 (where 2^n would
   not be a normal float) the result is 0, above 88.3 it is e^88.3 (3e38: callers use it as "huge");
   a NaN stays a NaN. */
#ifndef KVL_VEXP_H
#define KVL_VEXP_H
#include <stdint.h>

static inline __attribute__((always_inline)) float kvl_exp(float y) {
    const float c = y < -87.3f ? -87.3f : (y > 88.3f ? 88.3f : y);
    const float big = 12582912.f;                               /* 1.5 * 2^23 */
    const float nb = c * 1.44269504088896341f + big;
    const float n = nb - big;
    float r = c - n * 0.693359375f;                             /* ln2, split in two (Cephes) */
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t e;
    __builtin_memcpy(&e, &nb, sizeof e);
    const int32_t bits = (e - 0x4B400000 + 127) << 23;        /* n + 127 in the exponent */
    float scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return y < -87.3f ? 0.f : p * scale;
}

#endif
