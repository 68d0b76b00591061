/* The vector type both CPU kernels (recurrent.c, backward.c) compute with.
 *
 * 16 floats with AVX-512, else 8 (AVX2); -DDELTARULE_VEC=16 or 8 overrides the choice
 * (16 without AVX-512 runs as pairs of ymm operations: correct, slow). GCC vector
 * extensions, so the same code compiles for both widths.
 */
#ifndef DELTARULE_VECTOR_H
#define DELTARULE_VECTOR_H

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

/* (an initialiser: GCC 12 builds a loop's splat from inserts, not one broadcast) */
#if VEC == 16
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
#else
static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x}; }
#endif

#endif
