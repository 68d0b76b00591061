/* The vector type both CPU kernels (recurrent.c, backward.c) compute with.
 *
 * 16 floats with AVX-512, else 8 (AVX2); -DDELTARULE_VEC=16 or 8 overrides the choice
 * (16 without AVX-512 runs as pairs of ymm operations: correct, slow). GCC vector
 * extensions, so the same code compiles for both widths.
 */
#ifndef DELTARULE_VECTOR_H
#define DELTARULE_VECTOR_H

#include <stdint.h>

#ifndef DELTARULE_VEC
#if defined(__AVX512F__)
#define DELTARULE_VEC 16
#else
#define DELTARULE_VEC 8
#endif
#endif
#define VEC DELTARULE_VEC            /* floats per vector */
#if VEC != 8 && VEC != 16
#error "DELTARULE_VEC must be 8 or 16"
#endif
#define INLINE static inline __attribute__((always_inline))
/* A lazy scale (the forward's decay, the backward's dS scale) is applied once it leaves
 * [LAZY_FLOOR, 1 / LAZY_FLOOR] */
#define LAZY_FLOOR 0x1p-30f

typedef float vf __attribute__((vector_size(4 * VEC), aligned(4 * VEC)));
typedef int32_t vi __attribute__((vector_size(4 * VEC)));

/* (an initialiser: GCC 12 builds a loop's splat from inserts, not one broadcast) */
#if VEC == 16
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
#endif

/* exp of VEC floats: exp(x) = 2^n exp(r), n = round(x / ln 2), |r| <= ln(2) / 2, exp(r) by a
 * degree-7 Taylor polynomial; 2^n applied as two factors so that results down to the
 * denormals and up to FLT_MAX come out right. Relative error below 3e-7 where the result is
 * normal (tests/test_cpu_backend.py checks it against float64); overflow gives infinity, NaN
 * stays NaN. */
static inline vf vexp(vf x)
{
    const vf lo = splat(-104.0f), hi = splat(89.0f);   /* exp(-104) rounds to 0, exp(89) to inf */
    const vi nan = x != x;
    x = (vf)(((vi)x & ~(x < lo)) | ((vi)lo & (x < lo)));
    x = (vf)(((vi)x & ~(x > hi)) | ((vi)hi & (x > hi)));
    const vf shifter = splat(12582912.0f);             /* 1.5 * 2^23: adding it rounds to an integer */
    const vf t = x * splat(1.44269504f) + shifter;
    const vf n = t - shifter;
    const vf r = (x - n * splat(0.693145752f)) - n * splat(1.42860677e-6f);   /* ln 2 in two parts */
    vf p = splat(1.0f / 5040);
    p = p * r + splat(1.0f / 720);
    p = p * r + splat(1.0f / 120);
    p = p * r + splat(1.0f / 24);
    p = p * r + splat(1.0f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    const vi ni = (vi)t - (vi)shifter, n1 = ni >> 1, n2 = ni - n1;   /* n = n1 + n2, each in [-76, 65) */
    const vf y = p * (vf)((n1 + 127) << 23) * (vf)((n2 + 127) << 23);
    return (vf)(((vi)y & ~nan) | ((vi)splat(__builtin_nanf("")) & nan));
}

#endif
