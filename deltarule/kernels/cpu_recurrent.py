"""Fused token-by-token recurrence for the CPU (numba), the decode hot path.

One state head per parallel task. Per token the head's state tile is read
once for both the retrieval and the output (ALGORITHM.md, "Decode"), then
updated once in place, so a decode step touches the state twice (read, then
read-modify-write of a tile that is still in cache) instead of the four or
five passes of separate torch ops.

Compute only: float32 NumPy views of the operands described in
`deltarule.backends._prepare`; absent gates are passed as empty arrays with
their flag cleared; no validation.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def recurrent_steps(q, k, v, lam, b, w, S0, S, slots, o, scale, has_lam, has_b, has_w, in_place):
    """L steps for every (sequence, head); writes o and the final states.

    q [N, L, Hq', G, K], k [N, L, Hk, K], v [N, L, H, V] (Hq', Hk divide H);
    lam [N, L, H, 1 or K], b [N, L, H, 1 or K], w [N, L, H, 1 or V];
    sequence n starts from S0[slots[n]] and leaves its state in S[slots[n]]
    (S0 [M, H, K, V] read only, S [M', H, K, V]); with `in_place`, S0 is S (a
    state slab updated where it lies) and a negative slot marks padding: zero
    output, no state touched. o [N, L, H, G, V] written.
    """
    N, L, H, V = v.shape
    K = k.shape[3]
    G = q.shape[3]
    rq = H // q.shape[2]
    rk = H // k.shape[2]
    for task in prange(N * H):
        n = task // H
        h = task % H
        hq = h // rq
        hk = h // rk
        slot = slots[n]
        if slot < 0:
            o[n, :, h] = 0.0
            continue
        St = S[slot, h]
        if not in_place:
            St[:, :] = S0[slot, h]
        e = np.ones(K, dtype=np.float32)
        eb = np.zeros(K, dtype=np.float32)
        eq = np.empty((G, K), dtype=np.float32)
        r = np.empty(V, dtype=np.float32)
        p = np.empty((G, V), dtype=np.float32)
        u = np.empty(V, dtype=np.float32)
        kq = np.empty(G, dtype=np.float32)
        for t in range(L):
            kt = k[n, t, hk]
            if has_lam:
                lt = lam[n, t, h]
                for i in range(K):
                    e[i] = np.exp(lt[i if lt.shape[0] > 1 else 0])
            if has_b:
                bt = b[n, t, h]
                for i in range(K):
                    eb[i] = e[i] * bt[i if bt.shape[0] > 1 else 0] * kt[i]
            for g in range(G):
                acc = np.float32(0.0)
                for i in range(K):
                    eq[g, i] = e[i] * q[n, t, hq, g, i]
                    acc += q[n, t, hq, g, i] * kt[i]
                kq[g] = acc
            # the one read of the old state: r = S'^T (b k), p = S'^T q
            r[:] = 0.0
            p[:, :] = 0.0
            for i in range(K):
                row = St[i]
                if has_b:
                    c = eb[i]
                    for j in range(V):
                        r[j] += c * row[j]
                for g in range(G):
                    c = eq[g, i]
                    for j in range(V):
                        p[g, j] += c * row[j]
            vt = v[n, t, h]
            if has_w:
                wt = w[n, t, h]
                for j in range(V):
                    u[j] = vt[j] * wt[j if wt.shape[0] > 1 else 0] - r[j]
            else:
                for j in range(V):
                    u[j] = vt[j] - r[j]
            for g in range(G):
                for j in range(V):
                    o[n, t, h, g, j] = scale * (p[g, j] + kq[g] * u[j])
            # S = D S + k u^T
            for i in range(K):
                row = St[i]
                d = e[i]
                c = kt[i]
                for j in range(V):
                    row[j] = d * row[j] + c * u[j]
