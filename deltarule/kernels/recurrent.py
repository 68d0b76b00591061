"""Token-by-token recurrence in torch ops (decode and short sequences).

Compute only: float32 sequence-major operands as described in
`deltarule.backends._prepare`; no validation.
"""

from __future__ import annotations

import torch


def recurrent(q, k, v, lam, b, w, S, scale: float):
    """Run L steps of the generalized recurrence for all N x Hv heads at once.

    Args:
        q: [N, H, G, L, K]; k: [N, H, L, K]; v: [N, H, L, V] float32.
        lam: None | [N, H, L] | [N, H, L, K] log decay.
        b: None | [N, H, L] | [N, H, L, K] erase gate; w: None | [N, H, L] |
            [N, H, L, V] write gate (both None for the rules without retrieval).
        S: [N, H, K, V] float32 initial state (not modified).

    Returns:
        o [N, H, G, L, V] float32 and the final state [N, H, K, V].
    """
    L = k.shape[2]
    o = q.new_empty(*q.shape[:-1], v.shape[-1])
    per_key = lam is not None and lam.dim() == 4
    for t in range(L):
        k_t = k[:, :, t]                                         # [N, H, K]
        if lam is not None:
            decay = lam[:, :, t].exp()
            S = S * (decay[..., None] if per_key else decay[..., None, None])
        u = v[:, :, t]
        if w is not None:
            w_t = w[:, :, t]
            u = u * (w_t if w_t.dim() == 3 else w_t[..., None])
        if b is not None:
            b_t = b[:, :, t]
            kb = k_t * (b_t if b_t.dim() == 3 else b_t[..., None])
            u = u - (kb.unsqueeze(-2) @ S).squeeze(-2)           # S'^T (b * k)
        S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2)
        o[:, :, :, t] = (q[:, :, :, t] @ S) * scale
    return o, S
