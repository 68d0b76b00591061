/* Fused recurrence of the generalized gated delta rule for the CPU.
 *
 * Tiles. The columns of the state are independent: column j of S only ever
 * meets v_j, w_j and column j itself (S^T (b k) and S^T q are per column, the
 * update adds k u_j). A task owns one (sequence, state head); its state lies
 * in [K, TILE] tiles of TILE value columns, and a tile (16 KB on AVX2, 32 KB on
 * AVX-512 at K = 128) stays in the L1 cache while it runs a block of TB tokens:
 *
 *   read:    r = S'^T (b*k),  p_g = S'^T q_g            S' = D S, the old state decayed
 *            u = w*v - r,     o_g = scale * (p_g + (q_g . k) u)
 *   update:  S = S' + k u^T
 *
 * which is docs/design.md section 1 read after the update: S_t^T q = S'^T q + u (k . q).
 *
 * Lazy decay. The tiles hold S-hat with S = diag(c) S-hat. The decay folds into
 * the key-side vectors (c' = c*d; r = S-hat^T (c'*b*k), p_g = S-hat^T (c'*q_g))
 * and the update becomes one FMA per element, S-hat += (k / c') u^T, c = c'.
 * When some c' leaves [LAZY_FLOOR, 1 / LAZY_FLOOR] (after about 20 / |log decay|
 * tokens, at once for a decay that underflows, or a NaN), that token applies c'
 * to the tiles instead (S-hat = c' S-hat + k u^T) and c restarts at 1.
 *
 * One sweep per token. With the lazy update, token t's update of a tile row
 * and token t+1's reads of the same row share one load: a token costs 3 FMAs
 * per tile vector (the update and the two reads, the same for scalar, per-key
 * and GDN-2 gates); GQA groups read again per query.
 *
 * Registers. A sweep keeps its accumulators (u, r and p: 3 NV vectors, times
 * SUMS partial sums for r and p) in vector registers, so the vector width and
 * the tiling follow the target: 16 floats with AVX-512 (32 zmm registers: NV = 4,
 * SUMS = 2, TILE = 64), else 8 (AVX2, 16 ymm registers: NV = 4, SUMS = 1,
 * TILE = 32, which leaves exactly one register per broadcast and one for the
 * row). -DDELTARULE_VEC=16 or 8 overrides the choice (16 without AVX-512 runs
 * as pairs of ymm operations and spills: correct, slow).
 *
 * Blocks. The key-side vectors depend on the head only, not on the tile: they
 * are formed once per token for a block of TB tokens, from the q and k rows
 * staged contiguously (one head's rows lie Hv*K floats apart from token to
 * token; staging them together lets their cache misses overlap), and every
 * tile then runs the block.
 *
 * Inputs. q, k and v are read in their own dtype (float32, float16 or
 * bfloat16), widened to float32 as they are staged (and L2-normalised there
 * with qk_l2norm); o is written in v's dtype. Per-channel gates are read in
 * their own dtype, scalar gates are float32. States are stored as float32,
 * float16 or bfloat16 (each of S0 and S its own): widened when read, rounded to
 * nearest even when stored; between a sequence's tokens the state stays
 * float32 (tiles or a scratch copy, never rounded). Accumulation is float32
 * throughout.
 *
 * Stores. Besides the final state (spans column 5), a sequence may store the
 * state after each of its tokens into a row of S (token_rows: speculative
 * decoding's verify step).
 *
 * Capture. With a capture buffer (speculative decoding's compact form, ONNX Runtime's
 * GatedDeltaNet `state_update` layout), the first `capacity` tokens of each sequence also
 * write the factors of their transition S = diag(d) S_prev + k u^T: the decay factors d
 * (key_side, before the lazy scale folds in), the key as the update uses it (after the L2
 * norm; the first state head of a key head's group writes it) and u (per tile, or whole).
 * Tasks write disjoint parts. A call without a capture pays three tests of a NULL pointer per
 * token and head, none inside a loop over the state.
 *
 * Whole rows. A single token (decode), and a sequence that stores per-token
 * states, runs token by token on whole state rows instead (see "Whole rows"
 * below): its state is read from and written to memory, where sequential
 * sweeps beat tile passes; V must be a multiple of TILE (else the tiles run it,
 * a token row costing one more pass over the tile).
 *
 * Compute only: contiguous operands, validated by the caller.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "fields.h"
#include "vector.h"
#include "team.h"
#include "elements.h"

#if VEC == 16
#define SUMS 2                       /* partial sums of r and p: 4 u + 16 sums + 6 broadcasts + 2 rows of 32 zmm */
#else
#define SUMS 1                       /* 4 u + 8 sums + 3 broadcasts + 1 row = the 16 ymm registers */
#endif
#define NV 4                         /* vectors per tile row */
#define TILE (VEC * NV)              /* value columns per tile */
#define TB 16                        /* tokens per block */
#define ROWS_STORE_SHARE 8           /* more than 1 in 8 tokens storing its state: the row path */
#define UNROLL _Pragma("GCC unroll 8")

typedef uint32_t vu __attribute__((vector_size(4 * VEC)));
typedef uint16_t vh __attribute__((vector_size(2 * VEC), aligned(2)));


/* Gate forms: 0 absent, 1 scalar per (token, head), 2 per channel. */
enum { ABSENT = 0, SCALAR = 1, CHANNEL = 2 };
static inline int64_t size_of(int type) { return type == F32 ? 4 : 2; }

/* Stores the `bytes` bytes at src to dst (aligned to the store's width) past the caches,
 * where the CPU has such stores: for a state written once and not read back soon (its old
 * lines are not read in first) */
INLINE void stream(void *dst, const void *src, int bytes)
{
#if defined(__AVX512F__)
    if (bytes % 64 == 0) {
        for (int i = 0; i < bytes; i += 64)
            _mm512_stream_si512((void *)((char *)dst + i), _mm512_loadu_si512((const char *)src + i));
        return;
    }
#endif
#if defined(__AVX__)
    if (bytes % 32 == 0) {
        for (int i = 0; i < bytes; i += 32)
            _mm256_stream_si256((__m256i *)((char *)dst + i), _mm256_loadu_si256((const __m256i *)((const char *)src + i)));
        return;
    }
#endif
#if defined(__SSE2__)
    for (int i = 0; i < bytes; i += 16)
        _mm_stream_si128((__m128i *)((char *)dst + i), _mm_loadu_si128((const __m128i *)((const char *)src + i)));
#else
    memcpy(dst, src, bytes);
#endif
}

/* `bytes` from src to dst: streamed past the caches where nt, else plainly */
INLINE void store_bytes(void *dst, const void *src, int bytes, int nt)
{
    if (nt)
        stream(dst, src, bytes);
    else
        memcpy(dst, src, bytes);
}

/* VEC elements of x (type) from off, widened to float32 (type a constant where inlined) */
INLINE vf get(const void *x, int64_t off, int type)
{
    vf y;
    if (type == F32)
        memcpy(&y, (const float *)x + off, sizeof y);
    else if (type == BF16) {
#if VEC == 8 && defined(__AVX2__)
        y = (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + off))), 16);
#elif VEC == 16 && defined(__AVX512F__)
        y = (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + off))), 16);
#else
        vh h;
        memcpy(&h, (const uint16_t *)x + off, sizeof h);
        y = (vf)(__builtin_convertvector(h, vu) << 16);
#endif
    } else {
        const uint16_t *src = (const uint16_t *)x + off;
#if VEC == 16 && defined(__AVX512F__)
        y = (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src));
