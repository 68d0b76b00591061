/* The short causal convolution of the hybrid models' linear layers over packed sequences, with
 * a conv-state slab: deltarule/conv/ states the semantics (plain and rolling histories) and
 * holds the torch form and the float64 twin; this is the cpu form, one pass over the tokens.
 *
 * Every read of the slab happens before any write: where a sequence writes a row another reads
 * (`gather`, known from the plan), every prior is gathered first; else each sequence reads its
 * own row as it goes. Per sequence and block of channels the W - 1 previous inputs stay in a
 * small float32 window; inputs and states of any element type, float32 arithmetic, outputs
 * rounded once.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fields.h"
#include "vector.h"
#include "elements.h"
#include "team.h"

#define MAX_PARTS 4

typedef struct {
    const void *x;          /* [T, C] inputs: channel stride 1, token stride x_row */
    void *out;              /* outputs, x's type: channels [cut[i], cut[i + 1]) of token t at
                             * out + part_base[i] + t * (cut[i + 1] - cut[i]) + (c - cut[i]) */
    const float *wt;        /* [W, C] taps, transposed (wt[W - 1] multiplies the current token) */
    const float *bias;      /* [C] or NULL */
    void *state;            /* slab element (slot, column, channel) at slot*s_slot + column*s_col + channel*s_chan */
    const int64_t *seq;     /* [N][5]: start, length, read row (< 0: zeros), read column, write row (< 0: none) */
    int64_t x_row, s_slot, s_col, s_chan, N, C, W;
    int32_t x_type, s_type, rolling, silu;
    int32_t gather;         /* 1: a sequence writes a row another reads: gather every prior first */
    int32_t parts;          /* 1..MAX_PARTS output parts ([T, C] contiguous: 1 part, cut {0, C}) */
    int64_t cut[MAX_PARTS + 1], part_base[MAX_PARTS];
} conv_problem;

/* every field of `conv_problem`, for the binding's check of its layout (fields.h) */
static const field conv_problem_fields[] = {
    FIELD(conv_problem, x), FIELD(conv_problem, out), FIELD(conv_problem, wt),
    FIELD(conv_problem, bias), FIELD(conv_problem, state), FIELD(conv_problem, seq),
    FIELD(conv_problem, x_row), FIELD(conv_problem, s_slot), FIELD(conv_problem, s_col),
    FIELD(conv_problem, s_chan), FIELD(conv_problem, N), FIELD(conv_problem, C),
    FIELD(conv_problem, W), FIELD(conv_problem, x_type), FIELD(conv_problem, s_type),
    FIELD(conv_problem, rolling), FIELD(conv_problem, silu), FIELD(conv_problem, gather),
    FIELD(conv_problem, parts), FIELD(conv_problem, cut), FIELD(conv_problem, part_base),
    {NULL, 0, sizeof(conv_problem)},        /* the end, with the struct's size */
};

const field *deltarule_conv_problem_fields(void) { return conv_problem_fields; }

#define CB 512              /* channels per block */
#define MAX_W 16

/* n elements of x (type, channel stride 1) from off, widened; written back rounded. Typed loops
 * so that the compiler vectorises them. */
static void load_row(float *restrict dst, const void *x, int64_t off, int64_t n, int type)
{
    if (type == F32)
        memcpy(dst, (const float *)x + off, sizeof(float) * n);
    else if (type == BF16) {
        const uint16_t *s = (const uint16_t *)x + off;
        for (int64_t c = 0; c < n; c++)
            dst[c] = bf16_widen(s[c]);
    } else {
        const _Float16 *s = (const _Float16 *)x + off;
        for (int64_t c = 0; c < n; c++)
            dst[c] = (float)s[c];
    }
}

