"""Chunked (WY / UT-transform) prefill in torch ops, see ../shared/ALGORITHM.md.

Per chunk of C tokens with cumulative log decay G (from the chunk start):

    A = strict_lower((B*K) Γ K^T)      M = lower(Q Γ K^T)      T = (I + A)^-1
    Ũ = T (W*V)    Y = T (exp(G) * B * K)    U = Ũ - Y S0
    O = scale [(Q * exp(G)) S0 + M U]        S_C = exp(G_C) S0 + (K * exp(G_C - G))^T U

A, M, Ũ and Y do not depend on the state: they are formed for a group of chunks
at once (batched matrix products); the chunk-to-chunk loop is three products.
Every exponent is a difference G_r - G_s with r >= s (never exp of an unbounded
cumulative sum). Memory is bounded by the group size, linear in T overall.

Compute only: float32 sequence-major operands as described in
`deltarule.backends._prepare`; no validation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUB = 16                      # per-key decay: sub-chunk size of the block factorisation
GROUP_ELEMENTS = 1 << 24      # float32 elements of intra-chunk temporaries per chunk group


def chunked(q, k, v, lam, b, w, S, scale: float, chunk_size: int):
    """Same contract as `kernels.recurrent.recurrent`, computed chunk by chunk.

    `chunk_size` is rounded up to a multiple of 16 when the decay is per key.
    """
    N, H, G, L, K = q.shape
    V = v.shape[-1]
    per_key = lam is not None and lam.dim() == 4
    C = -(-chunk_size // SUB) * SUB if per_key else chunk_size
    NC = -(-L // C)
    pad = NC * C - L

    def chunks(x):
        """[N, H, L(, F)] -> [N, H, NC, C(, F)], padded with identity steps (zeros)."""
        if x is None:
            return None
        if x.dim() == 3:
            return F.pad(x, (0, pad)).reshape(N, H, NC, C)
        return F.pad(x, (0, 0, 0, pad)).reshape(N, H, NC, C, x.shape[-1])

    qc = F.pad(q, (0, 0, 0, pad)).reshape(N, H, G, NC, C, K).transpose(2, 3)   # [N,H,NC,G,C,K]
    kc, vc = chunks(k), chunks(v)
    lc, bc, wc = chunks(lam), chunks(b), chunks(w)

    per_chunk = N * H * C * (2 * K + 2 * V + (G + 2) * C + (SUB * K * (G + 2) if per_key else 0))
    group = max(1, GROUP_ELEMENTS // max(per_chunk, 1))
    o = q.new_empty(N, H, NC, G, C, V)
    for c0 in range(0, NC, group):
        sl = slice(c0, min(c0 + group, NC))
        part = _intra(qc[:, :, sl], kc[:, :, sl], vc[:, :, sl],
                      None if lc is None else lc[:, :, sl],
                      None if bc is None else bc[:, :, sl],
                      None if wc is None else wc[:, :, sl])
        U_free, Y, M, q_dec, k_dec, s_dec = part
        for i in range(U_free.shape[2]):
            U = U_free[:, :, i] if Y is None else torch.baddbmm(
                U_free[:, :, i].reshape(N * H, C, V), Y[:, :, i].reshape(N * H, C, K),
                S.reshape(N * H, K, V), alpha=-1.0).view(N, H, C, V)
            q_i = q_dec[:, :, i].reshape(N, H, G * C, K)
            o_i = q_i @ S + M[:, :, i].reshape(N, H, G * C, C) @ U
            o[:, :, c0 + i] = (o_i * scale).view(N, H, G, C, V)
            S = S if s_dec is None else S * s_dec[:, :, i]
            S = S + k_dec[:, :, i].transpose(-1, -2) @ U
    o = o.transpose(2, 3).reshape(N, H, G, NC * C, V)[:, :, :, :L]
    return o, S


def _intra(q, k, v, lam, b, w):
    """State-free quantities of a group of chunks ([N, H, n, C, ...] operands).

    Returns (U_free [.., C, V], Y [.., C, K] or None, M [.., G, C, C],
    q_dec [.., G, C, K], k_dec [.., C, K], s_dec [.., K or 1, 1] or None).
    """
    C = k.shape[-2]
    per_key = lam is not None and lam.dim() == 5
    kb = None
    if b is not None:
        kb = k * (b if b.dim() == 5 else b[..., None])
    wv = v if w is None else v * (w if w.dim() == 5 else w[..., None])

    if lam is None:
        mask = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
        M = (q @ k.unsqueeze(3).transpose(-1, -2)).masked_fill(~mask, 0.0)
        A = None if kb is None else (kb @ k.transpose(-1, -2)).tril(-1)
        q_dec, k_dec, s_dec, e_G = q, k, None, None
    elif not per_key:
        Gc = lam.cumsum(-1)                                           # [.., C]
        diff = Gc[..., :, None] - Gc[..., None, :]
        mask = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
        gamma = diff.masked_fill(~mask, float("-inf")).exp()          # [.., C, C], lower incl. diag
        M = (q @ k.unsqueeze(3).transpose(-1, -2)) * gamma.unsqueeze(3)
        A = None if kb is None else ((kb @ k.transpose(-1, -2)) * gamma).tril(-1)
        e_G = Gc.exp()[..., None]                                     # [.., C, 1]
        q_dec = q * e_G.unsqueeze(3)
        k_dec = k * (Gc[..., -1:] - Gc).exp()[..., None]
        s_dec = Gc[..., -1].exp()[..., None, None]
    else:
        Gc = lam.cumsum(-2)                                           # [.., C, K]
        M = _pairwise_per_key(q, k, Gc, strict=False)
        A = None if kb is None else _pairwise_per_key(kb.unsqueeze(3), k, Gc, strict=True).squeeze(3)
        e_G = Gc.exp()
        q_dec = q * e_G.unsqueeze(3)
        k_dec = k * (Gc[..., -1:, :] - Gc).exp()
        s_dec = Gc[..., -1, :].exp()[..., None]

    if A is None:
        return wv, None, M, q_dec, k_dec, s_dec
    y_rhs = kb if e_G is None else kb * e_G
    rhs = torch.cat([wv, y_rhs], dim=-1)
    sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)   # (I + A)^-1 rhs
    V = v.shape[-1]
    return sol[..., :V], sol[..., V:], M, q_dec, k_dec, s_dec


def _pairwise_per_key(x, k, Gc, *, strict: bool):
    """P[r, s] = sum_k x[r,k] exp(G[r,k] - G[s,k]) k[s,k] for s < r (or s <= r).

    x [.., R, C, K] (R row groups sharing k and G), k / Gc [.., C, K] ->
    [.., R, C, C]. Blocks below the diagonal of 16-token sub-chunks are matrix
    products through the reference point n = last token of the column block
    (both factors exp(G_r - G_n), exp(G_n - G_s) lie in [0, 1]); diagonal blocks
    are formed element by element.
    """
    *lead, C, K = k.shape
    R = x.shape[-3]
    ns, c = C // SUB, SUB
    Gs = Gc.view(*lead, ns, c, K)
    Gn = Gs[..., -1, :]                                               # [.., ns, K]
    right = k.view(*lead, ns, c, K) * (Gn.unsqueeze(-2) - Gs).exp()   # [.., ns, c, K]
    # rows at or before the reference are masked below; clamp keeps their factor finite
    left = x.unsqueeze(-3) * (Gc.unsqueeze(-3) - Gn.unsqueeze(-2)).clamp(max=0).exp().unsqueeze(-4)
    blocks = left @ right.unsqueeze(-4).transpose(-1, -2)             # [.., R, ns, C, c]
    out = blocks.permute(*range(len(lead)), -4, -2, -3, -1).reshape(*lead, R, C, C)
    sub = torch.arange(C, device=k.device) // c
    out = out.masked_fill(~(sub[:, None] > sub[None, :]), 0.0)

    xd = x.view(*lead, R, ns, c, K)
    diff = Gs.unsqueeze(-2) - Gs.unsqueeze(-3)                        # [.., ns, c(r), c(s), K]
    tri = torch.ones(c, c, dtype=torch.bool, device=k.device).tril(-1 if strict else 0)
    decay = diff.masked_fill(~tri[..., None], float("-inf")).exp()
    kd = k.view(*lead, ns, c, K)
    diag = torch.einsum("...rnik,...njk,...nijk->...rnij", xd, kd, decay)   # [.., R, ns, c, c]
    d = len(lead) + 1
    # the diagonal view of out as [.., R, J, i, J', j] is [.., R, i, j, J]
    out.view(*lead, R, ns, c, ns, c).diagonal(dim1=-4, dim2=-2).copy_(diag.permute(*range(d), d + 1, d + 2, d))
    return out