#elif defined(__F16C__)
        for (int c = 0; c < VEC; c += 8) {
            const __m256 z = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + c)));
            memcpy((float *)&y + c, &z, sizeof z);
        }
#else
        for (int l = 0; l < VEC; l++)
            y[l] = get1(src, l, F16);
#endif
    }
    return y;
}

/* y rounded to bfloat16 in the low half of each 32-bit lane: to nearest even, a NaN to
 * BF16_NAN (the bias would carry a NaN's payload into its exponent and sign) */
INLINE vu bf16_bits(vf y)
{
    const vu bits = (vu)y;
    const vu r = (bits + 0x7fffu + ((bits >> 16) & 1)) >> 16;
#if VEC == 8 && defined(__AVX__)
    return (vu)_mm256_blendv_ps((__m256)r, (__m256)((vu){} + BF16_NAN), _mm256_cmp_ps((__m256)y, (__m256)y, _CMP_UNORD_Q));
#else
    const vu nan = (vu)(y != y);
    return (r & ~nan) | (BF16_NAN & nan);
#endif
}

/* x[off:off+VEC] = y rounded to type (a constant where inlined); nt: past the caches (aligned) */
INLINE void put(void *x, int64_t off, vf y, int type, int nt)
{
    if (type == F32) {
        float *dst = (float *)x + off;
        store_bytes(dst, &y, sizeof y, nt);
        return;
    }
    uint16_t *dst = (uint16_t *)x + off;
    vh h;
#if VEC == 16 && defined(__AVX512BF16__)
    /* one instruction (round to nearest even) instead of the bit arithmetic below: bfloat16 slabs
     * decoded 1.45x faster. It reads denormals as zero and keeps a NaN's payload, so a vector with
     * a denormal takes the bit arithmetic, and NaNs become torch's BF16_NAN. */
    if (type == BF16) {
        const __m512 a = (__m512)y;
        const __mmask16 denormal = _mm512_cmp_ps_mask(_mm512_abs_ps(a), _mm512_set1_ps(0x1p-126f), _CMP_LT_OQ)
                                   & _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_OQ);
        if (!denormal) {
            __m256i z = (__m256i)_mm512_cvtneps_pbh(a);
            z = _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), z, _mm256_set1_epi16(BF16_NAN));
            store_bytes(dst, &z, sizeof z, nt);
            return;
        }
    }
#endif
    if (type == BF16)
        h = __builtin_convertvector(bf16_bits(y), vh);
    else {
#if VEC == 16 && defined(__AVX512F__)
        const __m256i z = _mm512_cvtps_ph((__m512)y, _MM_FROUND_TO_NEAREST_INT);
        memcpy(&h, &z, sizeof h);
#elif defined(__F16C__)
        for (int c = 0; c < VEC; c += 8) {
            __m256 z;
            memcpy(&z, (const float *)&y + c, sizeof z);
            const __m128i e = _mm256_cvtps_ph(z, _MM_FROUND_TO_NEAREST_INT);
            memcpy((uint16_t *)&h + c, &e, sizeof e);
        }
#else
        for (int l = 0; l < VEC; l++)
            put1(&h, l, y[l], F16);
#endif
    }
    store_bytes(dst, &h, sizeof h, nt);
}

INLINE void widen_as(float *dst, const void *x, int64_t off, int64_t n, int type)
{
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) {
        const vf y = get(x, off + i, type);
        memcpy(dst + i, &y, sizeof y);
    }
    for (; i < n; i++)
        dst[i] = get1(x, off + i, type);
}

/* dst[0:n] = x[off:off+n] widened to float32 */
static void widen(float *dst, const void *x, int64_t off, int64_t n, int type)
{
    if (type == F32)
        memcpy(dst, (const float *)x + off, sizeof(float) * n);
    else if (type == F16)
        widen_as(dst, x, off, n, F16);
    else
        widen_as(dst, x, off, n, BF16);
}

INLINE void narrow_as(void *x, int64_t off, const float *src, int64_t n, int type)
{
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) {
        vf y;
        memcpy(&y, src + i, sizeof y);
        put(x, off + i, y, type, 0);
    }
    for (; i < n; i++)
        put1(x, off + i, src[i], type);
}

/* x[off:off+n] = src[0:n] narrowed from float32, rounding to nearest even (as torch does) */
static void narrow(void *x, int64_t off, const float *src, int64_t n, int type)
{
    if (type == F32)
        memcpy((float *)x + off, src, sizeof(float) * n);
    else if (type == F16)
        narrow_as(x, off, src, n, F16);
    else
        narrow_as(x, off, src, n, BF16);
}

typedef struct {
    const void *q, *k, *v;           /* [B, T, Hv/rq, G, K], [B, T, Hv/rk, K] (qk_type), [B, T, Hv, V] (v_type) */
    const void *g;                   /* NULL or [B, T, Hv] scalar log decay (g_type) */
    const void *gk;                  /* NULL or [B, T, Hv, K] per-key log decay (gk_type) */
    const void *b, *w;               /* erase, write: [B, T, Hv] or [B, T, Hv, K] (b, b_type) and
                                        [B, T, Hv] or [B, T, Hv, V] (w, w_type), by their forms */
    const void *a_log, *dt_bias;     /* raw gate arm (raw_gate): [Hv] (a_type), [Hv] beside g or [Hv, K]
                                        beside gk (dtb_type); the decay gate is then the raw projection x
                                        and the log decay -exp(a_log) softplus(x + dt_bias) */
    const void *s0;                  /* NULL or states [row, Hv, K, V] (s0_type) at strides s0_stride */
    void *s;                         /* states (s_type) at strides s_stride (may be s0: a slab in place) */
    void *o;                         /* [B, T, Hv, G, V] (v_type) */
    int64_t *bad;                    /* a refusal's finding: the flat index of the first positive log
                                        decay (of g, else of gk), or the operand that meets the slab */
    const int64_t *spans;            /* [N, 5]: row, start, end, read row of s0 (-1: zeros), final row of s (-1: none) */
    const int64_t *token_rows;       /* NULL or [N, token_cols]: the row of s that takes the state after
                                        each token of a sequence (-1: none) */
    const int32_t *owner;            /* NULL, or [B*T]: the span whose output a token keeps (-1: none) */
    float *u_out;                    /* NULL, or [B, T, Hv, V] float32: every token's u = w*v - r, kept by
                                        a differentiable forward for the backward's recompute */
    float *capture;                  /* NULL, or [N, capacity * (Dw + Hk*K + Hv*V)] float32 (Dw = Hv*K with
                                        gk, else Hv): the compact capture (ONNX Runtime's GatedDeltaNet
                                        `state_update` layout) of each sequence's first min(capacity,
                                        length) tokens i, in row n: at i*Dw the decay factors exp(lam),
                                        at capacity*Dw + i*Hk*K the key the update uses, at
                                        capacity*(Dw + Hk*K) + i*Hv*V its u; nothing else is written */
    int64_t N, T, Hv, K, V, G, rq, rk, token_cols;
    int64_t tokens;                  /* B * T: the rows of q, k, v and the gates (check_decay scans them all) */
    int64_t checkpoint;              /* 0, or a multiple of TB: the tile path also stores the state after
                                        every `checkpoint` tokens of a span but its last into row
                                        read + 1, read + 2, ... of s (a differentiable forward's chunk
                                        starts; the final row follows them) */
    int64_t capacity;                /* C >= 1 with capture: the transitions a capture row holds; else 0 */
    int64_t s0_stride[4], s_stride[4];   /* in elements: row, head, key, value */
    int64_t slab_bytes;              /* > 0: refuse (return 4, *bad the operand's position) an operand
                                        among q .. dt_bias whose bytes [p, p + operand_bytes[i]) meet the
                                        slab's [s, s + slab_bytes) (s0 == s, updated in place) */
    int64_t operand_bytes[9];        /* q k v g gk b w a_log dt_bias: their byte extents (0: unchecked) */
    int b_form, w_form;
    int qk_type, v_type, g_type, gk_type, b_type, w_type, s0_type, s_type, a_type, dtb_type;
    int raw_gate;                    /* g or gk is the raw projection (a_log, dt_bias) */
    int gate_sigmoid;                /* b and w are logits: their sigmoid is used */
    int check_decay;                 /* refuse (return 2, *bad set) a positive log decay before any work */
    int stream_state;                /* write final states with streaming stores (a large fresh state) */
    int prefetch_next;               /* prefetch the next task's state (states beyond the L2 cache: while
                                        they fit, the prefetches only cost, 5-10 % at B = 1) */
    int qk_l2norm;                   /* normalise staged q and k rows: x / sqrt(sum x^2 + l2norm_eps) */
    float l2norm_eps;
    float scale;
} problem;