static void store_row(void *x, int64_t off, const float *restrict src, int64_t n, int type)
{
    if (type == F32)
        memcpy((float *)x + off, src, sizeof(float) * n);
    else if (type == BF16) {
        uint16_t *d = (uint16_t *)x + off;
        for (int64_t c = 0; c < n; c++)
            d[c] = bf16_round(src[c]);
    } else {
        _Float16 *d = (_Float16 *)x + off;
        for (int64_t c = 0; c < n; c++)
            d[c] = (_Float16)src[c];
    }
}

/* One slab column's n channels from c0: read to float / written from float (any channel stride) */
static void read_column(float *dst, const conv_problem *P, int64_t row, int64_t col, int64_t c0, int64_t n)
{
    const int64_t off = row * P->s_slot + col * P->s_col + c0 * P->s_chan;
    if (P->s_chan == 1)
        load_row(dst, P->state, off, n, P->s_type);
    else
        for (int64_t c = 0; c < n; c++)
            dst[c] = get1(P->state, off + c * P->s_chan, P->s_type);
}

static void write_column(const conv_problem *P, int64_t row, int64_t col, int64_t c0, const float *src, int64_t n)
{
    const int64_t off = row * P->s_slot + col * P->s_col + c0 * P->s_chan;
    if (P->s_chan == 1)
        store_row(P->state, off, src, n, P->s_type);
    else
        for (int64_t c = 0; c < n; c++)
            put1(P->state, off + c * P->s_chan, src[c], P->s_type);
}

/* acc[0:n] = act(bias + sum_j wt[j] * h[j]) over channels c0.. c0 + n, in registers per vector */
static void taps(float *acc, const conv_problem *P, float *const *h, int64_t c0, int64_t n)
{
    const int64_t C = P->C, W = P->W;
    int64_t c = 0;
    for (; c + VEC <= n; c += VEC) {
        vf a = splat(0.0f), w, x;
        if (P->bias)
            memcpy(&a, P->bias + c0 + c, sizeof a);
        for (int64_t j = 0; j < W; j++) {
            memcpy(&w, P->wt + j * C + c0 + c, sizeof w);
            memcpy(&x, h[j] + c, sizeof x);
            a += w * x;
        }
        if (P->silu)
            a = a / (splat(1.0f) + vexp(-a));
        memcpy(acc + c, &a, sizeof a);
    }
    for (; c < n; c++) {
        float a = P->bias ? P->bias[c0 + c] : 0.0f;
        for (int64_t j = 0; j < W; j++)
            a += P->wt[j * C + c0 + c] * h[j][c];
        acc[c] = P->silu ? a / (1.0f + expf(-a)) : a;
    }
}

/* channels [c0, c0 + n) of token t's output, split across the output parts */
static void store_output(const conv_problem *P, int64_t t, int64_t c0, const float *acc, int64_t n)
{
    for (int i = 0; i < P->parts; i++) {
        const int64_t lo = P->cut[i] > c0 ? P->cut[i] : c0, hi = P->cut[i + 1] < c0 + n ? P->cut[i + 1] : c0 + n;
        if (lo < hi)
            store_row(P->out, P->part_base[i] + t * (P->cut[i + 1] - P->cut[i]) + (lo - P->cut[i]), acc + (lo - c0),
                      hi - lo, P->x_type);
    }
}

/* Channels [c0, c0 + CB) of sequence s = (start, length, read row, read column, write row);
 * its prior from `prior` ([W - 1, C], gathered before) or, where NULL, read from the slab here.
 * Blocks of channels are independent tasks: a block reads and writes only its own channels. */
