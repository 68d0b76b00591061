/* Reverse mode of the generalized gated delta rule for the CPU (docs/algorithm.md section 7).
 *
 * A task owns one (sequence, state head). The forward kept the state at the start of
 * every chunk of `chunk` tokens (ck) and every token's u = w*v - r; the task walks the
 * chunks backwards. Per chunk it recomputes the chunk's states from its start, token by
 * token (S = diag(d) S_prev + k u^T: with u kept, no retrieval), into scratch (float32,
 * [chunk + 1, K, Vp], rows zero-padded to Vp, a multiple of the vector width: padded
 * columns stay zero), then runs the reverse steps over them. With S' = diag(d) S_prev,
 * u = w*v - S'^T (b*k), S = S' + k u^T and o_g = scale S^T q_g, one step given dS
 * (the gradient reaching S) and do_g:
 *
 *   sweep 1, row i of S and dS:   dS_i += scale sum_g q_gi do_g     dq_gi = scale S_i . do_g
 *                                 du   += k_i dS_i                  dk_i  = dS_i . u
 *   then                          dw = du * v,  dv = du * w
 *   sweep 2, row i of S_prev:     S'_i = d_i S_prev,i               dS_i -= (b k)_i du
 *                                 p_i = S'_i . du:  db_i = -k_i p_i,  dk_i -= b_i p_i
 *                                 dlam_i = dS_i . S'_i              dS_i *= d_i  (dS_prev)
 *
 * Sweep 2 needs the whole du, so a token's two sweeps cannot merge; instead sweep 2 of
 * token t and sweep 1 of token t - 1 run as one sweep over the rows of the state between
 * them (S_prev of t is S of t - 1), loading each row of the state and of dS once. The
 * state is never recovered by dividing the decay back out (d may be 0: a reset).
 * Gradients are written per state head ([B, T, Hv, ...]), scalar gates' summed over
 * their channels; the caller sums the heads that share a query or key head. float32 in
 * and out; compute only, validated by the caller.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "fields.h"
#include "vector.h"
#include "team.h"

typedef struct {
    const float *q, *k, *v;          /* [B, T, Hv/rq, G, K], [B, T, Hv/rk, K], [B, T, Hv, V] */
    const float *u;                  /* [B, T, Hv, V]: u = w*v - r of every token, from the forward */
    const float *g, *gk;             /* NULL, [B, T, Hv] / [B, T, Hv, K] log decays (summed) */
    const float *b, *w;              /* NULL, or by form: [B, T, Hv] or [B, T, Hv, K] / [B, T, Hv, V] */
    const float *ck;                 /* [rows, Hv, K, V] chunk-start states; sequence n's chunk c
                                        starts from row spans[4n + 3] + c */
    const float *ds;                 /* NULL or [N, Hv, K, V] the final states' gradient */
    const float *dout;               /* [B, T, Hv, G, V] the output's gradient */
    const int64_t *spans;            /* [N, 4]: row, start, end, first checkpoint row */
    float *dq;                       /* NULL (not wanted) or [B, T, Hv, G, K] */
    float *dk, *dv;                  /* [B, T, Hv, K], [B, T, Hv, V] */
    float *dlam;                     /* NULL without decay, else [B, T, Hv, K] with gk, [B, T, Hv] without */
    float *db, *dw;                  /* NULL without the gate, else in the gate's form */
    float *ds0;                      /* NULL (not wanted) or [N, Hv, K, V] */
    int64_t N, T, Hv, K, V, G, rq, rk, chunk;
    int b_form, w_form;              /* 0 absent, 1 scalar, 2 per channel */
    float scale;
} bproblem;