/* every field of `problem`, for the binding's check of its layout (fields.h) */
static const field problem_fields[] = {
    FIELD(problem, q), FIELD(problem, k), FIELD(problem, v), FIELD(problem, g), FIELD(problem, gk),
    FIELD(problem, b), FIELD(problem, w), FIELD(problem, a_log), FIELD(problem, dt_bias),
    FIELD(problem, s0), FIELD(problem, s), FIELD(problem, o), FIELD(problem, bad),
    FIELD(problem, spans), FIELD(problem, token_rows), FIELD(problem, owner), FIELD(problem, u_out),
    FIELD(problem, capture), FIELD(problem, N), FIELD(problem, T), FIELD(problem, Hv), FIELD(problem, K),
    FIELD(problem, V), FIELD(problem, G), FIELD(problem, rq), FIELD(problem, rk), FIELD(problem, token_cols),
    FIELD(problem, tokens), FIELD(problem, checkpoint), FIELD(problem, capacity), FIELD(problem, s0_stride),
    FIELD(problem, s_stride), FIELD(problem, slab_bytes), FIELD(problem, operand_bytes),
    FIELD(problem, b_form), FIELD(problem, w_form), FIELD(problem, qk_type), FIELD(problem, v_type),
    FIELD(problem, g_type), FIELD(problem, gk_type), FIELD(problem, b_type), FIELD(problem, w_type),
    FIELD(problem, s0_type), FIELD(problem, s_type), FIELD(problem, a_type),
    FIELD(problem, dtb_type), FIELD(problem, raw_gate), FIELD(problem, gate_sigmoid),
    FIELD(problem, check_decay), FIELD(problem, stream_state), FIELD(problem, prefetch_next),
    FIELD(problem, qk_l2norm), FIELD(problem, l2norm_eps), FIELD(problem, scale),
    {NULL, 0, sizeof(problem)},        /* the end, with the struct's size */
};

const field *deltarule_problem_fields(void) { return problem_fields; }

/* A thread's scratch, reused by its tasks. Key-side rows are per token of a block. */
typedef struct {
    float *tiles;                    /* [tiles, K, TILE] the head's S-hat, 64-byte aligned (whole rows:
                                        the [K, V] state between tokens) */
    float *kb, *qb;                  /* staged k, q rows: [TB, K], [TB, G*K] */
    float *cd, *eb, *eq, *kq, *kc;   /* [TB, K] c*d, [TB, K] c*d*b*k, [TB, G*K] c*d*q_g, [TB, G] q_g . k,
                                        [TB, K] update factor: k / (c*d) (lazy) or k */
    int *lazy;                       /* [TB] */
    float *c;                        /* [K] the lazy scale after the block's last token */
    float *vw;                       /* [TB, TILE] w*v of one tile, zero-padded */
    float *dtb;                      /* [K] the head's per-key dt_bias (raw gate arm), widened */
    float *acc;                      /* whole rows: [V] r, [G, V] p, [V] u */
} scratch;


/* softplus(x) = log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)), log1p(e) = 2 atanh(e / (2 + e)) by
 * its series to z^13 (z <= 1/3: relative error below 1e-9, and exact for tiny e); NaN stays NaN,
 * +inf gives +inf, -inf 0 (as torch's softplus) */
static inline vf vsoftplus(vf x)
{
    const vf pos = (vf)((vi)x & (vi)(x > splat(0.0f)));      /* max(x, 0), NaN -> 0 */
    const vf e = vexp(-(vf)((vi)x & 0x7fffffff));
    const vf z = e / (splat(2.0f) + e), z2 = z * z;
    vf p = splat(1.0f / 13);
    p = p * z2 + splat(1.0f / 11);
    p = p * z2 + splat(1.0f / 9);
    p = p * z2 + splat(1.0f / 7);
    p = p * z2 + splat(1.0f / 5);
    p = p * z2 + splat(1.0f / 3);
    p = p * z2 + splat(1.0f);
    return pos + splat(2.0f) * z * p;
}

static inline float softplus1(float x)
{
    return (x > 0.0f ? x : 0.0f) + log1pf(expf(-fabsf(x)));
}

static inline vf vsigmoid(vf x)
{
    return splat(1.0f) / (splat(1.0f) + vexp(-x));
}

static inline float sigmoid1(float x)
{
    return 1.0f / (1.0f + expf(-x));
}

/* x[0:n] = sigmoid(x[0:n]) */
static void sigmoid_n(float *x, int64_t n)
{
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) {
        vf a;
        memcpy(&a, x + i, sizeof a);
        a = vsigmoid(a);
        memcpy(x + i, &a, sizeof a);
    }
    for (; i < n; i++)
        x[i] = sigmoid1(x[i]);
}

/* x[0:n] = -exp(a) softplus(x[0:n] + bias[0:n]): the raw gate arm of per-key decays */
static void raw_decay_n(float *x, float a, const float *bias, int64_t n)
{
    const float rate = -expf(a);
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) {
        vf y, c;
        memcpy(&y, x + i, sizeof y);
        memcpy(&c, bias + i, sizeof c);
        y = splat(rate) * vsoftplus(y + c);
        memcpy(x + i, &y, sizeof y);
    }
    for (; i < n; i++)
        x[i] = rate * softplus1(x[i] + bias[i]);
}

/* out[i] = exp(x[i] + shift), i < n */
static inline void exp_shifted(float *out, const float *x, float shift, int64_t n)
{
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) {
        vf a;
        memcpy(&a, x + i, sizeof a);
        a = vexp(a + splat(shift));
        memcpy(out + i, &a, sizeof a);
    }
    if (i < n) {
        vf a = splat(0.0f);
        memcpy(&a, x + i, sizeof(float) * (n - i));
        a = vexp(a + splat(shift));
        memcpy(out + i, &a, sizeof(float) * (n - i));
    }
}

/* x . y over n floats, in VEC partial sums */
static inline float dot(const float *x, const float *y, int64_t n)
{
    vf acc = splat(0);
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) {
        vf a, b;
        memcpy(&a, x + i, sizeof a);
        memcpy(&b, y + i, sizeof b);
        acc += a * b;
    }
    float sum = 0.0f;
    for (int l = 0; l < VEC; l++)
        sum += acc[l];
    for (; i < n; i++)
        sum += x[i] * y[i];
    return sum;
}