static void block(const conv_problem *P, const int64_t *s, const float *prior, int64_t c0)
{
    const int64_t C = P->C, W = P->W, H = W - 1, start = s[0], L = s[1], row = s[4];
    /* the window: row h[j] holds the input of tap j; rows rotate instead of moving (padded so
     * that rows do not share 4 KiB offsets); pr: this block's prior */
    float buf[MAX_W][CB + 16], pr[MAX_W][CB + 16], acc[CB];
    const int64_t nc = C - c0 < CB ? C - c0 : CB;
    float *h[MAX_W];
    for (int64_t j = 0; j < W; j++)
        h[j] = buf[j];
    for (int64_t j = 0; j < H; j++) {
        if (prior)
            memcpy(pr[j], prior + j * C + c0, sizeof(float) * nc);
        else if (s[2] < 0)
            memset(pr[j], 0, sizeof(float) * nc);
        else
            read_column(pr[j], P, s[2], s[3] + j, c0, nc);
        memcpy(h[j], pr[j], sizeof(float) * nc);
    }
    for (int64_t t = 0; t < L; t++) {
        load_row(h[H], P->x, (start + t) * P->x_row + c0, nc, P->x_type);     /* tap W - 1 */
        taps(acc, P, h, c0, nc);
        store_output(P, start + t, c0, acc, nc);
        float *oldest = h[0];                          /* slide the window */
        for (int64_t j = 0; j < H; j++)
            h[j] = h[j + 1];
        h[H] = oldest;
    }
    if (row < 0 || L == 0)
        return;
    if (P->rolling) {                                 /* prior's last W - 2 inputs, then the tokens */
        for (int64_t j = 0; j + 1 < H; j++)
            write_column(P, row, j, c0, pr[j + 1], nc);
        for (int64_t t = 0; t < L; t++) {
            load_row(acc, P->x, (start + t) * P->x_row + c0, nc, P->x_type);
            write_column(P, row, H - 1 + t, c0, acc, nc);
        }
    } else {                                          /* the last W - 1 inputs: the window */
        for (int64_t j = 0; j < H; j++)
            write_column(P, row, j, c0, h[j], nc);
    }
}

/* The (sequence, channel block) tasks of a call, dealt out by a counter */
typedef struct {
    const conv_problem *P;
    const float *prior;     /* [N, W - 1, C] gathered priors, or NULL */
    int64_t blocks;         /* channel blocks per sequence */
    atomic_llong next;
} conv_pool;

static void conv_work(void *arg, int me)
{
    (void)me;                   /* one counter: every thread takes the next task */
    conv_pool *J = arg;
    const conv_problem *P = J->P;
    const int64_t H = P->W - 1;
    for (int64_t t = atomic_fetch_add(&J->next, 1); t < P->N * J->blocks; t = atomic_fetch_add(&J->next, 1)) {
        const int64_t n = t / J->blocks;
        block(P, P->seq + 5 * n, J->prior ? J->prior + n * H * P->C : NULL, t % J->blocks * CB);
    }
}

/* Runs the call on the calling thread and up to threads - 1 helpers (team.h). Returns 0, 1 (no
 * memory), 2 (W). */
int deltarule_conv(const conv_problem *P, int threads)
{
    const int64_t N = P->N, C = P->C, H = P->W - 1;
    if (P->W < 1 || P->W > MAX_W)
        return 2;
    if (N == 0 || C == 0)       /* nothing to read or write; empty tensors' data may be NULL */
        return 0;
    float *prior = NULL;
    if (P->gather) {          /* every prior before any write */
        prior = malloc(sizeof(float) * (size_t)(N * H * C + 1));
        if (!prior)
            return 1;
        for (int64_t n = 0; n < N; n++) {
            const int64_t *s = P->seq + 5 * n, row = s[2], col = s[3];
            for (int64_t j = 0; j < H; j++) {
                float *p = prior + (n * H + j) * C;
                if (row < 0)
                    memset(p, 0, sizeof(float) * C);
                else
                    read_column(p, P, row, col + j, 0, C);
            }
        }
    }
    conv_pool J = {.P = P, .prior = prior, .blocks = (C + CB - 1) / CB};
    atomic_init(&J.next, 0);
    int64_t tokens = 0;
    for (int64_t n = 0; n < N; n++)
        tokens += P->seq[5 * n + 1];
    const int64_t steps = tokens * C * P->W;
    threads = team_size(threads, steps);
    team_run(conv_work, &J, threads, steps);
    free(prior);
    return 0;
}