/* every field of `bproblem`, for the binding's check of its layout (fields.h) */
static const field bproblem_fields[] = {
    FIELD(bproblem, q), FIELD(bproblem, k), FIELD(bproblem, v), FIELD(bproblem, u),
    FIELD(bproblem, g), FIELD(bproblem, gk), FIELD(bproblem, b), FIELD(bproblem, w),
    FIELD(bproblem, ck), FIELD(bproblem, ds), FIELD(bproblem, dout), FIELD(bproblem, spans),
    FIELD(bproblem, dq), FIELD(bproblem, dk), FIELD(bproblem, dv), FIELD(bproblem, dlam),
    FIELD(bproblem, db), FIELD(bproblem, dw), FIELD(bproblem, ds0), FIELD(bproblem, N),
    FIELD(bproblem, T), FIELD(bproblem, Hv), FIELD(bproblem, K), FIELD(bproblem, V),
    FIELD(bproblem, G), FIELD(bproblem, rq), FIELD(bproblem, rk), FIELD(bproblem, chunk),
    FIELD(bproblem, b_form), FIELD(bproblem, w_form), FIELD(bproblem, scale),
    {NULL, 0, sizeof(bproblem)},        /* the end, with the struct's size */
};

const field *deltarule_backward_problem_fields(void) { return bproblem_fields; }

/* A thread's scratch. Per chunk: [chunk + 1, K, Vp] states, and per token [chunk, K] k, d,
 * b and b*k, [chunk, Vp] v, w and u (w*v - r); then [K, Vp] dS and per-token vectors. */
typedef struct {
    float *st, *kk, *dd, *bb, *bk, *vv, *wv, *u;
    float *ds, *du, *dun, *dov, *qq;         /* [K, Vp], [Vp], [Vp], [G, Vp], [G, K] */
    vf *acc;                                 /* [4, K] a sweep's per-row partial sums */
    float *sums;                             /* [4, Kp] their totals: p, dlam, dk, dq */
} scratch;

static inline float hsum(vf x)
{
    float s = 0.0f;
    for (int l = 0; l < VEC; l++)
        s += x[l];
    return s;
}

/* out[i] = the sum of acc[i]'s lanes for i < K; eight rows at a time by a transposing
 * reduction where AVX has one (a row's own horizontal sum costs as much as eight of these) */
static void row_sums(const vf *acc, int64_t K, float *out)
{
    int64_t i = 0;
#if VEC == 8 && defined(__AVX__)
    for (; i + 8 <= K; i += 8) {
        const __m256 *a = (const __m256 *)(acc + i);
        const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                                _mm256_permute2f128_ps(u0, u1, 0x31)));
    }
#endif
    for (; i < K; i++)
        out[i] = hsum(acc[i]);
}

/* row-padded copy of n floats into dst (Vp floats) */
static inline void pad_copy(float *dst, const float *src, int64_t n, int64_t Vp)
{
    memcpy(dst, src, sizeof(float) * n);
    memset(dst + n, 0, sizeof(float) * (Vp - n));
}

/* token j of the chunk (batch-token bt): k, decay d, b (per key), b*k, v and w, padded */
static void load_token(const bproblem *P, const scratch *W, int64_t j, int64_t bt, int64_t h, int64_t Vp)
{
    const int64_t K = P->K, V = P->V, Hv = P->Hv, th = bt * Hv + h;
    const float *kr = P->k + (bt * (Hv / P->rk) + h / P->rk) * K;
    float *kk = W->kk + j * K, *dd = W->dd + j * K, *bb = W->bb + j * K, *bk = W->bk + j * K;
    float *vv = W->vv + j * Vp, *wv = W->wv + j * Vp, *u = W->u + j * Vp;
    const float d_head = P->gk ? 0.0f : P->g ? expf(P->g[th]) : 1.0f;
    for (int64_t i = 0; i < K; i++) {
        kk[i] = kr[i];
        dd[i] = P->gk ? expf((P->g ? P->g[th] : 0.0f) + P->gk[th * K + i]) : d_head;
        bb[i] = P->b_form == 1 ? P->b[th] : P->b_form == 2 ? P->b[th * K + i] : 0.0f;
        bk[i] = bb[i] * kr[i];
    }
    pad_copy(vv, P->v + th * V, V, Vp);
    pad_copy(u, P->u + th * V, V, Vp);
    for (int64_t c = 0; c < V; c++)
        wv[c] = P->w_form == 1 ? P->w[th] : P->w_form == 2 ? P->w[th * V + c] : 1.0f;
    memset(wv + V, 0, sizeof(float) * (Vp - V));
}

/* The chunk's states st[1..len] from st[0]: st[j + 1] = diag(d) st[j] + k u^T with the
 * forward's u (no retrieval to recompute). */