/* acc = S^T e over a tile, two partial sums per vector */
static inline void read_tile(const vf *S, const float *e, int64_t K, vf acc[NV])
{
    vf a1[NV];
    UNROLL for (int l = 0; l < NV; l++) acc[l] = a1[l] = splat(0);
    int64_t i = 0;
    for (; i + 1 < K; i += 2) {
        const vf x = splat(e[i]), y = splat(e[i + 1]);
        UNROLL for (int l = 0; l < NV; l++) {
            acc[l] += x * S[NV * i + l];
            a1[l] += y * S[NV * (i + 1) + l];
        }
    }
    if (i < K) {
        const vf x = splat(e[i]);
        UNROLL for (int l = 0; l < NV; l++) acc[l] += x * S[NV * i + l];
    }
    UNROLL for (int l = 0; l < NV; l++) acc[l] += a1[l];
}

/* r = S^T e and p = S^T f in one sweep over a tile, SUMS partial sums per vector */
static inline void read_tile2(const vf *S, const float *e, const float *f, int64_t K, vf r[NV], vf p[NV])
{
    vf rs[SUMS][NV], ps[SUMS][NV];
    UNROLL for (int m = 0; m < SUMS; m++) UNROLL for (int l = 0; l < NV; l++) rs[m][l] = ps[m][l] = splat(0);
    int64_t i = 0;
    for (; i + SUMS <= K; i += SUMS)
        UNROLL for (int m = 0; m < SUMS; m++) {
            const vf a = splat(e[i + m]), x = splat(f[i + m]);
            UNROLL for (int l = 0; l < NV; l++) {
                const vf s = S[NV * (i + m) + l];
                rs[m][l] += a * s;
                ps[m][l] += x * s;
            }
        }
    for (; i < K; i++) {
        const vf a = splat(e[i]), x = splat(f[i]);
        UNROLL for (int l = 0; l < NV; l++) {
            const vf s = S[NV * i + l];
            rs[0][l] += a * s;
            ps[0][l] += x * s;
        }
    }
    UNROLL for (int l = 0; l < NV; l++) {
        r[l] = rs[0][l];
        p[l] = ps[0][l];
        UNROLL for (int m = 1; m < SUMS; m++) {
            r[l] += rs[m][l];
            p[l] += ps[m][l];
        }
    }
}

/* S_i += kc_i u, then r = S^T e and p = S^T f on the new rows while they are in registers */
static inline void update_read(vf *S, const float *kc, const vf u[NV], const float *e, const float *f,
                               int64_t K, vf r[NV], vf p[NV])
{
    vf rs[SUMS][NV], ps[SUMS][NV];
    UNROLL for (int m = 0; m < SUMS; m++) UNROLL for (int l = 0; l < NV; l++) rs[m][l] = ps[m][l] = splat(0);
    int64_t i = 0;
    for (; i + SUMS <= K; i += SUMS)
        UNROLL for (int m = 0; m < SUMS; m++) {
            const vf k = splat(kc[i + m]), a = splat(e[i + m]), x = splat(f[i + m]);
            UNROLL for (int l = 0; l < NV; l++) {
                const vf s = S[NV * (i + m) + l] + k * u[l];
                S[NV * (i + m) + l] = s;
                rs[m][l] += a * s;
                ps[m][l] += x * s;
            }
        }
    for (; i < K; i++) {
        const vf k = splat(kc[i]), a = splat(e[i]), x = splat(f[i]);
        UNROLL for (int l = 0; l < NV; l++) {
            const vf s = S[NV * i + l] + k * u[l];
            S[NV * i + l] = s;
            rs[0][l] += a * s;
            ps[0][l] += x * s;
        }
    }
    UNROLL for (int l = 0; l < NV; l++) {
        r[l] = rs[0][l];
        p[l] = ps[0][l];
        UNROLL for (int m = 1; m < SUMS; m++) {
            r[l] += rs[m][l];
            p[l] += ps[m][l];
        }
    }
}

/* The update alone: S_i += kc_i u (lazy) or S_i = cd_i S_i + kc_i u */
static inline void update(vf *S, const float *kc, const float *cd, int lazy, const vf u[NV], int64_t K)
{
    if (lazy)
        for (int64_t i = 0; i < K; i++) {
            const vf kk = splat(kc[i]);
            UNROLL for (int l = 0; l < NV; l++) S[NV * i + l] += kk * u[l];
        }
    else
        for (int64_t i = 0; i < K; i++) {
            const vf dd = splat(cd[i]), kk = splat(kc[i]);
            UNROLL for (int l = 0; l < NV; l++) S[NV * i + l] = dd * S[NV * i + l] + kk * u[l];
        }
}

/* Compact capture (P->capture): the parts of a transition, in the order a capture row holds them */
enum { CAPTURED_DECAY, CAPTURED_KEY, CAPTURED_U };

/* Token i of a sequence is captured: a capture is asked and i < its capacity. What the normal path
 * (capture NULL) pays: this test, three times per token and head. */
INLINE int capturing(const problem *P, int64_t i)
{
    return P->capture != NULL && i < P->capacity;
}

/* Where part `part` of transition i lies in sequence n's capture row: the decay factors [Dw] (Dw =
 * Hv*K with gk, else Hv), the key [Hk, K] or u [Hv, V] of every head; a head adds its offset. */
static float *captured(const problem *P, int64_t n, int64_t i, int part)
{
    const int64_t C = P->capacity, Hv = P->Hv, K = P->K;
    const int64_t width[3] = {P->gk ? Hv * K : Hv, Hv / P->rk * K, Hv * P->V};
    float *at = P->capture + n * C * (width[0] + width[1] + width[2]);
    for (int p = 0; p < part; p++)
        at += C * width[p];
    return at + i * width[part];
}

/* Stages the block's q and k rows and forms its key-side vectors; advances c. The block is tokens
 * t0 .. t0 + len of sequence n (bt0 the first's index in [B*T]); a captured token's decay factors
 * and (one state head per key head) its key go to the capture. */
