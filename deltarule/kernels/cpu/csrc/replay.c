/* Replay of captured transitions (deltarule.replay): state rows rolled forward in place.
 *
 * A captured transition of state head h is three factors (docs/design.md, "Compact capture"):
 * decay factors d (one per head, or one per key), the key k of h's key head and the delta u,
 * and it is one rank-1 update of the K-major state S [K, V]:
 *
 *     S <- diag(d) S + k u^T
 *
 * Each row of S (one key index i) only ever mixes with itself: s = S[i, :] goes through the
 * n steps as s <- d_t[i] s + k_t[i] u_t, so a row is read once, advanced n steps in float32
 * registers and written once. The V-major layout [V, K] walks the columns the same way
 * (S^T[j, :] <- d_t * S^T[j, :] + u_t[j] k_t). A request's slab row is read and written by
 * this request alone (the rows replayed are distinct: deltarule/replay.py checks it), so the
 * update is in place. One thread: a verify step replays a few rows of a few transitions.
 *
 * capture row n (float32): [C][Dw] decay factors, then [C][Hk][K] keys, then [C][Hv][V]
 * deltas, Dw = Hv (scalar decay) or Hv * K (per key). 16-bit states are widened on load and
 * rounded to nearest even on store, once per replay.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "elements.h"

/* Returns 0, or 1 when the row buffer could not be allocated (nothing written then). */
int deltarule_replay(void *state, int s_type, int vk, const float *capture, const int64_t *rows,
                     const int64_t *counts, int64_t N, int64_t C, int64_t Hv, int64_t Hk, int64_t K, int64_t V,
                     int64_t Dw)
{
    const int64_t width = C * (Dw + Hk * K + Hv * V), group = Hv / Hk, per_key = Dw != Hv;
    const int64_t lines = vk ? V : K, line = vk ? K : V;       /* S is [lines][line] per head */
    float *buf = malloc(sizeof(float) * (size_t)line);
    if (!buf)
        return 1;
    for (int64_t n = 0; n < N; n++) {
        const int64_t steps = counts[n], row = rows[n];
        if (row < 0 || steps <= 0)
            continue;
        const float *decay = capture + n * width;
        const float *keys = decay + C * Dw;
        const float *deltas = keys + C * Hk * K;
        for (int64_t h = 0; h < Hv; h++) {
            const int64_t base = (row * Hv + h) * K * V;
            const float *key = keys + (h / group) * K;
            const float *delta = deltas + h * V;
            for (int64_t i = 0; i < lines; i++) {
                const int64_t at = base + i * line;
                if (s_type == F32)
                    memcpy(buf, (const float *)state + at, sizeof(float) * (size_t)line);
                else
                    for (int64_t j = 0; j < line; j++)
                        buf[j] = get1(state, at + j, s_type);
                for (int64_t t = 0; t < steps; t++) {
                    const float *d = decay + t * Dw + (per_key ? h * K : h);
                    const float *kt = key + t * Hk * K, *ut = delta + t * Hv * V;
                    if (!vk) {                      /* row i of S [K, V]: d_t[i] s + k_t[i] u_t */
                        const float a = per_key ? d[i] : d[0], b = kt[i];
                        for (int64_t j = 0; j < line; j++)
                            buf[j] = a * buf[j] + b * ut[j];
                    } else {                        /* row i of S^T [V, K]: d_t * s + u_t[i] k_t */
                        const float b = ut[i];
                        if (per_key)
                            for (int64_t j = 0; j < line; j++)
                                buf[j] = d[j] * buf[j] + b * kt[j];
                        else
                            for (int64_t j = 0; j < line; j++)
                                buf[j] = d[0] * buf[j] + b * kt[j];
                    }
                }
                if (s_type == F32)
                    memcpy((float *)state + at, buf, sizeof(float) * (size_t)line);
                else
                    for (int64_t j = 0; j < line; j++)
                        put1(state, at + j, buf[j], s_type);
            }
        }
    }
    free(buf);
    return 0;
}