static void recompute(const bproblem *P, const scratch *W, int64_t len, int64_t Vp)
{
    const int64_t K = P->K, nv = Vp / VEC;
    for (int64_t j = 0; j < len; j++) {
        const vf *restrict u = (const vf *)(W->u + j * Vp);
        const float *kk = W->kk + j * K, *dd = W->dd + j * K;
        const vf *restrict S = (const vf *)(W->st + j * K * Vp);
        vf *restrict Sn = (vf *)(W->st + (j + 1) * K * Vp);
        for (int64_t i = 0; i < K; i++) {
            const vf di = splat(dd[i]), ki = splat(kk[i]);
            const vf *restrict Si = S + i * nv;
            vf *restrict Ni = Sn + i * nv;
            for (int64_t l = 0; l < nv; l++)
                Ni[l] = di * Si[l] + ki * u[l];
        }
    }
}

/* One sweep over the rows of X = st[j] (the state after chunk token j - 1), doing
 * the second half of token a = j's reverse step (X is its S_prev; du = du_a complete)
 * and the first half of token b = j - 1's (X is its S; dun = du_b accumulates), as
 * flagged. Each row of dS is loaded and stored once.
 *
 * dS is held as *scale times the scratch (`lazy`): a scalar decay multiplies the scale,
 * not every element, until the scale would leave [LAZY_FLOOR, 1 / LAZY_FLOOR] (or the
 * decay is 0 or NaN); then the sweep multiplies (mul) and the scale restarts at 1. A
 * per-key decay always multiplies (the scale stays 1). */