static void key_side(const problem *P, const scratch *W, int64_t n, int64_t t0, int64_t bt0, int64_t h, int64_t len)
{
    const int64_t K = P->K, G = P->G, Hv = P->Hv;
    const int64_t hq = h / P->rq, hk = h / P->rk, Hq = Hv / P->rq, Hk = Hv / P->rk;
    for (int64_t s = 0; s < len; s++) {
        widen(W->kb + s * K, P->k, ((bt0 + s) * Hk + hk) * K, K, P->qk_type);
        widen(W->qb + s * G * K, P->q, ((bt0 + s) * Hq + hq) * G * K, G * K, P->qk_type);
        if (P->qk_l2norm)
            for (int64_t g = 0; g <= G; g++) {
                float *x = g < G ? W->qb + (s * G + g) * K : W->kb + s * K;
                const float f = 1.0f / sqrtf(dot(x, x, K) + P->l2norm_eps);
                for (int64_t i = 0; i < K; i++)
                    x[i] *= f;
            }
        if (capturing(P, t0 + s) && h % P->rk == 0)     /* the key head's first state head writes it */
            memcpy(captured(P, n, t0 + s, CAPTURED_KEY) + hk * K, W->kb + s * K, sizeof(float) * K);
    }
    float *c = W->c;
    for (int64_t s = 0; s < len; s++) {
        const int64_t th = (bt0 + s) * Hv + h;
        const float *kt = W->kb + s * K, *qt = W->qb + s * G * K;
        float *cd = W->cd + s * K, *eb = W->eb + s * K, *kc = W->kc + s * K;
        float gs = P->g ? get1(P->g, th, P->g_type) : 0.0f;
        if (P->g && P->raw_gate)
            gs = -expf(get1(P->a_log, h, P->a_type)) * softplus1(gs + get1(P->dt_bias, h, P->dtb_type));
        if (P->gk) {
            widen(cd, P->gk, th * K, K, P->gk_type);
            if (P->raw_gate) {
                widen(W->dtb, P->dt_bias, h * K, K, P->dtb_type);
                raw_decay_n(cd, get1(P->a_log, h, P->a_type), W->dtb, K);
            }
            exp_shifted(cd, cd, gs, K);
            if (capturing(P, t0 + s))                   /* the token's own decay, before the lazy scale */
                memcpy(captured(P, n, t0 + s, CAPTURED_DECAY) + h * K, cd, sizeof(float) * K);
            for (int64_t i = 0; i < K; i++)
                cd[i] *= c[i];
        } else {
            const float ds = P->g ? expf(gs) : 1.0f;
            if (capturing(P, t0 + s))
                captured(P, n, t0 + s, CAPTURED_DECAY)[h] = ds;
            for (int64_t i = 0; i < K; i++)
                cd[i] = c[i] * ds;
        }
        int outside = 0;             /* also set by a NaN */
        for (int64_t i = 0; i < K; i++)
            outside |= !(cd[i] >= LAZY_FLOOR && cd[i] <= 1.0f / LAZY_FLOOR);
        W->lazy[s] = !outside;
        if (P->b_form == CHANNEL) {
            widen(eb, P->b, th * K, K, P->b_type);
            if (P->gate_sigmoid)
                sigmoid_n(eb, K);
            for (int64_t i = 0; i < K; i++)
                eb[i] *= cd[i] * kt[i];
        } else {
            float bs = P->b_form == SCALAR ? get1(P->b, th, P->b_type) : 0.0f;
            if (P->b_form == SCALAR && P->gate_sigmoid)
                bs = sigmoid1(bs);
            for (int64_t i = 0; i < K; i++)
                eb[i] = cd[i] * bs * kt[i];
        }
        for (int64_t g = 0; g < G; g++) {
            float *eq = W->eq + (s * G + g) * K;
            for (int64_t i = 0; i < K; i++)
                eq[i] = cd[i] * qt[g * K + i];
            W->kq[s * G + g] = dot(qt + g * K, kt, K);
        }
        if (W->lazy[s])
            for (int64_t i = 0; i < K; i++) {
                kc[i] = kt[i] / cd[i];
                c[i] = cd[i];
            }
        else
            for (int64_t i = 0; i < K; i++) {
                kc[i] = kt[i];
                c[i] = 1.0f;
            }
    }
}

/* vw[0:n] = w*v of token-head th, columns j0 .. j0 + n */
static void load_wv(const problem *P, int64_t th, int64_t j0, int64_t n, float *vw)
{
    const int64_t V = P->V;
    widen(vw, P->v, th * V + j0, n, P->v_type);
    if (P->w_form == CHANNEL)
        for (int64_t j = 0; j < n; j += TILE) {
            float wt[TILE];
            const int64_t m = n - j < TILE ? n - j : TILE;
            widen(wt, P->w, th * V + j0 + j, m, P->w_type);
            if (P->gate_sigmoid)
                sigmoid_n(wt, m);
            for (int64_t l = 0; l < m; l++)
                vw[j + l] *= wt[l];
        }
    else if (P->w_form == SCALAR) {
        const float ws = P->gate_sigmoid ? sigmoid1(get1(P->w, th, P->w_type)) : get1(P->w, th, P->w_type);
        for (int64_t j = 0; j < n; j++)
            vw[j] *= ws;
    }
}

/* W->vw rows = w*v of the block's len tokens for the tile at column j0, zero-padded */
static void load_vw(const problem *P, const scratch *W, int64_t bt0, int64_t h, int64_t j0, int64_t len)
{
    const int64_t V = P->V, Hv = P->Hv, tw = V - j0 < TILE ? V - j0 : TILE;
    for (int64_t s = 0; s < len; s++) {
        float *vw = W->vw + s * TILE;
        load_wv(P, (bt0 + s) * Hv + h, j0, tw, vw);
        for (int64_t j = tw; j < TILE; j++)
            vw[j] = 0.0f;
    }
}

/* Block token s's outputs o_g = scale (S'^T q_g + (q_g . k) u) for the tile at j0; p0 is
 * the first query's read, further GQA queries read the old tile again. */
static void write_outputs(const problem *P, const scratch *W, const vf *S, int64_t n, int64_t bt, int64_t s,
                          int64_t h, int64_t j0, const vf p0[NV], const vf u[NV])
{
    const int64_t K = P->K, V = P->V, G = P->G, th = bt * P->Hv + h;
    const int64_t tw = V - j0 < TILE ? V - j0 : TILE;
    if (P->owner != NULL && P->owner[bt] != n)
        return;
    const vf sc = splat(P->scale);
    for (int64_t g = 0; g < G; g++) {
        vf p[NV], res[NV];
        if (g == 0)
            UNROLL for (int l = 0; l < NV; l++) p[l] = p0[l];
        else
            read_tile(S, W->eq + (s * G + g) * K, K, p);
        const vf kq = splat(W->kq[s * G + g]);
        UNROLL for (int l = 0; l < NV; l++) res[l] = sc * (p[l] + kq * u[l]);
        narrow(P->o, (th * G + g) * V + j0, (const float *)res, tw, P->v_type);
    }
}

/* Streaming stores for the per-token states (token_rows) as well as for the fresh final ones:
 * a verify step writes one row per token and the next step reads back at most one of them
 * (docs/performance.md has the measurement). */
#define STREAM_TOKEN_ROWS 1

/* NV vectors x to dst + off (type); nt: past the caches */
INLINE void put_row(char *dst, int64_t off, const vf x[NV], int type, int nt)
{
#if VEC == 8 && defined(__AVX2__)
    if (type == BF16) {              /* two vectors per pack and lane fix-up */
        UNROLL for (int l = 0; l < NV; l += 2) {
            const __m256i h = _mm256_permute4x64_epi64(
                _mm256_packus_epi32((__m256i)bf16_bits(x[l]), (__m256i)bf16_bits(x[l + 1])), 0xd8);
            uint16_t *d = (uint16_t *)dst + off + l * VEC;
            store_bytes(d, &h, sizeof h, nt);
        }
        return;
    }
#endif
    if (nt)
        UNROLL for (int l = 0; l < NV; l++) put(dst, off + l * VEC, x[l], type, 1);
    else
        UNROLL for (int l = 0; l < NV; l++) put(dst, off + l * VEC, x[l], type, 0);
}

INLINE void store_rows_as(char *dst, int64_t ld, const float *tile, const float *c, int64_t K, int type, int nt)
{
    for (int64_t i = 0; i < K; i++) {
        const vf ci = splat(c ? c[i] : 1.0f);
        vf x[NV];
        UNROLL for (int l = 0; l < NV; l++) x[l] = ci * ((const vf *)tile)[NV * i + l];
        put_row(dst, i * ld, x, type, nt);
    }
}

/* Row `row` of S, head h, columns j0 .. j0 + TILE = diag(c) tile (c NULL: 1), rounded to S's
 * dtype; nt: with streaming stores where the rows are 64-byte aligned. */
