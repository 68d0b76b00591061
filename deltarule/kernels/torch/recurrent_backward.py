"""Reverse mode of the recurrence in torch ops, token by token (docs/algorithm.md section 7).

The forward keeps the state at every chunk boundary (`checkpointed`); the
backward recomputes a chunk's states from its boundary (`recurrent` with
`keep_states`), then walks them in reverse. With S' = diag(d) S_prev,
u = w*v - S'^T (b*k), S = S' + k u^T and o_g = scale * S^T q_g, one reverse
step given dS (the gradient reaching S from later tokens) and do_g:

    dS  += scale * sum_g q_g do_g^T      dq_g = scale * S do_g
    du   = dS^T k                        dk   = dS u
    dw   = du * v                        dv   = du * w
    dS'  = dS - (b*k) du^T               p    = S' du,  db = -k * p,  dk -= b * p
    dlam = rowsum(dS' * S')              dS_prev = diag(d) dS'

The state is never recovered by dividing the decay back out: d may be 0 (a
reset). Compute only: token-major operands as in `deltarule.backends._prepare`
(`recurrent`'s contract); float32, or float64 throughout for gradcheck.
"""

from __future__ import annotations

import torch

from .chunked import chunked
from .recurrent import _heads, recurrent

# Tokens between the kept states of the forward: a chunk's states are recomputed in the
# backward, [N, CHECKPOINT, H, K, V] at a time.
CHECKPOINT = 64


def checkpointed(q, k, v, lam, b, w, S, scale: float, chunk_size: int, recurrent_max_len: int):
    """The forward of `recurrent`'s contract, chunk by chunk of CHECKPOINT tokens.

    Returns o [N, L, H, G, V], the final state, and the state at the start of
    every chunk, [N, ceil(L / CHECKPOINT), H, K, V] (the first is S).
    """
    N, L = k.shape[:2]
    outputs, starts = [], []
    for t0 in range(0, max(L, 1), CHECKPOINT):
        t1 = min(t0 + CHECKPOINT, L)
        starts.append(S)
        part = [None if x is None else x[:, t0:t1] for x in (q, k, v, lam, b, w)]
        if t1 - t0 <= recurrent_max_len:
            o, S, _ = recurrent(*part, S, scale)
        else:
            o, S = chunked(*part, S, scale, chunk_size)
        outputs.append(o)
    return torch.cat(outputs, dim=1), S, torch.stack(starts, dim=1)


def backward(q, k, v, lam, b, w, starts, scale: float, do, dS, needs):
    """Gradients of `checkpointed`'s outputs.

    Args:
        q, k, v, lam, b, w, scale: the forward's operands (`recurrent`'s contract).
        starts: [N, NC, H, K, V] the chunk-start states from `checkpointed`.
        do: [N, L, H, G, V] the output's gradient; dS: [N, H, K, V] the final
            state's gradient, or None.
        needs: seven bools, which of (q, k, v, lam, b, w, S0) want a gradient.

    Returns:
        (dq, dk, dv, dlam, db, dw, dS0) shaped like the operands, None where not
        needed or absent. With b and w the same tensor both get their part.
    """
    dtype = starts.dtype
    N, L, Hk, K = k.shape
    H, V, G = v.shape[2], v.shape[3], q.shape[3]
    f = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    q, k, v, lam, b, w, do = map(f, (q, k, v, lam, b, w, do))
    dq = q.new_zeros(N, L, H, G, K)
    dk = k.new_zeros(N, L, H, K)
    dv = v.new_zeros(N, L, H, V)
    dlam = None if lam is None else k.new_zeros(N, L, H, K)
    db = None if b is None else k.new_zeros(N, L, H, K)
    dw = None if w is None else v.new_zeros(N, L, H, V)
    dS = starts.new_zeros(N, H, K, V) if dS is None else dS.to(dtype).clone()
    scalar_b = b is not None and b.dim() == 3
    scalar_w = w is not None and w.dim() == 3
    for c in reversed(range(starts.shape[1])):
        t0, t1 = c * CHECKPOINT, min((c + 1) * CHECKPOINT, L)
        part = [None if x is None else x[:, t0:t1] for x in (q, k, v, lam, b, w)]
        _, _, states = recurrent(*part, starts[:, c], scale, keep_states=True)
        for t in reversed(range(t0, t1)):
            S = states[:, t - t0]
            S_prev = starts[:, c] if t == t0 else states[:, t - t0 - 1]
            k_t = _heads(k[:, t], H)                                     # [N, H, K]
            q_t = _heads(q[:, t], H)                                     # [N, H, G, K]
            d = None if lam is None else lam[:, t].exp()
            d = None if d is None else (d[..., None] if d.dim() == 2 else d)   # [N, H, 1 | K]
            S1 = S_prev if d is None else S_prev * d[..., None]          # S' = D S_prev
            u = v[:, t] if w is None else v[:, t] * (w[:, t][..., None] if scalar_w else w[:, t])
            bk = None
            if b is not None:
                bk = k_t * (b[:, t][..., None] if scalar_b else b[:, t])
                u = u - torch.einsum("nhk,nhkv->nhv", bk, S1)
            do_t = do[:, t]                                              # [N, H, G, V]
            dS = dS + scale * torch.einsum("nhgk,nhgv->nhkv", q_t, do_t)
            dq[:, t] = scale * torch.einsum("nhkv,nhgv->nhgk", S, do_t)
            du = torch.einsum("nhkv,nhk->nhv", dS, k_t)
            dk[:, t] = torch.einsum("nhkv,nhv->nhk", dS, u)
            dv[:, t] = du if w is None else du * (w[:, t][..., None] if scalar_w else w[:, t])
            if w is not None:
                dw[:, t] = du * v[:, t]
            if b is not None:
                dS = dS - bk[..., None] * du[..., None, :]
                p = torch.einsum("nhkv,nhv->nhk", S1, du)
                db[:, t] = -k_t * p
                dk[:, t] -= (b[:, t][..., None] if scalar_b else b[:, t]) * p
            if d is not None:
                dlam[:, t] = (dS * S1).sum(-1)
                dS = dS * d[..., None]
    dq = dq.view(N, L, q.shape[2], H // q.shape[2], G, K).sum(3)
    dk = dk.view(N, L, Hk, H // Hk, K).sum(3)
    if dlam is not None and lam.dim() == 3:
        dlam = dlam.sum(-1)
    if scalar_b:
        db = db.sum(-1)
    if scalar_w:
        dw = dw.sum(-1)
    grads = (dq, dk, dv, dlam, db, dw, dS)
    return tuple(x if need else None for x, need in zip(grads, needs))