INLINE void sweep(const bproblem *P, const scratch *W, int64_t j, int64_t bt_a, int64_t bt_b, int64_t h,
                  int64_t Vp, float *scale, int second_half, int first_half, int decays, int mul, int retrieves,
                  int G1)
{
    const int64_t K = P->K, G = G1 ? 1 : P->G, nv = Vp / VEC, Hv = P->Hv;
    const int64_t ta = bt_a * Hv + h, tb = bt_b * Hv + h;
    const vf *restrict X = (const vf *)(W->st + j * K * Vp);
    vf *restrict dS = (vf *)W->ds;
    const vf *restrict du = (const vf *)W->du, *restrict dov = (const vf *)W->dov;
    vf *restrict dun = (vf *)W->dun;
    const vf *restrict ub = first_half ? (const vf *)(W->u + (j - 1) * Vp) : NULL;
    const float *da = W->dd + j * K, *bka = W->bk + j * K, *ka = W->kk + j * K, *ba = W->bb + j * K;
    const float *kb = W->kk + (j - 1) * K;
    const int want_dq = P->dq != NULL, scalar_b = P->b_form == 1, scalar_lam = P->gk == NULL;
    const float sc = P->scale;
    /* cs: dS's scale entering the sweep; cn: after its second half; f: the factor a multiplying
     * sweep applies (the per-key decay's own d_i where f_row is NULL) */
    const float cs = *scale, f = scalar_lam && decays && second_half ? cs * da[0] : 1.0f;
    const float cn = !second_half || !decays ? cs : mul ? 1.0f : f;
    const float *f_row = scalar_lam ? NULL : da;
    *scale = cn;
    vf *accp = W->acc, *accm = accp + K, *acck = accm + K, *accq = acck + K;
    for (int64_t i = 0; i < K; i++) {
        const vf *restrict Xi = X + i * nv;
        vf *restrict dSi = dS + i * nv;
        vf p0 = splat(0.0f), m0 = p0, k0 = p0, q0 = p0;
        const vf dai = splat(second_half ? (f_row ? f_row[i] : f) : 1.0f);
        const vf bkai = splat(second_half ? bka[i] / cs : 0.0f);
        const vf kbi = splat(first_half ? kb[i] * cn : 0.0f);
        const vf sq0 = splat(first_half ? sc * W->qq[i] / cn : 0.0f);
#define BODY(l, P_, M_, K_, Q_)                                                  \
        {                                                                         \
            const vf xs = Xi[l];                                                  \
            vf x = dSi[l];                                                        \
            if (second_half) {                 /* S'_i = d_i X_i: d_i applied to the sums */ \
                if (retrieves) {                                                  \
                    x -= bkai * du[l];                                            \
                    P_ += xs * du[l];                                             \
                }                                                                 \
                if (decays)                                                       \
                    M_ += x * xs;                                                 \
                if (mul)                                                          \
                    x *= dai;                                                     \
            }                                                                     \
            if (first_half) {                                                     \
                if (G1) {                  /* dq's sum even when not wanted: no branch */ \
                    x += sq0 * dov[l];                                            \
                    Q_ += xs * dov[l];                                            \
                } else                                                            \
                    for (int64_t g = 0; g < G; g++)                               \
                        x += splat(sc * W->qq[g * K + i] / cn) * dov[g * nv + l]; \
                dun[l] += kbi * x;                                                \
                K_ += x * ub[l];                                                  \
            }                                                                     \
            dSi[l] = x;                                                           \
        }
        for (int64_t l = 0; l < nv; l++)
            BODY(l, p0, m0, k0, q0)
#undef BODY
        accp[i] = p0;
        accm[i] = m0;
        acck[i] = k0;
        accq[i] = q0;
        if (first_half && want_dq && !G1)
            for (int64_t g = 0; g < G; g++) {
                vf acc = splat(0.0f);
                for (int64_t m = 0; m < nv; m++)
                    acc += Xi[m] * dov[g * nv + m];
                P->dq[(tb * G + g) * K + i] = sc * hsum(acc);
            }
    }
    const int64_t Kp = (K + VEC - 1) / VEC * VEC;
    float *pr = W->sums, *mr = pr + Kp, *kr = mr + Kp, *qr = kr + Kp;
    if (second_half) {
        float db_sum = 0.0f, lam_sum = 0.0f;
        if (retrieves) {
            row_sums(accp, K, pr);
            for (int64_t i = 0; i < K; i++) {
                const float pi = da[i] * pr[i];
                if (scalar_b)
                    db_sum -= ka[i] * pi;
                else
                    P->db[ta * K + i] = -ka[i] * pi;
                P->dk[ta * K + i] -= ba[i] * pi;
            }
            if (scalar_b)
                P->db[ta] = db_sum;
        }
        if (decays) {
            row_sums(accm, K, mr);
            if (scalar_lam) {
                for (int64_t i = 0; i < K; i++)
                    lam_sum += mr[i];
                P->dlam[ta] = da[0] * cs * lam_sum;
            } else
                for (int64_t i = 0; i < K; i++)
                    P->dlam[ta * K + i] = da[i] * cs * mr[i];
        }
    }
    if (first_half) {
        row_sums(acck, K, P->dk + tb * K);
        if (cn != 1.0f)
            for (int64_t i = 0; i < K; i++)
                P->dk[tb * K + i] *= cn;
        if (want_dq && G1) {
            row_sums(accq, K, qr);
            for (int64_t i = 0; i < K; i++)
                P->dq[tb * K + i] = sc * qr[i];
        }
    }
}

/* token b's do and q into scratch, dun zeroed (the first half of its reverse step) */
static void start_token(const bproblem *P, const scratch *W, int64_t bt, int64_t h, int64_t Vp)
{
    const int64_t K = P->K, V = P->V, G = P->G, Hv = P->Hv, th = bt * Hv + h;
    memcpy(W->qq, P->q + (bt * (Hv / P->rq) + h / P->rq) * G * K, sizeof(float) * G * K);
    for (int64_t g = 0; g < G; g++)
        pad_copy(W->dov + g * Vp, P->dout + (th * G + g) * V, V, Vp);
    memset(W->dun, 0, sizeof(float) * Vp);
}

/* token b's du is complete: dv = du * w, dw = du * v; it becomes the du of the next sweep */
static void finish_token(const bproblem *P, scratch *W, int64_t j, int64_t bt, int64_t h, int64_t Vp)
{
    const int64_t V = P->V, th = bt * P->Hv + h;
    const float *wv = W->wv + j * Vp, *vv = W->vv + j * Vp;
    float dw_sum = 0.0f;
    for (int64_t c = 0; c < V; c++) {
        P->dv[th * V + c] = W->dun[c] * wv[c];
        if (P->w_form == 1)
            dw_sum += W->dun[c] * vv[c];
        else if (P->dw)
            P->dw[th * V + c] = W->dun[c] * vv[c];
    }
    if (P->w_form == 1)
        P->dw[th] = dw_sum;
    float *t = W->du;
    W->du = W->dun;
    W->dun = t;
}