static void store_tile(const problem *P, const float *tile, const float *c, int64_t row, int64_t h, int64_t j0,
                       int nt)
{
    const int64_t K = P->K, tw = P->V - j0 < TILE ? P->V - j0 : TILE, *st = P->s_stride;
    const int type = P->s_type;
    char *dst = (char *)P->s + (row * st[0] + h * st[1] + j0 * st[3]) * size_of(type);
    if (st[3] == 1 && tw == TILE) {
        nt = nt && ((uintptr_t)dst & 63) == 0 && (st[2] * size_of(type)) % 64 == 0;
        if (type == F32)
            store_rows_as(dst, st[2], tile, c, K, F32, nt);
        else if (type == F16)
            store_rows_as(dst, st[2], tile, c, K, F16, nt);
        else
            store_rows_as(dst, st[2], tile, c, K, BF16, nt);
    } else
        for (int64_t i = 0; i < K; i++) {
            const float ci = c ? c[i] : 1.0f;
            for (int64_t j = 0; j < tw; j++)
                put1(dst, i * st[2] + j * st[3], ci * tile[i * TILE + j], type);
        }
}

/* One tile runs the block's len tokens from token index bt0 (in [B*T]), token t0 of sequence n.
 * Out of line: inlined into work, GCC 12 kept three of u's vectors on the stack in
 * update_read's loop (reloaded every row). */
__attribute__((noinline)) static void run_block(const problem *P, const scratch *W, vf *S, int64_t n, int64_t bt0, int64_t t0, int64_t h,
                      int64_t j0, int64_t len)
{
    const int64_t K = P->K, G = P->G;
    const int64_t *rows = P->token_rows ? P->token_rows + n * P->token_cols + t0 : NULL;
    load_vw(P, W, bt0, h, j0, len);
    vf r[NV], p0[NV];                /* token s's reads: S'^T (b k) and S'^T q_0 */
    read_tile2(S, W->eb, W->eq, K, r, p0);
    for (int64_t s = 0; s < len; s++) {
        vf u[NV];
        UNROLL for (int l = 0; l < NV; l++) u[l] = ((const vf *)(W->vw + s * TILE))[l] - r[l];
        if (P->u_out)
            memcpy(P->u_out + ((bt0 + s) * P->Hv + h) * P->V + j0, u,
                   sizeof(float) * (P->V - j0 < TILE ? P->V - j0 : TILE));
        if (capturing(P, t0 + s))
            memcpy(captured(P, n, t0 + s, CAPTURED_U) + h * P->V + j0, u,
                   sizeof(float) * (P->V - j0 < TILE ? P->V - j0 : TILE));
        write_outputs(P, W, S, n, bt0 + s, s, h, j0, p0, u);
        const float *kc = W->kc + s * K, *cd = W->cd + s * K;
        if (s + 1 < len && W->lazy[s])
            update_read(S, kc, u, W->eb + (s + 1) * K, W->eq + (s + 1) * G * K, K, r, p0);
        else {
            update(S, kc, cd, W->lazy[s], u, K);
            if (s + 1 < len)
                read_tile2(S, W->eb + (s + 1) * K, W->eq + (s + 1) * G * K, K, r, p0);
        }
        if (rows && rows[s] >= 0)    /* S = diag(c) S-hat, c = c*d after a lazy token, else 1 */
            store_tile(P, (const float *)S, W->lazy[s] ? cd : NULL, rows[s], h, j0, STREAM_TOKEN_ROWS);
    }
}

/* Whole rows. Single-token steps (decode) and sequences that store per-token states run token
 * by token on whole state rows rather than tiles: a tile pass touches TILE columns of every row
 * (128 of each 512 bytes on AVX2 at V = 128), and such strided passes over a state in memory
 * moved about half the bytes per second of sequential ones here (docs/performance.md). A token
 * reads the state twice, r and p in one pass (ROWS rows at a time over accumulators in L1), then
 * the update S' = D S + k u^T, written to every destination in the same sequential sweep: the
 * next token's float32 state, the token's row, the final row. */
#define ROWS 4

/* The next task's state rows, to prefetch while this one computes: row i lies at at + i * pitch,
 * bytes long (at NULL: nothing to prefetch). */
typedef struct {
    const char *at;
    int64_t pitch, bytes;
} ahead;

INLINE void prefetch(const ahead *A, int64_t i)
{
    if (A->at)
        for (int64_t b = 0; b < A->bytes; b += 64)
            __builtin_prefetch(A->at + i * A->pitch + b);
}

/* ra = S^T e (unless e is NULL) and rb = S^T f over whole rows: row i at element i*ld of S
 * (type), V a multiple of VEC */
/* read_rows for e and f both given and V a multiple of STRIP: each strip of STRIP columns keeps
 * its two sums in registers over all K rows (one load and two FMAs per state vector) */
#define STRIP (VEC == 16 ? 128 : 32)
#define SV (STRIP / VEC)
INLINE void read_strips(const void *S, int64_t ld, int type, const float *e, const float *f, int64_t K, int64_t V,
                        float *ra, float *rb)
{
    for (int64_t j = 0; j < V; j += STRIP) {
        vf x[SV], y[SV];
        UNROLL for (int l = 0; l < SV; l++) x[l] = y[l] = splat(0.0f);
        for (int64_t i = 0; i < K; i++) {
            const vf a = splat(e[i]), b = splat(f[i]);
            UNROLL for (int l = 0; l < SV; l++) {
                const vf s = get(S, i * ld + j + l * VEC, type);
                x[l] += a * s;
                y[l] += b * s;
            }
        }
        UNROLL for (int l = 0; l < SV; l++) {
            *(vf *)(ra + j + l * VEC) = x[l];
            *(vf *)(rb + j + l * VEC) = y[l];
        }
    }
}

INLINE void read_rows(const void *S, int64_t ld, int type, const float *e, const float *f, int64_t K, int64_t V,
                      float *ra, float *rb)
{
    if (e && V % STRIP == 0) {
        read_strips(S, ld, type, e, f, K, V, ra, rb);
        return;
    }
    for (int64_t j = 0; j < V; j++) {
        rb[j] = 0.0f;
        if (e)
            ra[j] = 0.0f;
    }
    for (int64_t i = 0; i < K; i += ROWS) {
        const int rows = K - i < ROWS ? (int)(K - i) : ROWS;
        vf a[ROWS], b[ROWS];
        UNROLL for (int m = 0; m < ROWS; m++) {
            a[m] = splat(e && m < rows ? e[i + m] : 0.0f);
            b[m] = splat(m < rows ? f[i + m] : 0.0f);
        }
        if (rows == ROWS)
            for (int64_t j = 0; j < V; j += VEC) {
                vf x = e ? *(const vf *)(ra + j) : splat(0), y = *(const vf *)(rb + j);
                UNROLL for (int m = 0; m < ROWS; m++) {
                    const vf s = get(S, (i + m) * ld + j, type);
                    x += a[m] * s;
                    y += b[m] * s;
                }
                if (e)
                    *(vf *)(ra + j) = x;
                *(vf *)(rb + j) = y;
            }
        else
            for (int m = 0; m < rows; m++)
                for (int64_t j = 0; j < V; j += VEC) {
                    const vf s = get(S, (i + m) * ld + j, type);
                    if (e)
                        *(vf *)(ra + j) += a[m] * s;
                    *(vf *)(rb + j) += b[m] * s;
                }
    }
}

/* A whole-rows step's destinations: dst (NULL or the next token's float32 state, [K, V]; may be
 * the source), rows d1, d2 of S (NULL: none; nt: streaming stores) */
