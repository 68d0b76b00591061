/* Fused, V-tiled recurrence of the generalized gated delta rule for the CPU.
 *
 * The columns of the state are independent: column j of S only ever meets
 * v_j, w_j and column j itself (S^T (b k) and S^T q are per column, the
 * update adds k u_j). So each task owns one sequence, one state head and a
 * tile of TILE value columns, keeps that [K, TILE] tile in a local buffer that
 * fits the L1 cache for the whole sequence, and runs the tokens one by one:
 *
 *   pass 1 (read):   r = S^T (d*b*k),  p_g = S^T (d*q_g)       (the old state;
 *                    u = w*v - r,      o_g = scale * (p_g + (q_g . k) u)   d folded in)
 *   pass 2 (update): S = d*S + k u^T
 *
 * which is DESIGN.md section 1 read after the update: S_t^T q = (D S)^T q + u (k . q).
 * Pass 1 reads the tile once for r and the first query (GQA groups read it
 * again per further query), pass 2 once more: at K = V = 128 a token costs
 * 16 vector operations per tile row, the same for every gate form.
 *
 * Staging. One head's rows lie Hv*K floats apart from token to token; the
 * task copies the q and k rows of TB tokens at a time into a contiguous block,
 * so their cache misses overlap instead of stalling each token.
 *
 * Compute only: contiguous float32 operands, validated by the caller.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VEC 16                       /* floats per vector */
#define NV 4                         /* vectors per tile row */
#define TILE (VEC * NV)              /* value columns per task: a [K, TILE] tile is 32 KB at K = 128 */
#define TB 16                        /* tokens staged per block */
#define UNROLL _Pragma("GCC unroll 8")

typedef float vf __attribute__((vector_size(64), aligned(64)));

