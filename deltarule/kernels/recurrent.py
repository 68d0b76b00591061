"""Token-by-token recurrence in torch ops (decode and short sequences).

Compute only: float32 token-major operands as described in
`deltarule.backends._prepare`; no validation.
"""

from __future__ import annotations

import torch


def recurrent(q, k, v, lam, b, w, S, scale: float):
    """Run L steps of the generalized recurrence for all N x H heads at once.

    Args:
        q: [N, L, H, G, K]; k: [N, L, H, K]; v: [N, L, H, V] float32.
        lam: None | [N, L, H] | [N, L, H, K] log decay.
        b: None | [N, L, H] | [N, L, H, K] erase gate; w: None | [N, L, H] |
            [N, L, H, V] write gate (both None for the rules without retrieval).
        S: [N, H, K, V] float32 initial state (not modified).

    Returns:
        o [N, L, H, G, V] float32 and the final state [N, H, K, V].
    """
    L = k.shape[1]
    o = q.new_empty(*q.shape[:-1], v.shape[-1])
    for t in range(L):
        k_t = k[:, t]                                             # [N, H, K]
        if lam is not None:
            decay = lam[:, t].exp()
            S = S * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        u = v[:, t]
        if w is not None:
            w_t = w[:, t]
            u = u * (w_t if w_t.dim() == 3 else w_t[..., None])
        if b is not None:
            b_t = b[:, t]
            kb = k_t * (b_t if b_t.dim() == 3 else b_t[..., None])
            u = u - (kb.unsqueeze(-2) @ S).squeeze(-2)            # S'^T (b * k)
        S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2)
        o[:, t] = (q[:, t] * scale) @ S
    return o, S