typedef struct {
    float *dst;
    char *d1, *d2;
    int nt1, nt2;
} targets;

/* One token (token t of sequence n, at bt in [B*T]) from the state at src (rows ld0 elements apart,
 * in_type) to D (out_type); the update prefetches A's rows. Each element is read before it is written. */
INLINE void step_as(const problem *P, const scratch *W, int64_t n, int64_t t, int64_t bt, int64_t h, const char *src,
                    int64_t ld0, const targets *D, const ahead *A, int in_type, int out_type)
{
    const int64_t K = P->K, V = P->V, G = P->G, ld = P->s_stride[2], th = bt * P->Hv + h;
    float *r = W->acc, *p = r + V, *u = p + G * V;
    float *dst = D->dst;
    char *d1 = D->d1, *d2 = D->d2;
    const int nt1 = D->nt1, nt2 = D->nt2;
    const float *cd = W->cd, *kb = W->kb;
    for (int64_t i = 0; i < K; i++)
        W->c[i] = 1.0f;              /* the state is explicit between tokens: no lazy scale */
    key_side(P, W, n, t, bt, h, 1);
    read_rows(src, ld0, in_type, W->eb, W->eq, K, V, r, p);
    for (int64_t g = 1; g < G; g++)
        read_rows(src, ld0, in_type, NULL, W->eq + g * K, K, V, NULL, p + g * V);
    load_wv(P, th, 0, V, u);
    for (int64_t j = 0; j < V; j++)
        u[j] -= r[j];
    if (P->u_out)
        memcpy(P->u_out + th * V, u, sizeof(float) * V);
    if (capturing(P, t))
        memcpy(captured(P, n, t, CAPTURED_U) + h * V, u, sizeof(float) * V);
    if (P->owner == NULL || P->owner[bt] == n)
        for (int64_t g = 0; g < G; g++) {
            const float kq = W->kq[g];
            float *o = p + g * V;
            for (int64_t j = 0; j < V; j++)
                o[j] = P->scale * (o[j] + kq * u[j]);
            narrow(P->o, (th * G + g) * V, o, V, P->v_type);
        }
    for (int64_t i = 0; i < K; i++) {
        const vf dd = splat(cd[i]), kk = splat(kb[i]);
        prefetch(A, i);
        for (int64_t j = 0; j < V; j += TILE) {
            vf x[NV];
            UNROLL for (int l = 0; l < NV; l++)
                x[l] = dd * get(src, i * ld0 + j + l * VEC, in_type) + kk * *(const vf *)(u + j + l * VEC);
            if (dst)
                UNROLL for (int l = 0; l < NV; l++) *(vf *)(dst + i * V + j + l * VEC) = x[l];
            if (d1)
                put_row(d1, i * ld + j, x, out_type, nt1);
            if (d2)
                put_row(d2, i * ld + j, x, out_type, nt2);
        }
    }
}

/* Sequence n's tokens for head h on whole rows; next: the next task's state head (prefetched) */
INLINE void rows_as(const problem *P, const scratch *W, int64_t n, int64_t h, const char *next, int in_type,
                    int out_type)
{
    const int64_t K = P->K, V = P->V, T = P->T;
    const int64_t bt = P->spans[5 * n] * T + P->spans[5 * n + 1], len = P->spans[5 * n + 2] - P->spans[5 * n + 1];
    const int64_t in = P->spans[5 * n + 3], out = P->spans[5 * n + 4];
    const int64_t *st0 = P->s0_stride, *st = P->s_stride, out_size = size_of(out_type);
    const int aligned = (st[2] * out_size) % 64 == 0;
    float *state = W->tiles;         /* [K, V] between tokens */
    const char *src = (const char *)state;
    int64_t ld0 = V;
    if (in >= 0) {
        src = (const char *)P->s0 + (in * st0[0] + h * st0[1]) * size_of(in_type);
        ld0 = st0[2];
    } else
        memset(state, 0, sizeof(float) * K * V);
    for (int64_t t = 0; t < len; t++) {
        const int64_t tr = P->token_rows ? P->token_rows[n * P->token_cols + t] : -1;
        const int last = t + 1 == len;
        targets D = {last ? NULL : state, NULL, NULL, 0, 0};
        if (last && out >= 0)
            D.d1 = (char *)P->s + (out * st[0] + h * st[1]) * out_size;
        if (tr >= 0)
            D.d2 = (char *)P->s + (tr * st[0] + h * st[1]) * out_size;
        /* past the caches where aligned, except into the row being read (its lines are cached) */
        D.nt1 = P->stream_state && aligned && ((uintptr_t)D.d1 & 63) == 0 && D.d1 != src;
        D.nt2 = STREAM_TOKEN_ROWS && aligned && ((uintptr_t)D.d2 & 63) == 0 && D.d2 != src;
        const int64_t size = size_of(P->s0_type);
        const ahead A = {last ? next : NULL, st0[2] * size, V * size};
        if (t == 0)
            step_as(P, W, n, t, bt, h, src, ld0, &D, &A, in_type, out_type);
        else
            step_as(P, W, n, t, bt + t, h, (const char *)state, V, &D, &A, F32, out_type);
    }
}

#define ROWS_AS(a, b) case 3 * (a) + (b): rows_as(P, W, n, h, next, a, b); break

static void run_rows(const problem *P, const scratch *W, int64_t n, int64_t h, const char *next)
{
    switch (3 * (P->spans[5 * n + 3] >= 0 ? P->s0_type : F32) + P->s_type) {
    ROWS_AS(F32, F32); ROWS_AS(F32, F16); ROWS_AS(F32, BF16);
    ROWS_AS(F16, F32); ROWS_AS(F16, F16); ROWS_AS(F16, BF16);
    ROWS_AS(BF16, F32); ROWS_AS(BF16, F16); ROWS_AS(BF16, BF16);
    }
}

/* Runs task (n, h); next (NULL: none) is the next task's state head in S0, prefetched on the way. */
static void run_task(const problem *P, const scratch *W, int64_t n, int64_t h, const char *next)
{
    const int64_t K = P->K, V = P->V, T = P->T;
    const int64_t row = P->spans[5 * n], start = P->spans[5 * n + 1], end = P->spans[5 * n + 2];
    const int64_t in = P->spans[5 * n + 3], out = P->spans[5 * n + 4];
    const int64_t tiles = (V + TILE - 1) / TILE;

    if (start == end && out < 0)     /* padding: no token, no state to write */
        return;
    int64_t stores = 0;              /* per-token states to store */
    for (int64_t t = 0; P->token_rows && t < end - start; t++)
        stores += P->token_rows[n * P->token_cols + t] >= 0;
    /* Whole rows per token for decode and where most tokens store their state (speculative
     * verify); a long sequence that stores a few (the chunk starts of fla's intermediate
     * states) keeps the tiles, which store as they go (T = 4096, 66 stores: the call 1.5x faster). */
    if ((end - start == 1 || stores * ROWS_STORE_SHARE > end - start) && V % TILE == 0 && P->s_stride[3] == 1
            && (in < 0 || P->s0_stride[3] == 1)) {
        run_rows(P, W, n, h, next);
        return;
    }
    /* every tile is read before any state is stored: a token row may be the read row */
    for (int64_t x = 0; x < tiles; x++) {
        const int64_t j0 = x * TILE, tw = V - j0 < TILE ? V - j0 : TILE;
        for (int64_t i = 0; i < K; i++) {
            float *dst = W->tiles + (x * K + i) * TILE;
            if (in >= 0) {
                const int64_t *st = P->s0_stride, at = in * st[0] + h * st[1] + i * st[2] + j0 * st[3];
                if (st[3] == 1)
                    widen(dst, P->s0, at, tw, P->s0_type);
                else
                    for (int64_t j = 0; j < tw; j++)
                        dst[j] = get1(P->s0, at + j * st[3], P->s0_type);
            } else
                memset(dst, 0, sizeof(float) * tw);
            memset(dst + tw, 0, sizeof(float) * (TILE - tw));
        }
    }
    for (int64_t i = 0; i < K; i++)
        W->c[i] = 1.0f;
    for (int64_t t = start; t < end; t += TB) {
        const int64_t len = end - t < TB ? end - t : TB, done = t + len - start;
        key_side(P, W, n, t - start, row * T + t, h, len);
        for (int64_t x = 0; x < tiles; x++)
            run_block(P, W, (vf *)(W->tiles + x * K * TILE), n, row * T + t, t - start, h, x * TILE, len);
        if (P->checkpoint && done % P->checkpoint == 0 && t + len < end)
            for (int64_t x = 0; x < tiles; x++)
                store_tile(P, W->tiles + x * K * TILE, W->c, in + done / P->checkpoint, h, x * TILE, 0);
    }
    if (out >= 0)
        for (int64_t x = 0; x < tiles; x++)
            store_tile(P, W->tiles + x * K * TILE, W->c, out, h, x * TILE, P->stream_state);
}

