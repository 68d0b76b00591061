/* Element types of the CPU kernels' tensors and one-element loads / stores (recurrent.c, conv.c). */
#ifndef DELTARULE_ELEMENTS_H
#define DELTARULE_ELEMENTS_H

#include <stdint.h>
#include <string.h>

/* Element types of q, k, v, o, per-channel gates and states. */
enum { F32 = 0, F16 = 1, BF16 = 2 };

/* A NaN stored as bfloat16: torch's (c10::BFloat16's) quiet NaN */
#define BF16_NAN 0x7fc0u

/* A bfloat16 widened; a float rounded to bfloat16, to nearest even as torch does (a NaN stays NaN) */
static inline float bf16_widen(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float y;
    memcpy(&y, &bits, sizeof y);
    return y;
}

static inline uint16_t bf16_round(float y)
{
    uint32_t bits;
    memcpy(&bits, &y, sizeof bits);
    return y != y ? BF16_NAN : (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

/* One element of x (type) at off, widened; one element rounded to nearest even */
static inline float get1(const void *x, int64_t off, int type)
{
    if (type == F32)
        return ((const float *)x)[off];
    if (type == F16)
        return (float)((const _Float16 *)x)[off];
    return bf16_widen(((const uint16_t *)x)[off]);
}

static inline void put1(void *x, int64_t off, float y, int type)
{
    if (type == F32)
        ((float *)x)[off] = y;
    else if (type == F16)
        ((_Float16 *)x)[off] = (_Float16)y;
    else
        ((uint16_t *)x)[off] = bf16_round(y);
}

#endif
