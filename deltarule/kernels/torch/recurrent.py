"""Token-by-token recurrence in torch ops (decode and short sequences).

Everything a step needs comes from the old state in one product
(docs/algorithm.md, "Decode"): with D = diag(exp(lam)),

    [r; p] = [exp(lam) * b * k; exp(lam) * q] S     (r = S'^T (b k), p = S'^T q)
    u = w * v - r
    o = scale * (p + (k . q) u)
    S = D S + k u^T                                  (in place on the working state)

Compute only: token-major operands as described in
`deltarule.backends._prepare`; no validation.
"""

from __future__ import annotations

import torch


def recurrent(q, k, v, lam, b, w, S, scale: float, keep_states: bool = False, keep_deltas: int = 0):
    """Run L steps of the generalized recurrence for all N x H heads at once.

    Args:
        q: [N, L, Hq', G, K]; k: [N, L, Hk, K]; v: [N, L, H, V] (any float dtype), where
            Hq' and Hk divide H (GVA: each serves H / Hk consecutive heads).
        lam: None | [N, L, H] | [N, L, H, K] log decay.
        b: None | [N, L, H] | [N, L, H, K] erase gate; w: None | [N, L, H] |
            [N, L, H, V] write gate (both None for the rules without retrieval).
        S: [N, H, K, V] float32 initial state (not modified); the steps run in its
            dtype (float64 for gradcheck).
        keep_states: also return the state after every step (speculative decoding).
        keep_deltas: R >= 0; also return the deltas u of the first min(R, L) steps
            (compact capture: S_t = D_t S_{t-1} + k_t u_t^T).

    Returns:
        o [N, L, H, G, V] in S's dtype, the final state [N, H, K, V], and with
        `keep_states` the states after each step [N, L, H, K, V] (else None);
        with `keep_deltas` a fourth, the deltas [N, min(R, L), H, V].
    """
    q, k, v = q.to(S.dtype), k.to(S.dtype), v.to(S.dtype)
    N, L, Hk, K = k.shape
    H, V = v.shape[2], v.shape[3]
    G = q.shape[3]
    o = q.new_empty(N, L, H, G, V)
    states = q.new_empty(N, L, H, K, V) if keep_states else None
    deltas = q.new_empty(N, min(keep_deltas, L), H, V)
    for t in range(L):
        k_t = _heads(k[:, t], H)                                   # [N, H, K]
        q_t = _heads(q[:, t], H)                                   # [N, H, G, K]
        rows = q_t
        decay = None
        if lam is not None:
            decay = lam[:, t].exp()
            decay = decay[..., None] if decay.dim() == 2 else decay   # [N, H, 1] or [N, H, K]
            rows = rows * decay.unsqueeze(-2)
        if b is not None:
            b_t = b[:, t]
            kb = k_t * (b_t if b_t.dim() == 3 else b_t[..., None])
            if decay is not None:
                kb = kb * decay
            rows = torch.cat([rows, kb.unsqueeze(-2)], dim=-2)      # [N, H, G + 1, K]
        read = rows @ S                                              # the one read of the old state
        u = v[:, t]
        if w is not None:
            w_t = w[:, t]
            u = u * (w_t if w_t.dim() == 3 else w_t[..., None])
        if b is not None:
            u = u - read[..., G, :]
        if t < deltas.shape[1]:
            deltas[:, t] = u
        kq = (q_t * k_t.unsqueeze(-2)).sum(-1, keepdim=True)        # [N, H, G, 1]
        o[:, t] = (read[..., :G, :] + kq * u.unsqueeze(-2)) * scale
        # S = D S + k u^T: a new tensor on the first step (S is the caller's), then in place
        S = S * decay.unsqueeze(-1) if decay is not None else (S.clone() if t == 0 else S)
        S.view(N * H, K, V).baddbmm_(k_t.reshape(N * H, K, 1), u.reshape(N * H, 1, V))
        if keep_states:
            states[:, t] = S
    return (o, S, states, deltas) if keep_deltas else (o, S, states)


def _heads(x, H):
    """[N, Hx, ...] -> [N, H, ...]: each head serves H / Hx consecutive heads."""
    return x if x.shape[1] == H else x.repeat_interleave(H // x.shape[1], dim=1)
