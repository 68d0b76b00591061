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

GROUP_ELEMENTS = 1 << 24      # float32 elements of intra-chunk temporaries per chunk group


def chunked(q, k, v, lam, b, w, S, scale: float, chunk_size: int):
    """Same contract as `kernels.recurrent.recurrent`, computed chunk by chunk.

    Operands are token-major ([N, L, H, ...]); inside, chunks are outermost
    ([NC, N, H, C, ...]) so that every per-chunk slice is contiguous.
    `chunk_size` is rounded up to a power of two when the decay is per key.
    """
    N, L, H, G, K = q.shape
    V = v.shape[-1]
    per_key = lam is not None and lam.dim() == 4
    C = 1 << (chunk_size - 1).bit_length() if per_key else chunk_size
    NC = -(-L // C)
    if lam is None:                                  # no decay: G = 0 (keeps one code path)
        lam = k.new_zeros(N, L, H)

    def chunks(x):
        """[N, L, H, *F] -> [NC, N, H, C, *F], padded with identity steps (zeros)."""
        if x is None:
            return None
        feat = x.shape[3:]
        out = x.new_zeros(NC, N, H, C, *feat)
        dst = out.permute(1, 0, 3, 2, *range(4, out.dim()))     # [N, NC, C, H, *F] view
        full, rem = divmod(L, C)
        dst[:, :full] = x[:, : full * C].reshape(N, full, C, H, *feat)
        if rem:
            dst[:, full, :rem] = x[:, full * C:]
        return out

    qc = chunks(q).transpose(3, 4).contiguous()                 # [NC, N, H, G, C, K]
    kc, vc, lc, bc, wc = (chunks(x) for x in (k, v, lam, b, w))

    per_chunk = N * H * (C * (3 * K + 3 * V + (G + 2) * C) + K * V
                         + (2 * C * K * (G + 2) if per_key else 0))
    group = max(1, GROUP_ELEMENTS // per_chunk)
    o = q.new_empty(N, NC * C, H, G, V)
    o_chunks = o.view(N, NC, C, H, G, V).permute(1, 0, 3, 4, 2, 5)   # [NC, N, H, G, C, V] view
    NH = N * H
    for c0 in range(0, NC, group):
        sl = slice(c0, min(c0 + group, NC))
        n = sl.stop - sl.start
        U, Y, M, q_dec, k_dec, s_dec = _intra(
            qc[sl], kc[sl], vc[sl], lc[sl],
            None if bc is None else bc[sl], None if wc is None else wc[sl], scale)
        states = S.new_empty(n + 1, N, H, K, V)      # states[i]: the state entering chunk i
        states[0] = S
        for i in range(n):
            S_i, S_next = states[i].view(NH, K, V), states[i + 1].view(NH, K, V)
            U_i = U[i].view(NH, C, V)
            if Y is not None:                        # U = Ũ - Y S, in place
                U_i.baddbmm_(Y[i].view(NH, C, K), S_i, alpha=-1.0)
            torch.mul(states[i], s_dec[i], out=states[i + 1])
            S_next.baddbmm_(k_dec[i].view(NH, C, K).transpose(1, 2), U_i)
        S = states[n]
        o_grp = torch.baddbmm(
            (M.view(-1, G * C, C) @ U.view(-1, C, V)),
            q_dec.view(-1, G * C, K), states[:n].view(-1, K, V))
        o_chunks[sl] = o_grp.view(n, N, H, G, C, V)
    return o[:, :L], S


def _intra(q, k, v, lam, b, w, scale):
    """State-free quantities of a group of n chunks.

    Operands [n, N, H, (G,) C, ...]. Returns U_free [.., C, V] (updated in place
    by the caller into U), Y [.., C, K] or None, M [.., G, C, C] (scale folded
    in), q_dec [.., G, C, K] (scale folded in), k_dec [.., C, K] and the
    per-chunk state decay s_dec [.., 1, 1] (scalar) or [.., K, 1] (per key).
    """
    C = k.shape[-2]
    kt = k.transpose(-1, -2)
    if lam.dim() == 4:                                                # scalar decay [.., C]
        Gc = lam.cumsum(-1)
        diff = Gc[..., :, None] - Gc[..., None, :]
        mask = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
        gamma = diff.masked_fill(~mask, float("-inf")).exp()          # [.., C, C] lower incl. diag
        M = (q @ kt.unsqueeze(-3)) * (gamma * scale).unsqueeze(-3)
        e_G = Gc.exp()
        q_dec = q * (e_G * scale)[..., None, :, None]
        k_dec = k * (Gc[..., -1:] - Gc).exp()[..., None]
        s_dec = Gc[..., -1].exp()[..., None, None]
        A = None
        if b is not None:
            A = (k @ kt if b.dim() == 4 else (k * b) @ kt) * gamma
            A = A.tril(-1)
            if b.dim() == 4:
                A = A * b[..., :, None]                               # row scale: diag(b) K K^T
    else:                                                             # per-key decay [.., C, K]
        Gc = lam.cumsum(-2)
        M = _pairwise_per_key(q, k, Gc, strict=False) * scale
        e_G = Gc.exp()
        q_dec = q * (e_G * scale).unsqueeze(-3)
        k_dec = k * (Gc[..., -1:, :] - Gc).exp()
        s_dec = Gc[..., -1, :].exp()[..., None]
        A = None
        if b is not None:
            kb = k * (b if b.dim() == 5 else b[..., None])
            A = _pairwise_per_key(kb.unsqueeze(-3), k, Gc, strict=True).squeeze(-3)

    if A is None:
        return v.contiguous(), None, M, q_dec, k_dec, s_dec
    T = _unit_lower_inverse(A)
    # scalar gates scale T's columns (C x C) instead of V or K (C x V, C x K)
    Tw = T * w[..., None, :] if w.dim() == 4 else T
    U = Tw @ (v if w.dim() == 4 else v * w)
    eb = e_G * b if (b.dim() == 4 and e_G.dim() == 4) else None
    if eb is not None:
        Y = (T * eb[..., None, :]) @ k
    else:
        kb = k * (b if b.dim() == 5 else b[..., None])
        Y = T @ (kb * (e_G if e_G.dim() == 5 else e_G[..., None]))
    return U, Y, M, q_dec, k_dec, s_dec


def _unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower triangular A [.., C, C], by block doubling.

    Level s completes the diagonal blocks of size 2s from those of size s:
    T21 = -T22 A21 T11, all blocks of all chunks in one batched product.
    Batched small products beat a per-matrix triangular solve on the CPU.
    """
    *lead, C, _ = A.shape
    T = torch.eye(C, dtype=A.dtype, device=A.device).expand(*lead, C, C).contiguous()
    s = 1
    while s < C:
        m = -(-C // (2 * s))
        Cp = m * 2 * s
        if Cp != C:                                  # ragged last block: pad to whole blocks
            Ap = F.pad(A, (0, Cp - C, 0, Cp - C))
            Tp = F.pad(T, (0, Cp - C, 0, Cp - C))
            Tp[..., C:, C:] = torch.eye(Cp - C, dtype=A.dtype, device=A.device)
        else:
            Ap, Tp = A, T
        a = Ap.reshape(*lead, m, 2, s, m, 2, s).diagonal(dim1=-6, dim2=-3)   # [.., 2, s, 2, s, m]
        t = Tp.view(*lead, m, 2, s, m, 2, s).diagonal(dim1=-6, dim2=-3)
        t21 = -(t[..., 1, :, 1, :, :].movedim(-1, -3) @ a[..., 1, :, 0, :, :].movedim(-1, -3)
                @ t[..., 0, :, 0, :, :].movedim(-1, -3))
        t[..., 1, :, 0, :, :].copy_(t21.movedim(-3, -1))
        T = Tp[..., :C, :C] if Cp != C else Tp
        s *= 2
    return T


def _pairwise_per_key(x, k, Gc, *, strict: bool):
    """P[r, s] = sum_k x[r,k] exp(G[r,k] - G[s,k]) k[s,k] for s < r (or s <= r).

    x [.., R, C, K] (R row groups sharing k and G), k / Gc [.., C, K] ->
    [.., R, C, C], C a power of two. Recursive halving: at block size s, rows
    of each odd block meet columns of the even block before it through the
    reference n = last token of the even block, so both factors
    exp(G_r - G_n) and exp(G_n - G_s) lie in [0, 1] and the block is one
    product. Every pair r > s is met at exactly one level.
    """
    *lead, C, K = k.shape
    R = x.shape[-3]
    out = x.new_zeros(*lead, R, C, C)
    s = C // 2
    while s >= 1:
        m = C // (2 * s)
        G4 = Gc.view(*lead, m, 2, s, K)
        Gn = G4[..., 0, s - 1:s, :]                                   # [.., m, 1, K]
        right = k.view(*lead, m, 2, s, K)[..., 0, :, :] * (Gn - G4[..., 0, :, :]).exp()
        left = x.view(*lead, R, m, 2, s, K)[..., 1, :, :] * (G4[..., 1, :, :] - Gn).exp().unsqueeze(-4)
        block = left @ right.unsqueeze(-4).transpose(-1, -2)          # [.., R, m, s, s]
        # out as [.., R, m, 2, s, m', 2, s]; its diagonal over (m, m') is [.., R, 2, s, 2, s, m]
        diag = out.view(*lead, R, m, 2, s, m, 2, s).diagonal(dim1=-6, dim2=-3)
        diag[..., 1, :, 0, :, :].copy_(block.movedim(-3, -1))
        s //= 2
    if not strict:
        out.diagonal(dim1=-2, dim2=-1).copy_((x * k.unsqueeze(-3)).sum(-1))
    return out