/* One function per specialisation of `sweep` (each its own register allocation: inlined
 * together into the task, the hot loop spilled its counters) */
#define VARIANT(name, s2, f1, dec, mul, ret)                                                            \
    __attribute__((noinline)) static void name(const bproblem *P, const scratch *W, int64_t j, int64_t a,  \
                                               int64_t b, int64_t h, int64_t Vp, float *scale, int G1)   \
    {                                                                                                   \
        if (G1)                                                                                         \
            sweep(P, W, j, a, b, h, Vp, scale, s2, f1, dec, mul, ret, 1);                               \
        else                                                                                            \
            sweep(P, W, j, a, b, h, Vp, scale, s2, f1, dec, mul, ret, 0);                               \
    }
#define VARIANTS(s2, f1)                                                                                \
    VARIANT(sweep_##s2##f1##_dmr, s2, f1, 1, 1, 1) VARIANT(sweep_##s2##f1##_dr, s2, f1, 1, 0, 1)         \
    VARIANT(sweep_##s2##f1##_dm, s2, f1, 1, 1, 0) VARIANT(sweep_##s2##f1##_d, s2, f1, 1, 0, 0)           \
    VARIANT(sweep_##s2##f1##_r, s2, f1, 0, 0, 1) VARIANT(sweep_##s2##f1##_, s2, f1, 0, 0, 0)
VARIANTS(0, 1)
VARIANTS(1, 1)
VARIANTS(1, 0)

/* the sweep for the call's gates; with a scalar decay, `mul` when the lazy scale of dS must
 * be applied now (a per-key decay always applies) */
#define SWEEP(s2, f1)                                                                                   \
    do {                                                                                                \
        const int mul = decays && (s2) && (!lazy || restart(scale, W->dd[j * K]));                      \
        void (*fn)(const bproblem *, const scratch *, int64_t, int64_t, int64_t, int64_t, int64_t,      \
                   float *, int) = decays ? (retrieves ? (mul ? sweep_##s2##f1##_dmr : sweep_##s2##f1##_dr)  \
                                                       : (mul ? sweep_##s2##f1##_dm : sweep_##s2##f1##_d)) \
                                          : (retrieves ? sweep_##s2##f1##_r : sweep_##s2##f1##_);       \
        fn(P, W, j, bt_a, bt_b, h, Vp, &scale, G1);                                                     \
    } while (0)

/* the lazy scale times the decay d leaves the safe range (or is 0, or NaN): apply it now */
static inline int restart(float scale, float d)
{
    const float next = scale * d;
    return !(next >= LAZY_FLOOR && next <= 1.0f / LAZY_FLOOR);
}

static void run_task(const bproblem *P, scratch *W, int64_t n, int64_t h, int64_t Vp)
{
    const int64_t K = P->K, V = P->V, Hv = P->Hv, T = P->T, C = P->chunk;
    const int64_t row = P->spans[4 * n], start = P->spans[4 * n + 1], end = P->spans[4 * n + 2];
    const int64_t ck0 = P->spans[4 * n + 3];
    const int decays = P->dlam != NULL, retrieves = P->b_form != 0, G1 = P->G == 1;
    const int lazy = decays && P->gk == NULL;     /* a scalar decay: dS = scale * scratch */
    float scale = 1.0f;
    for (int64_t i = 0; i < K; i++)
        if (P->ds)
            pad_copy(W->ds + i * Vp, P->ds + ((n * Hv + h) * K + i) * V, V, Vp);
        else
            memset(W->ds + i * Vp, 0, sizeof(float) * Vp);
    const int64_t chunks = end > start ? (end - start + C - 1) / C : 0;
    for (int64_t c = chunks - 1; c >= 0; c--) {
        const int64_t t0 = start + c * C, len = end - t0 < C ? end - t0 : C, bt0 = row * T + t0;
        const float *src = P->ck + ((ck0 + c) * Hv + h) * K * V;
        for (int64_t i = 0; i < K; i++)
            pad_copy(W->st + i * Vp, src + i * V, V, Vp);
        for (int64_t j = 0; j < len; j++)
            load_token(P, W, j, bt0 + j, h, Vp);
        recompute(P, W, len, Vp);
        /* the first half of the chunk's last token on st[len], then fused sweeps down to st[1],
         * then the second half of its first token on st[0] */
        int64_t j = len, bt_a = bt0 + len, bt_b = bt0 + len - 1;
        start_token(P, W, bt_b, h, Vp);
        SWEEP(0, 1);
        finish_token(P, W, len - 1, bt_b, h, Vp);
        for (j = len - 1; j >= 1; j--) {
            bt_a = bt0 + j;
            bt_b = bt0 + j - 1;
            start_token(P, W, bt_b, h, Vp);
            SWEEP(1, 1);
            finish_token(P, W, j - 1, bt_b, h, Vp);
        }
        j = 0;
        bt_a = bt0;
        bt_b = bt0;
        if (decays || retrieves)
            SWEEP(1, 0);
    }
    if (P->ds0)
        for (int64_t i = 0; i < K; i++)
            for (int64_t c = 0; c < V; c++)
                P->ds0[((n * Hv + h) * K + i) * V + c] = scale * W->ds[i * Vp + c];
}

typedef struct {
    const bproblem *P;
    atomic_llong next;
    atomic_int failed;
} pool;

/* Thread `me` of the call takes (sequence, head) tasks until none is left */
static void work(void *job, int me)
{
    (void)me;                        /* one counter: every thread takes the next task */
    pool *W = job;
    const bproblem *P = W->P;
    const int64_t K = P->K, G = P->G, C = P->chunk, Vp = (P->V + VEC - 1) / VEC * VEC;
    /* every array starts on a vector boundary: Vp is a multiple of VEC, K-sized ones are padded */
    const int64_t CK = (C * K + VEC - 1) / VEC * VEC, GKp = (G * K + VEC - 1) / VEC * VEC;
    const int64_t Kp = (K + VEC - 1) / VEC * VEC;
    const int64_t floats = (C + 2) * K * Vp + 4 * CK + 3 * C * Vp + (2 + G) * Vp + GKp + 4 * K * VEC + 4 * Kp;
    const size_t bytes = (sizeof(float) * floats + 63) / 64 * 64;
    float *mem = team_scratch(bytes);
    if (!mem) {
        atomic_store(&W->failed, 1);
        return;
    }
    float *f = mem;
    scratch s;
    s.st = f; f += (C + 1) * K * Vp;
    s.kk = f; f += CK;
    s.dd = f; f += CK;
    s.bb = f; f += CK;
    s.bk = f; f += CK;
    s.vv = f; f += C * Vp;
    s.wv = f; f += C * Vp;
    s.u = f; f += C * Vp;
    s.ds = f; f += K * Vp;
    s.du = f; f += Vp;
    s.dun = f; f += Vp;
    s.dov = f; f += G * Vp;
    s.qq = f; f += GKp;
    s.acc = (vf *)f; f += 4 * K * VEC;
    s.sums = f;
    for (int64_t task = atomic_fetch_add(&W->next, 1); task < P->N * P->Hv; task = atomic_fetch_add(&W->next, 1))
        run_task(P, &s, task / P->Hv, task % P->Hv, Vp);
}

/* Runs every (sequence, head) task on the calling thread and up to threads - 1 helpers
 * (team.h). Returns nonzero if a scratch buffer could not be allocated. */
int deltarule_backward(const bproblem *P, int threads)
{
    pool W = {.P = P};
    atomic_init(&W.next, 0);
    atomic_init(&W.failed, 0);
    if (P->N * P->Hv == 0)           /* no task: no thread, no scratch */
        return 0;
    if (threads > P->N * P->Hv)
        threads = (int)(P->N * P->Hv);
    /* a token's reverse step costs about four forward updates of the state */
    const int64_t steps = 4 * P->T * P->Hv * P->K * P->V;
    threads = team_size(threads, steps);
    team_run(work, &W, threads, steps);
    return atomic_load(&W.failed);
}