static inline vf splat(float x) { return (vf){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* Gate forms: 0 absent, 1 scalar per (token, head), 2 per channel. */
enum { ABSENT = 0, SCALAR = 1, CHANNEL = 2 };

typedef struct {
    const float *q, *k, *v;          /* [B, T, Hv/rq, G, K], [B, T, Hv/rk, K], [B, T, Hv, V] */
    const float *d, *b, *w;          /* decay factors exp(log decay), erase, write: [B, T, Hv] or
                                        [B, T, Hv, K] (d, b), [B, T, Hv, V] (w), by their forms */
    const float *s0;                 /* initial states [slot, Hv, K, V] at strides s0_stride */
    float *s;                        /* final states, strides s_stride (may be s0: a slab in place) */
    float *o;                        /* [B, T, Hv, G, V] */
    const int64_t *spans;            /* [N, 5]: row, start, end, initial slot (-1: zeros), final slot (-1: none) */
    const int32_t *owner;            /* NULL, or [B*T]: the span whose output a token keeps (-1: none) */
    int64_t N, T, Hv, K, V, G, rq, rk;
    int64_t s0_stride[4], s_stride[4];   /* in floats: slot, head, key, value */
    int d_form, b_form, w_form;
    float scale;
} problem;

/* A thread's scratch, reused by its tasks. */
typedef struct {
    float *tile;                     /* [K, TILE], 64-byte aligned */
    float *kb, *qb;                  /* staged rows: [TB, K], [TB, G*K] */
    float *dk, *eb, *eq, *kq;        /* [K], [K], [G*K], [G] */
} scratch;

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

/* acc[l] = sum_i e[i] * S[i][l]: one query's read of the tile, two partial sums per vector */
static inline void read_tile(const vf *S, const float *e, int64_t K, vf acc[NV])
{
    vf a0[NV], a1[NV];
    UNROLL for (int l = 0; l < NV; l++) a0[l] = a1[l] = splat(0);
    int64_t i = 0;
    for (; i + 1 < K; i += 2) {
        const vf x = splat(e[i]), y = splat(e[i + 1]);
        UNROLL for (int l = 0; l < NV; l++) {
            a0[l] += x * S[NV * i + l];
            a1[l] += y * S[NV * (i + 1) + l];
        }
    }
    if (i < K) {
        const vf x = splat(e[i]);
        UNROLL for (int l = 0; l < NV; l++) a0[l] += x * S[NV * i + l];
    }
    UNROLL for (int l = 0; l < NV; l++) acc[l] = a0[l] + a1[l];
}

/* read_tile for two vectors at once (the erase read and the first query), sharing the loads */
static inline void read_tile2(const vf *S, const float *e, const float *f, int64_t K, vf r[NV], vf p[NV])
{
    vf r1[NV], p1[NV];
    UNROLL for (int l = 0; l < NV; l++) r[l] = p[l] = r1[l] = p1[l] = splat(0);
    int64_t i = 0;
    for (; i + 1 < K; i += 2) {
        const vf a = splat(e[i]), b = splat(e[i + 1]), x = splat(f[i]), y = splat(f[i + 1]);
        UNROLL for (int l = 0; l < NV; l++) {
            const vf s0 = S[NV * i + l], s1 = S[NV * (i + 1) + l];
            r[l] += a * s0; p[l] += x * s0;
            r1[l] += b * s1; p1[l] += y * s1;
        }
    }
    if (i < K) {
        const vf a = splat(e[i]), x = splat(f[i]);
        UNROLL for (int l = 0; l < NV; l++) {
            r[l] += a * S[NV * i + l]; p[l] += x * S[NV * i + l];
        }
    }
    UNROLL for (int l = 0; l < NV; l++) {
        r[l] += r1[l];
        p[l] += p1[l];
    }
}

static void run_task(const problem *P, int64_t n, int64_t h, int64_t j0, const scratch *W)
{
    const int64_t K = P->K, V = P->V, G = P->G, Hv = P->Hv, T = P->T;
    const int64_t row = P->spans[5 * n], start = P->spans[5 * n + 1], end = P->spans[5 * n + 2];
    const int64_t in = P->spans[5 * n + 3], out = P->spans[5 * n + 4];
    const int64_t tw = V - j0 < TILE ? V - j0 : TILE;
    const int64_t hq = h / P->rq, hk = h / P->rk, Hq = Hv / P->rq, Hk = Hv / P->rk;
    float *dk = W->dk, *eb = W->eb, *eq = W->eq, *kq = W->kq;
    vf *S = (vf *)W->tile;           /* [K][NV] vectors */

    memset(W->tile, 0, sizeof(float) * K * TILE);
    if (in >= 0) {
        const int64_t *st = P->s0_stride;
        const float *src = P->s0 + in * st[0] + h * st[1] + j0 * st[3];
        for (int64_t i = 0; i < K; i++)
            for (int64_t j = 0; j < tw; j++)
                W->tile[i * TILE + j] = src[i * st[2] + j * st[3]];
    }
    for (int64_t t = start; t < end; t++) {
        const int64_t bt = row * T + t;                       /* token index in [B*T] */
        const int64_t th = bt * Hv + h;                       /* (token, state head) */
        const int64_t slot = (t - start) % TB;
        if (slot == 0)
            for (int64_t s = 0; s < TB && t + s < end; s++) {
                memcpy(W->kb + s * K, P->k + ((bt + s) * Hk + hk) * K, sizeof(float) * K);
                memcpy(W->qb + s * G * K, P->q + ((bt + s) * Hq + hq) * G * K, sizeof(float) * G * K);
            }
        const float *kt = W->kb + slot * K, *qt = W->qb + slot * G * K;

        /* the token's key-side vectors, shared by the tile's columns */
        if (P->d_form == CHANNEL)
            memcpy(dk, P->d + th * K, sizeof(float) * K);
        else {
            const float ds = P->d_form == SCALAR ? P->d[th] : 1.0f;
            for (int64_t i = 0; i < K; i++)
                dk[i] = ds;
        }
        if (P->b_form == CHANNEL) {
            const float *bt_ = P->b + th * K;
            for (int64_t i = 0; i < K; i++)
                eb[i] = dk[i] * bt_[i] * kt[i];
        } else {
            const float bs = P->b_form == SCALAR ? P->b[th] : 0.0f;
            for (int64_t i = 0; i < K; i++)
                eb[i] = dk[i] * bs * kt[i];
        }
        for (int64_t g = 0; g < G; g++) {
            for (int64_t i = 0; i < K; i++)
                eq[g * K + i] = dk[i] * qt[g * K + i];
            kq[g] = dot(qt + g * K, kt, K);
        }

        /* pass 1 on the old state: the erase read and the first query's read in one sweep */
        vf r[NV], p0[NV], u[NV];
        read_tile2(S, eb, eq, K, r, p0);
        {
            float vw[TILE] __attribute__((aligned(64)));
            const float *vt = P->v + th * V + j0;
            if (P->w_form == CHANNEL) {
                const float *wt = P->w + th * V + j0;
                for (int64_t j = 0; j < TILE; j++)
                    vw[j] = j < tw ? wt[j] * vt[j] : 0.0f;
            } else {
                const float ws = P->w_form == SCALAR ? P->w[th] : 1.0f;
                for (int64_t j = 0; j < TILE; j++)
                    vw[j] = j < tw ? ws * vt[j] : 0.0f;
            }
            UNROLL for (int l = 0; l < NV; l++) u[l] = ((vf *)vw)[l] - r[l];
        }
        if (P->owner == NULL || P->owner[bt] == n) {
            const vf sc = splat(P->scale);
            for (int64_t g = 0; g < G; g++) {
                vf p[NV], res[NV];
                if (g == 0)
                    UNROLL for (int l = 0; l < NV; l++) p[l] = p0[l];
                else
                    read_tile(S, eq + g * K, K, p);
                const vf kqg = splat(kq[g]);
                UNROLL for (int l = 0; l < NV; l++) res[l] = sc * (p[l] + kqg * u[l]);
                memcpy(P->o + (th * G + g) * V + j0, res, sizeof(float) * tw);
            }
        }

        /* pass 2: S = d S + k u^T */
        for (int64_t i = 0; i < K; i++) {
            const vf dd = splat(dk[i]), kk = splat(kt[i]);
            UNROLL for (int l = 0; l < NV; l++) S[NV * i + l] = dd * S[NV * i + l] + kk * u[l];
        }
    }
    if (out >= 0) {
        const int64_t *st = P->s_stride;
        float *dst = P->s + out * st[0] + h * st[1] + j0 * st[3];
        for (int64_t i = 0; i < K; i++)
            for (int64_t j = 0; j < tw; j++)
                dst[i * st[2] + j * st[3]] = W->tile[i * TILE + j];
    }
}

typedef struct {
    const problem *P;
    int64_t tiles, tasks;
    atomic_llong next;               /* the next task to take (dynamic schedule) */
    atomic_int failed;
} pool;

static void *work(void *arg)
{
    pool *W = arg;
    const problem *P = W->P;
    const int64_t K = P->K, G = P->G;
    scratch s = {.tile = aligned_alloc(64, sizeof(float) * K * TILE)};   /* K * TILE * 4: a multiple of 64 */
    float *rows = malloc(sizeof(float) * TB * (1 + G) * K);
    float *vecs = malloc(sizeof(float) * (K * (2 + G) + G));
    if (!s.tile || !rows || !vecs)
        atomic_store(&W->failed, 1);
    else {
        s.kb = rows;
        s.qb = rows + TB * K;
        s.dk = vecs;
        s.eb = vecs + K;
        s.eq = vecs + 2 * K;
        s.kq = vecs + (2 + G) * K;
        for (int64_t task; (task = atomic_fetch_add(&W->next, 1)) < W->tasks;) {
            const int64_t n = task / (P->Hv * W->tiles), rest = task % (P->Hv * W->tiles);
            run_task(P, n, rest / W->tiles, (rest % W->tiles) * TILE, &s);
        }
    }
    free(s.tile);
    free(rows);
    free(vecs);
    return NULL;
}

/* Runs every task on the calling thread plus threads - 1 new ones (fewer if
 * they cannot be created: the work is shared dynamically, so any number of
 * threads completes it). Plain threads rather than OpenMP: no second OpenMP
 * runtime spinning beside torch's. Returns nonzero if a buffer could not be
 * allocated (some tasks then did not run). */
int deltarule_recurrent(const problem *P, int threads)
{
    pool W = {.P = P, .tiles = (P->V + TILE - 1) / TILE};
    W.tasks = P->N * P->Hv * W.tiles;
    atomic_init(&W.next, 0);
    atomic_init(&W.failed, 0);
    if (threads > W.tasks)
        threads = (int)W.tasks;
    pthread_t ids[threads > 1 ? threads - 1 : 1];
    int started = 0;
    for (; started < threads - 1; started++)
        if (pthread_create(&ids[started], NULL, work, &W) != 0)
            break;
    work(&W);
    for (int i = 0; i < started; i++)
        pthread_join(ids[i], NULL);
    return atomic_load(&W.failed);
}
