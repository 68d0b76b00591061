/* Fused recurrence of the generalized gated delta rule for the CPU.
 *
 * Tiles. The columns of the state are independent: column j of S only ever
 * meets v_j, w_j and column j itself (S^T (b k) and S^T q are per column, the
 * update adds k u_j). A task owns one (sequence, state head); its state lies
 * in [K, TILE] tiles of TILE value columns, and a tile (32 KB at K = 128)
 * stays in the L1 cache while it runs a block of TB tokens:
 *
 *   read:    r = S'^T (b*k),  p_g = S'^T q_g            S' = D S, the old state decayed
 *            u = w*v - r,     o_g = scale * (p_g + (q_g . k) u)
 *   update:  S = S' + k u^T
 *
 * which is DESIGN.md section 1 read after the update: S_t^T q = S'^T q + u (k . q).
 *
 * Lazy decay. The tiles hold S-hat with S = diag(c) S-hat. The decay folds into
 * the key-side vectors (c' = c*d; r = S-hat^T (c'*b*k), p_g = S-hat^T (c'*q_g))
 * and the update becomes one FMA per element, S-hat += (k / c') u^T, c = c'.
 * When some c' leaves [LAZY_FLOOR, 1 / LAZY_FLOOR] (after about 20 / |log decay|
 * tokens, at once for a decay that underflows, or a NaN), that token applies c'
 * to the tiles instead (S-hat = c' S-hat + k u^T) and c restarts at 1.
 *
 * One sweep per token. With the lazy update, token t's update of a tile row
 * and token t+1's reads of the same row share one load: a token costs 12
 * vector operations per tile row (the update FMA and the two read FMAs, the
 * same for scalar, per-key and GDN-2 gates); GQA groups read again per query.
 *
 * Blocks. The key-side vectors depend on the head only, not on the tile: they
 * are formed once per token for a block of TB tokens, from the q and k rows
 * staged contiguously (one head's rows lie Hv*K floats apart from token to
 * token; staging them together lets their cache misses overlap), and every
 * tile then runs the block.
 *
 * Inputs. q, k and v are read in their own dtype (float32, float16 or
 * bfloat16), widened to float32 as they are staged (and L2-normalised there
 * with qk_l2norm); o is written in v's dtype.
 * Gates and states are float32. Accumulation is float32 throughout.
 *
 * Compute only: contiguous operands, validated by the caller.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VEC 16                       /* floats per vector */
#define NV 4                         /* vectors per tile row */
#define TILE (VEC * NV)              /* value columns per tile */
#define TB 16                        /* tokens per block */
#define LAZY_FLOOR 0x1p-30f
#define UNROLL _Pragma("GCC unroll 8")

typedef float vf __attribute__((vector_size(64), aligned(64)));

static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* A store that bypasses the caches (64-byte aligned dst), where the CPU has one. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline void stream(float *dst, vf x) { _mm512_stream_ps(dst, (__m512)x); }
#else
static inline void stream(float *dst, vf x) { memcpy(dst, &x, sizeof x); }
#endif

/* Gate forms: 0 absent, 1 scalar per (token, head), 2 per channel. */
enum { ABSENT = 0, SCALAR = 1, CHANNEL = 2 };
/* Element types of q, k, v and o. */
enum { F32 = 0, F16 = 1, BF16 = 2 };

/* dst[0:n] = x[off:off+n] widened to float32 */
static inline void widen(float *dst, const void *x, int64_t off, int64_t n, int type)
{
    if (type == F32)
        memcpy(dst, (const float *)x + off, sizeof(float) * n);
    else if (type == F16) {
        const _Float16 *src = (const _Float16 *)x + off;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + VEC <= n; i += VEC)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#endif
        for (; i < n; i++)
            dst[i] = (float)src[i];
    } else {
        const uint16_t *src = (const uint16_t *)x + off;
        for (int64_t i = 0; i < n; i++) {
            const uint32_t bits = (uint32_t)src[i] << 16;
            memcpy(dst + i, &bits, sizeof bits);
        }
    }
}