/* Tasks are split into one contiguous block per thread of the call (the caller's first, then
 * the helpers', by their ids): a thread drains its own block, then takes what is left of the
 * others'. So the same heads run on the same thread call after call, their states staying in
 * that core's cache (a shared counter dealt them out anew: B = 1 decode on 2 threads ran at
 * 0.69x its 1-thread time), and a helper that never arrives leaves its block to the others. */
#define MAX_BLOCKS 64
typedef struct {
    atomic_llong next;               /* the block's next task */
    int64_t end;
    char pad[48];                    /* a cache line per block */
} block;

typedef struct {
    const problem *P;
    int64_t tasks;
    int blocks;
    atomic_int failed;
    block block[MAX_BLOCKS];
} pool;

/* The next task for thread `me` (its block first), or -1 */
static int64_t claim(pool *W, int me)
{
    for (int k = 0; k < W->blocks; k++) {
        block *b = &W->block[(me + k) % W->blocks];
        if (atomic_load_explicit(&b->next, memory_order_relaxed) >= b->end)
            continue;
        const int64_t t = atomic_fetch_add(&b->next, 1);
        if (t < b->end)
            return t;
    }
    return -1;
}

/* W's tasks split into n blocks */
static void split(pool *W, int n)
{
    W->blocks = n;
    for (int b = 0; b < n; b++) {
        atomic_init(&W->block[b].next, W->tasks * b / n);
        W->block[b].end = W->tasks * (b + 1) / n;
    }
}

/* Thread `me` of the call (0: the caller) works on the pool's tasks until none is left */
static void work(void *job, int me)
{
    pool *W = job;
    const problem *P = W->P;
    const int64_t K = P->K, G = P->G, tiles = (P->V + TILE - 1) / TILE;
    const int64_t acc = ((G + 2) * P->V + 15) / 16 * 16;
    const int64_t floats = (acc + TB * (TILE + (4 + 2 * G) * K + G) + 2 * K + 15) / 16 * 16;
    const size_t tile_bytes = sizeof(float) * tiles * K * TILE;     /* a multiple of 64 */
    char *mem = team_scratch(tile_bytes + sizeof(float) * floats + sizeof(int) * TB);
    if (!mem)
        atomic_store(&W->failed, 1);
    else {
        scratch s = {.tiles = (float *)mem, .acc = (float *)(mem + tile_bytes)};
        float *f = s.acc;            /* acc and vw first: they are read as aligned vectors */
        s.vw = f + acc;
        s.kb = s.vw + TB * TILE;
        s.qb = s.kb + TB * K;
        s.cd = s.qb + TB * G * K;
        s.eb = s.cd + TB * K;
        s.kc = s.eb + TB * K;
        s.eq = s.kc + TB * K;
        s.kq = s.eq + TB * G * K;
        s.c = s.kq + TB * G;
        s.dtb = s.c + K;
        s.lazy = (int *)(f + floats);
        /* each task after the first is claimed while the one before runs, which prefetches its state */
        const int64_t size = size_of(P->s0_type), *st = P->s0_stride;
        for (int64_t task = claim(W, me), then; task >= 0; task = then) {
            then = claim(W, me);
            const int64_t m = then / P->Hv, in = then >= 0 ? P->spans[5 * m + 3] : -1;
            const char *next = P->prefetch_next && in >= 0 && st[3] == 1
                ? (const char *)P->s0 + (in * st[0] + then % P->Hv * st[1]) * size : NULL;
            run_task(P, &s, task / P->Hv, task % P->Hv, next);
        }
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* orders the streaming stores before the join */
}

/* The flat index of the first element of x[0:n] (type) above zero, or -1 (NaN is not) */
static int64_t first_positive(const void *x, int64_t n, int type)
{
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) {
        const vi above = get(x, i, type) > splat(0.0f);
        int any = 0;
        for (int l = 0; l < VEC; l++)
            any |= above[l];
        if (any)
            break;
    }
    for (; i < n; i++)
        if (get1(x, i, type) > 0.0f)
            return i;
    return -1;
}

/* Runs every (sequence, head) task on the calling thread and up to threads - 1
 * helpers (team.h: the host's OpenMP threads where installed, else the kernel's own, fewer
 * on a contended machine), sharing the tasks through atomic counters (any number of threads
 * completes them). Returns 0, 1 if a buffer could not be allocated (some tasks
 * then did not run); before any work, 4 if an operand meets the slab
 * (slab_bytes), or with check_decay 2 (3) if g (gk) holds a positive log decay
 * (*bad says where). */
int deltarule_recurrent(const problem *P, int threads)
{
    if (P->slab_bytes > 0) {
        const uintptr_t lo = (uintptr_t)P->s, hi = lo + (uintptr_t)P->slab_bytes;
        const void *operand[9] = {P->q, P->k, P->v, P->g, P->gk, P->b, P->w, P->a_log, P->dt_bias};
        for (int i = 0; i < 9; i++) {
            const uintptr_t a = (uintptr_t)operand[i];
            if (P->operand_bytes[i] > 0 && a < hi && lo < a + (uintptr_t)P->operand_bytes[i]) {
                *P->bad = i;
                return 4;
            }
        }
    }
    if (P->check_decay && !P->raw_gate) {
        if (P->g && (*P->bad = first_positive(P->g, P->tokens * P->Hv, P->g_type)) >= 0)
            return 2;
        if (P->gk && (*P->bad = first_positive(P->gk, P->tokens * P->Hv * P->K, P->gk_type)) >= 0)
            return 3;
    }
    pool W = {.P = P, .tasks = P->N * P->Hv};
    atomic_init(&W.failed, 0);
    if (W.tasks == 0)                /* no task: no thread, no scratch */
        return 0;
    if (threads > W.tasks)
        threads = (int)W.tasks;
    if (threads > MAX_BLOCKS)
        threads = MAX_BLOCKS;
    const int64_t steps = P->tokens * P->Hv * P->K * P->V;
    threads = team_size(threads, steps);
    split(&W, threads);
    team_run(work, &W, threads, steps);
    return atomic_load(&W.failed);
}