/* x[off:off+n] = src[0:n] narrowed from float32, rounding to nearest even (as torch does) */
static inline void narrow(void *x, int64_t off, const float *src, int64_t n, int type)
{
    if (type == F32)
        memcpy((float *)x + off, src, sizeof(float) * n);
    else if (type == F16) {
        _Float16 *dst = (_Float16 *)x + off;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + VEC <= n; i += VEC)
            _mm256_storeu_si256((__m256i *)(dst + i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; i++)
            dst[i] = (_Float16)src[i];
    } else {
        uint16_t *dst = (uint16_t *)x + off;
        for (int64_t i = 0; i < n; i++) {
            uint32_t bits;
            memcpy(&bits, src + i, sizeof bits);
            dst[i] = (bits & 0x7fffffffu) > 0x7f800000u
                ? (uint16_t)((bits >> 16) | 0x40)                         /* NaN stays NaN */
                : (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
        }
    }
}

typedef struct {
    const void *q, *k, *v;           /* [B, T, Hv/rq, G, K], [B, T, Hv/rk, K] (qk_type), [B, T, Hv, V] (v_type) */
    const float *g;                  /* NULL or [B, T, Hv] scalar log decay */
    const void *gk;                  /* NULL or [B, T, Hv, K] per-key log decay (gk_type) */
    const void *b, *w;               /* erase, write: float32 [B, T, Hv], or [B, T, Hv, K] (b, b_type)
                                        and [B, T, Hv, V] (w, w_type), by their forms */
    const float *s0;                 /* initial states [slot, Hv, K, V] at strides s0_stride */
    float *s;                        /* final states, strides s_stride (may be s0: a slab in place) */
    void *o;                         /* [B, T, Hv, G, V] (v_type) */
    const int64_t *spans;            /* [N, 5]: row, start, end, initial slot (-1: zeros), final slot (-1: none) */
    const int32_t *owner;            /* NULL, or [B*T]: the span whose output a token keeps (-1: none) */
    int64_t N, T, Hv, K, V, G, rq, rk;
    int64_t s0_stride[4], s_stride[4];   /* in floats: slot, head, key, value */
    int b_form, w_form;
    int qk_type, v_type, gk_type, b_type, w_type;
    int stream_state;                /* write s with streaming stores (a large fresh state) */
    int qk_l2norm;                   /* normalise staged q and k rows: x / sqrt(sum x^2 + l2norm_eps) */
    float l2norm_eps;
    float scale;
} problem;

/* A thread's scratch, reused by its tasks. Key-side rows are per token of a block. */
typedef struct {
    float *tiles;                    /* [tiles, K, TILE] the head's S-hat, 64-byte aligned */
    float *kb, *qb;                  /* staged k, q rows: [TB, K], [TB, G*K] */
    float *cd, *eb, *eq, *kq, *kc;   /* [TB, K] c*d, [TB, K] c*d*b*k, [TB, G*K] c*d*q_g, [TB, G] q_g . k,
                                        [TB, K] update factor: k / (c*d) (lazy) or k */
    int *lazy;                       /* [TB] */
    float *c;                        /* [K] the lazy scale after the block's last token */
    float *vw;                       /* [TB, TILE] w*v of one tile, zero-padded */
} scratch;

typedef int32_t vi __attribute__((vector_size(64), aligned(64)));

/* exp of 16 floats: exp(x) = 2^n exp(r), n = round(x / ln 2), |r| <= ln(2) / 2, exp(r) by a
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

/* x . y over n floats, in 16 partial sums */
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

/* Rows of NV vectors at any float alignment: the state where it lies (decode). */
typedef float vfu __attribute__((vector_size(64), aligned(4)));
#define ROW(S, ld, i, l) (*(const vfu *)((S) + (i) * (ld) + (l) * VEC))

/* acc = S^T e over a tile whose row i starts at S + i*ld, two partial sums per vector */
static inline void read_tile(const float *S, int64_t ld, const float *e, int64_t K, vf acc[NV])
{
    vf a1[NV];
    UNROLL for (int l = 0; l < NV; l++) acc[l] = a1[l] = splat(0);
    int64_t i = 0;
    for (; i + 1 < K; i += 2) {
        const vf x = splat(e[i]), y = splat(e[i + 1]);
        UNROLL for (int l = 0; l < NV; l++) {
            acc[l] += x * ROW(S, ld, i, l);
            a1[l] += y * ROW(S, ld, i + 1, l);
        }
    }
    if (i < K) {
        const vf x = splat(e[i]);
        UNROLL for (int l = 0; l < NV; l++) acc[l] += x * ROW(S, ld, i, l);
    }
    UNROLL for (int l = 0; l < NV; l++) acc[l] += a1[l];
}

/* r = S^T e and p = S^T f in one sweep */
static inline void read_tile2(const float *S, int64_t ld, const float *e, const float *f, int64_t K,
                              vf r[NV], vf p[NV])
{
    vf r1[NV], p1[NV];
    UNROLL for (int l = 0; l < NV; l++) r[l] = p[l] = r1[l] = p1[l] = splat(0);
    int64_t i = 0;
    for (; i + 1 < K; i += 2) {
        const vf a = splat(e[i]), b = splat(e[i + 1]), x = splat(f[i]), y = splat(f[i + 1]);
        UNROLL for (int l = 0; l < NV; l++) {
            const vf s0 = ROW(S, ld, i, l), s1 = ROW(S, ld, i + 1, l);
            r[l] += a * s0; p[l] += x * s0;
            r1[l] += b * s1; p1[l] += y * s1;
        }
    }
    if (i < K) {
        const vf a = splat(e[i]), x = splat(f[i]);
        UNROLL for (int l = 0; l < NV; l++) {
            r[l] += a * ROW(S, ld, i, l); p[l] += x * ROW(S, ld, i, l);
        }
    }
    UNROLL for (int l = 0; l < NV; l++) {
        r[l] += r1[l];
        p[l] += p1[l];
    }
}

/* S_i += kc_i u, then r = S^T e and p = S^T f on the new rows while they are in registers */
static inline void update_read(vf *S, const float *kc, const vf u[NV], const float *e, const float *f,
                               int64_t K, vf r[NV], vf p[NV])
{
    vf r1[NV], p1[NV];
    UNROLL for (int l = 0; l < NV; l++) r[l] = p[l] = r1[l] = p1[l] = splat(0);
    int64_t i = 0;
    for (; i + 1 < K; i += 2) {
        const vf k0 = splat(kc[i]), k1 = splat(kc[i + 1]);
        const vf a = splat(e[i]), b = splat(e[i + 1]), x = splat(f[i]), y = splat(f[i + 1]);
        UNROLL for (int l = 0; l < NV; l++) {
            const vf s0 = S[NV * i + l] + k0 * u[l], s1 = S[NV * (i + 1) + l] + k1 * u[l];
            S[NV * i + l] = s0;
            S[NV * (i + 1) + l] = s1;
            r[l] += a * s0; p[l] += x * s0;
            r1[l] += b * s1; p1[l] += y * s1;
        }
    }
    if (i < K) {
        const vf k0 = splat(kc[i]), a = splat(e[i]), x = splat(f[i]);
        UNROLL for (int l = 0; l < NV; l++) {
            const vf s0 = S[NV * i + l] + k0 * u[l];
            S[NV * i + l] = s0;
            r[l] += a * s0; p[l] += x * s0;
        }
    }
    UNROLL for (int l = 0; l < NV; l++) {
        r[l] += r1[l];
        p[l] += p1[l];
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

/* Stages the block's q and k rows and forms its key-side vectors; advances c. */
static void key_side(const problem *P, const scratch *W, int64_t bt0, int64_t h, int64_t len)
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
    }
    float *c = W->c;
    for (int64_t s = 0; s < len; s++) {
        const int64_t th = (bt0 + s) * Hv + h;
        const float *kt = W->kb + s * K, *qt = W->qb + s * G * K;
        float *cd = W->cd + s * K, *eb = W->eb + s * K, *kc = W->kc + s * K;
        const float gs = P->g ? P->g[th] : 0.0f;
        if (P->gk) {
            widen(cd, P->gk, th * K, K, P->gk_type);
            exp_shifted(cd, cd, gs, K);
            for (int64_t i = 0; i < K; i++)
                cd[i] *= c[i];
        } else {
            const float ds = P->g ? expf(gs) : 1.0f;
            for (int64_t i = 0; i < K; i++)
                cd[i] = c[i] * ds;
        }
        int outside = 0;             /* also set by a NaN */
        for (int64_t i = 0; i < K; i++)
            outside |= !(cd[i] >= LAZY_FLOOR && cd[i] <= 1.0f / LAZY_FLOOR);
        W->lazy[s] = !outside;
        if (P->b_form == CHANNEL) {
            widen(eb, P->b, th * K, K, P->b_type);
            for (int64_t i = 0; i < K; i++)
                eb[i] *= cd[i] * kt[i];
        } else {
            const float bs = P->b_form == SCALAR ? ((const float *)P->b)[th] : 0.0f;
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

/* W->vw rows = w*v of the block's len tokens for the tile at column j0, zero-padded */
static void load_vw(const problem *P, const scratch *W, int64_t bt0, int64_t h, int64_t j0, int64_t len)
{
    const int64_t V = P->V, Hv = P->Hv, tw = V - j0 < TILE ? V - j0 : TILE;
    for (int64_t s = 0; s < len; s++) {
        const int64_t th = (bt0 + s) * Hv + h;
        float *vw = W->vw + s * TILE;
        widen(vw, P->v, th * V + j0, tw, P->v_type);
        if (P->w_form == CHANNEL) {
            float wt[TILE];
            widen(wt, P->w, th * V + j0, tw, P->w_type);
            for (int64_t j = 0; j < tw; j++)
                vw[j] *= wt[j];
        } else if (P->w_form == SCALAR) {
            const float ws = ((const float *)P->w)[th];
            for (int64_t j = 0; j < tw; j++)
                vw[j] *= ws;
        }
        for (int64_t j = tw; j < TILE; j++)
            vw[j] = 0.0f;
    }
}

/* Block token s's outputs o_g = scale (S'^T q_g + (q_g . k) u) for the tile at j0; p0 is
 * the first query's read, further GQA queries read the old tile (rows S + i*ld) again. */
static void write_outputs(const problem *P, const scratch *W, const float *S, int64_t ld, int64_t n,
                          int64_t bt, int64_t s, int64_t h, int64_t j0, const vf p0[NV], const vf u[NV])
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
            read_tile(S, ld, W->eq + (s * G + g) * K, K, p);
        const vf kq = splat(W->kq[s * G + g]);
        UNROLL for (int l = 0; l < NV; l++) res[l] = sc * (p[l] + kq * u[l]);
        narrow(P->o, (th * G + g) * V + j0, (const float *)res, tw, P->v_type);
    }
}

/* One tile runs the block's len tokens from token index bt0 (in [B*T]) of sequence n. */
static void run_block(const problem *P, const scratch *W, vf *S, int64_t n, int64_t bt0, int64_t h,
                      int64_t j0, int64_t len)
{
    const int64_t K = P->K, G = P->G;
    load_vw(P, W, bt0, h, j0, len);
    vf r[NV], p0[NV];                /* token s's reads: S'^T (b k) and S'^T q_0 */
    read_tile2((const float *)S, TILE, W->eb, W->eq, K, r, p0);
    for (int64_t s = 0; s < len; s++) {
        vf u[NV];
        UNROLL for (int l = 0; l < NV; l++) u[l] = ((const vf *)(W->vw + s * TILE))[l] - r[l];
        write_outputs(P, W, (const float *)S, TILE, n, bt0 + s, s, h, j0, p0, u);
        const float *kc = W->kc + s * K, *cd = W->cd + s * K;
        if (s + 1 < len && W->lazy[s])
            update_read(S, kc, u, W->eb + (s + 1) * K, W->eq + (s + 1) * G * K, K, r, p0);
        else {
            update(S, kc, cd, W->lazy[s], u, K);
            if (s + 1 < len)
                read_tile2((const float *)S, TILE, W->eb + (s + 1) * K, W->eq + (s + 1) * G * K, K, r, p0);
        }
    }
}

/* Decode: one token from the state where it lies (rows of V contiguous floats, V a multiple
 * of TILE) straight to the final state, S = D S0 + k u^T, without the tile buffer. */
static void decode_task(const problem *P, const scratch *W, int64_t n, int64_t h)
{
    const int64_t K = P->K, V = P->V, T = P->T;
    const int64_t bt = P->spans[5 * n] * T + P->spans[5 * n + 1];
    const int64_t in = P->spans[5 * n + 3], out = P->spans[5 * n + 4];
    const int64_t *st0 = P->s0_stride, *st = P->s_stride;
    for (int64_t i = 0; i < K; i++)
        W->c[i] = 1.0f;
    key_side(P, W, bt, h, 1);
    for (int64_t j0 = 0; j0 < V; j0 += TILE) {
        const float *src = P->s0 + in * st0[0] + h * st0[1] + j0;
        float *dst = P->s + out * st[0] + h * st[1] + j0;
        vf r[NV], p0[NV], u[NV];
        load_vw(P, W, bt, h, j0, 1);
        read_tile2(src, st0[2], W->eb, W->eq, K, r, p0);
        UNROLL for (int l = 0; l < NV; l++) u[l] = ((const vf *)W->vw)[l] - r[l];
        write_outputs(P, W, src, st0[2], n, bt, 0, h, j0, p0, u);
        const int stream_out = P->stream_state && ((uintptr_t)dst & 63) == 0 && (st[2] & (VEC - 1)) == 0;
        for (int64_t i = 0; i < K; i++) {
            const vf dd = splat(W->cd[i]), kk = splat(W->kb[i]);
            UNROLL for (int l = 0; l < NV; l++) {
                const vf x = dd * ROW(src, st0[2], i, l) + kk * u[l];
                if (stream_out)
                    stream(dst + i * st[2] + l * VEC, x);
                else
                    memcpy(dst + i * st[2] + l * VEC, &x, sizeof x);
            }
        }
    }
}

static void run_task(const problem *P, const scratch *W, int64_t n, int64_t h)
{
    const int64_t K = P->K, V = P->V, T = P->T;
    const int64_t row = P->spans[5 * n], start = P->spans[5 * n + 1], end = P->spans[5 * n + 2];
    const int64_t in = P->spans[5 * n + 3], out = P->spans[5 * n + 4];
    const int64_t tiles = (V + TILE - 1) / TILE;

    if (end - start == 1 && in >= 0 && out >= 0 && V % TILE == 0
            && P->s0_stride[3] == 1 && P->s_stride[3] == 1) {
        decode_task(P, W, n, h);
        return;
    }
    for (int64_t x = 0; x < tiles; x++) {
        const int64_t j0 = x * TILE, tw = V - j0 < TILE ? V - j0 : TILE;
        for (int64_t i = 0; i < K; i++) {
            float *dst = W->tiles + (x * K + i) * TILE;
            if (in >= 0) {
                const int64_t *st = P->s0_stride;
                const float *src = P->s0 + in * st[0] + h * st[1] + i * st[2] + j0 * st[3];
                if (st[3] == 1)
                    memcpy(dst, src, sizeof(float) * tw);
                else
                    for (int64_t j = 0; j < tw; j++)
                        dst[j] = src[j * st[3]];
            } else
                memset(dst, 0, sizeof(float) * tw);
            memset(dst + tw, 0, sizeof(float) * (TILE - tw));
        }
    }
    for (int64_t i = 0; i < K; i++)
        W->c[i] = 1.0f;
    for (int64_t t = start; t < end; t += TB) {
        const int64_t len = end - t < TB ? end - t : TB;
        key_side(P, W, row * T + t, h, len);
        for (int64_t x = 0; x < tiles; x++)
            run_block(P, W, (vf *)(W->tiles + x * K * TILE), n, row * T + t, h, x * TILE, len);
    }
    if (out >= 0)
        for (int64_t x = 0; x < tiles; x++) {
            const int64_t j0 = x * TILE, tw = V - j0 < TILE ? V - j0 : TILE;
            for (int64_t i = 0; i < K; i++) {
                const int64_t *st = P->s_stride;
                const float *src = W->tiles + (x * K + i) * TILE, ci = W->c[i];
                float *dst = P->s + out * st[0] + h * st[1] + i * st[2] + j0 * st[3];
                if (P->stream_state && st[3] == 1 && tw == TILE && ((uintptr_t)dst & 63) == 0) {
                    /* streaming stores: a fresh state is not read back soon, and
                     * they skip reading its old lines in first */
                    const vf cv = splat(ci);
                    UNROLL for (int l = 0; l < NV; l++)
                        stream(dst + l * VEC, cv * ((const vf *)src)[l]);
                } else if (st[3] == 1)
                    for (int64_t j = 0; j < tw; j++)
                        dst[j] = ci * src[j];
                else
                    for (int64_t j = 0; j < tw; j++)
                        dst[j * st[3]] = ci * src[j];
            }
        }
}

typedef struct {
    const problem *P;
    int64_t tasks;
    atomic_llong next;               /* the next task to take (dynamic schedule) */
    atomic_int failed;
} pool;

static void *work(void *arg)
{
    pool *W = arg;
    const problem *P = W->P;
    const int64_t K = P->K, G = P->G, tiles = (P->V + TILE - 1) / TILE;
    scratch s = {.tiles = aligned_alloc(64, sizeof(float) * tiles * K * TILE)};  /* a multiple of 64 bytes */
    const int64_t floats = TB * (TILE + (4 + 2 * G) * K + G) + K;
    float *f = aligned_alloc(64, sizeof(float) * ((floats + VEC - 1) / VEC * VEC));
    int *lazy = malloc(sizeof(int) * TB);
    if (!s.tiles || !f || !lazy)
        atomic_store(&W->failed, 1);
    else {
        s.vw = f;                    /* first: its rows are read as aligned vectors */
        s.kb = s.vw + TB * TILE;
        s.qb = s.kb + TB * K;
        s.cd = s.qb + TB * G * K;
        s.eb = s.cd + TB * K;
        s.kc = s.eb + TB * K;
        s.eq = s.kc + TB * K;
        s.kq = s.eq + TB * G * K;
        s.c = s.kq + TB * G;
        s.lazy = lazy;
        for (int64_t task; (task = atomic_fetch_add(&W->next, 1)) < W->tasks;)
            run_task(P, &s, task / P->Hv, task % P->Hv);
    }
    free(s.tiles);
    free(f);
    free(lazy);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* orders the streaming stores before the join */
    return NULL;
}

/* The helper threads, kept between calls: creating a thread costs ~30-40 us here,
 * a wake-up on the condition variable much less. Idle helpers block (no spinning
 * beside torch's threads). One call at a time uses them; a concurrent call runs
 * on its own thread alone. A forked child starts with none. */
static struct {
    pthread_mutex_t busy;            /* held by the call that uses the helpers */
    pthread_mutex_t m;
    pthread_cond_t go, done;
    int started;                     /* helper threads alive */
    int wanted, active;              /* helpers asked to join this call, still working on it */
    long generation;                 /* bumped per call */
    pool *job;
} team;
static pthread_once_t team_once = PTHREAD_ONCE_INIT;

static void team_reset(void)
{
    pthread_mutex_init(&team.busy, NULL);
    pthread_mutex_init(&team.m, NULL);
    pthread_cond_init(&team.go, NULL);
    pthread_cond_init(&team.done, NULL);
    team.started = team.wanted = team.active = 0;
    team.generation = 0;
    team.job = NULL;
}

static void team_init(void)
{
    team_reset();
    pthread_atfork(NULL, NULL, team_reset);
}

static void *helper(void *arg)
{
    const int id = (int)(intptr_t)arg;
    long seen = 0;
    pthread_mutex_lock(&team.m);
    for (;;) {
        while (team.generation == seen)
            pthread_cond_wait(&team.go, &team.m);
        seen = team.generation;
        if (id < team.wanted) {
            pool *job = team.job;
            pthread_mutex_unlock(&team.m);
            work(job);
            pthread_mutex_lock(&team.m);
            if (--team.active == 0)
                pthread_cond_signal(&team.done);
        }
    }
    return NULL;
}

/* Runs every (sequence, head) task on the calling thread and up to threads - 1
 * helpers, sharing the tasks through an atomic counter (any number of threads
 * completes them). Returns nonzero if a buffer could not be allocated (some
 * tasks then did not run). */
int deltarule_recurrent(const problem *P, int threads)
{
    pool W = {.P = P, .tasks = P->N * P->Hv};
    atomic_init(&W.next, 0);
    atomic_init(&W.failed, 0);
    if (threads > W.tasks)
        threads = (int)W.tasks;
    pthread_once(&team_once, team_init);
    if (threads < 2 || pthread_mutex_trylock(&team.busy) != 0) {
        work(&W);
        return atomic_load(&W.failed);
    }
    pthread_mutex_lock(&team.m);
    for (; team.started < threads - 1; team.started++) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int fail = pthread_create(&id, &attr, helper, (void *)(intptr_t)team.started);
        pthread_attr_destroy(&attr);
        if (fail)
            break;
    }
    team.wanted = team.active = threads - 1 < team.started ? threads - 1 : team.started;
    team.job = &W;
    team.generation++;
    pthread_cond_broadcast(&team.go);
    pthread_mutex_unlock(&team.m);
    work(&W);
    pthread_mutex_lock(&team.m);
    while (team.active > 0)
        pthread_cond_wait(&team.done, &team.m);
    pthread_mutex_unlock(&team.m);
    pthread_mutex_unlock(&team.busy);
    return atomic_load(&W.failed);
}
