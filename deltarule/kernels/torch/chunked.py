"""Chunked (WY / UT-transform) prefill in torch ops, see docs/algorithm.md.

Per chunk of C tokens with cumulative log decay G (from the chunk start):

    A = strict_lower((B*K) Γ K^T)      M = lower(Q Γ K^T)      T = (I + A)^-1
    Ũ = T (W*V)    Y = T (exp(G) * B * K)    U = Ũ - Y S0
    O = scale [(Q * exp(G)) S0 + M U]        S_C = exp(G_C) S0 + (K * exp(G_C - G))^T U

A, M, Ũ and Y do not depend on the state: they are formed for a group of chunks
at once (batched matrix products); the chunk-to-chunk loop is two in-place
products and a decay per chunk, and the group's outputs are one batched
product afterwards. With per-key decay, A and M come from a recursive-halving
block factorisation (`_pairwise_per_key`).
Every exponent is a difference G_r - G_s with r >= s (never exp of an unbounded
cumulative sum). A log decay of -inf (a state reset) would make such a
difference -inf - -inf = NaN: log decays are clamped at LOG_DECAY_FLOOR first,
whose exp is 0 in float32 as well, so a reset still zeroes everything before it.
The cumulative sums are float64 (`cumulative`): in float32 a chunk whose earlier
tokens decay strongly (or reset: -110 each) makes |G| large, and a difference of two
such sums loses the small decays between them (32 resets in a chunk: 8e-5 relative
error in o; strong then weak decays: 2e-5). Only the exponents are float64.
Memory is bounded by the group size, linear in T overall.

Compute only: token-major operands as described in
`deltarule.backends._prepare`; no validation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP_ELEMENTS = 1 << 22      # float32 elements of temporaries per chunk group (~16 MB, cache-sized)
# The lowest log decay a chunked form uses: exp(-110) is 0 in float32 (below half the smallest
# denormal), so the clamp changes no decay factor, and differences of cumulative sums stay finite.
LOG_DECAY_FLOOR = -110.0


def chunked(q, k, v, lam, b, w, S, scale: float, chunk_size: int):
    """Same contract as `kernels.torch.recurrent.recurrent`, computed chunk by chunk.

    Operands are token-major ([N, L, H, ...]; q and k may have Hq' / Hk heads
    dividing H, each serving H / Hk consecutive state heads). One group of
    chunks at a time is copied chunk-major ([n, N, H, C, ...], heads expanded)
    so that every per-chunk slice is contiguous and memory beyond the inputs
    and the output stays bounded by the group size.
    `chunk_size` is rounded up to a power of two when the decay is per key.
    """
    N, L, _, G, K = q.shape
    H, V = v.shape[2], v.shape[3]
    if N == 0 or L == 0:                             # no work (and no group size to divide by)
        return torch.zeros(N, L, H, G, V, dtype=torch.float32, device=q.device), S
    per_key = lam is not None and lam.dim() == 4
    C = 1 << (chunk_size - 1).bit_length() if per_key else chunk_size
    NC = -(-L // C)
    if lam is None:                                  # no decay: G = 0 (keeps one code path)
        lam = k.new_zeros(N, L, H)
    else:
        lam = lam.clamp_min(LOG_DECAY_FLOOR)

    per_chunk = N * H * (C * (4 * K + 3 * V + (G + 2) * C) + K * V
                         + (2 * C * K * (G + 2) if per_key else 0))
    group = max(1, GROUP_ELEMENTS // per_chunk)
    o = torch.empty(N, L, H, G, V, dtype=torch.float32, device=q.device)
    NH = N * H
    for c0 in range(0, NC, group):
        n = min(group, NC - c0)
        t0 = c0 * C
        qc = _chunk_major(q, t0, n, C, H).transpose(3, 4).contiguous()   # [n, N, H, G, C, K]
        kc, vc, lc, bc = (_chunk_major(x, t0, n, C, H) for x in (k, v, lam, b))
        wc = bc if w is b else _chunk_major(w, t0, n, C, H)   # scalar beta: one gate, one copy
        U, Y, M, q_dec, k_dec, s_dec = _intra(qc, kc, vc, lc, bc, wc)
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
        o_grp = torch.baddbmm(                       # scale (M U + (Q * exp G) S0)
            (M.view(-1, G * C, C) @ U.view(-1, C, V)),
            q_dec.view(-1, G * C, K), states[:n].view(-1, K, V), beta=scale, alpha=scale)
        _to_tokens(o, t0, o_grp.view(n, N, H, G, C, V).transpose(3, 4))
    return o, S


def _chunk_major(x, t0: int, n: int, C: int, H: int):
    """Tokens t0 .. t0 + n*C of x [N, L, Hx, *F] -> [n, N, H, C, *F].

    Heads are expanded (each of the Hx source heads serves H / Hx consecutive
    heads); tokens past L are identity steps (zeros).
    """
    if x is None:
        return None
    N, L, Hx, *feat = x.shape
    r = H // Hx
    out = torch.empty(n, N, H, C, *feat, dtype=torch.float32, device=x.device)   # widens fp16 / bf16
    # out as [N, n, C, Hx, r, *F], the token-major order of the source
    dst = out.view(n, N, Hx, r, C, *feat).permute(1, 0, 4, 2, 3, *range(5, out.dim() + 1))
    full = min(n, (L - t0) // C)
    if full:
        src = x[:, t0:t0 + full * C].reshape(N, full, C, Hx, 1, *feat)
        dst[:, :full] = src
    if full < n:
        rem = L - t0 - full * C
        dst[:, full, :rem] = x[:, t0 + full * C:].unsqueeze(3)
        dst[:, full, rem:] = 0
    return out


def _to_tokens(o, t0: int, block):
    """Write block [n, N, H, C, G, V] into o [N, L, H, G, V] from token t0 (cropped at L)."""
    n, N, H, C = block.shape[:4]
    L = o.shape[1]
    full = min(n, (L - t0) // C)
    if full:
        o[:, t0:t0 + full * C].view(N, full, C, H, *o.shape[3:]).copy_(
            block[:full].permute(1, 0, 3, 2, 4, 5))
    if full < n:
        rem = L - t0 - full * C
        o[:, t0 + full * C:].copy_(block[full, :, :, :rem].transpose(1, 2))


def _intra(q, k, v, lam, b, w):
    """State-free quantities of a group of n chunks.

    Operands [n, N, H, (G,) C, ...]. Returns U_free [.., C, V] (updated in place
    by the caller into U), Y [.., C, K] or None, M [.., G, C, C],
    q_dec [.., G, C, K], k_dec [.., C, K] and the per-chunk state decay
    s_dec [.., 1, 1] (scalar) or [.., K, 1] (per key). The output scale is
    applied by the caller.
    """
    C = k.shape[-2]
    kt = k.transpose(-1, -2)
    A = None
    if lam.dim() == 4:                                                # scalar decay [.., C]
        Gc = cumulative(lam, -1)
        upper = torch.ones(C, C, dtype=torch.bool, device=k.device).triu(1)
        gamma = decay(Gc[..., :, None] - Gc[..., None, :], q.dtype, mask=upper)
        M = (q @ kt.unsqueeze(-3)).mul_(gamma.unsqueeze(-3))         # lower incl. diagonal
        e_G = decay(Gc, q.dtype)
        q_dec = q * e_G[..., None, :, None]
        k_dec = k * decay(Gc[..., -1:] - Gc, q.dtype)[..., None]
        s_dec = e_G[..., -1][..., None, None]
        if b is not None:                    # only the strict lower part of A is ever read
            if b.dim() == 4:
                A = (k @ kt).mul_(gamma).mul_(b[..., :, None])       # diag(b) (K K^T * Γ)
            else:
                A = ((k * b) @ kt).mul_(gamma)
    else:                                                             # per-key decay [.., C, K]
        Gc = cumulative(lam, -2)
        G = q.shape[-3]
        rows = q
        if b is not None:                    # M's and A's rows share the decay factors: one pass
            kb = k * (b if b.dim() == 5 else b[..., None])
            rows = torch.cat([q, kb.unsqueeze(-3)], dim=-3)
        P = _pairwise_per_key(rows, k, Gc)                             # strictly lower
        M = P[..., :G, :, :]
        M.diagonal(dim1=-2, dim2=-1).copy_((q * k.unsqueeze(-3)).sum(-1))   # Γ_rr = 1
        A = P[..., G, :, :] if b is not None else None
        e_G = decay(Gc, q.dtype)
        q_dec = q * e_G.unsqueeze(-3)
        k_dec = k * decay(Gc[..., -1:, :] - Gc, q.dtype)
        s_dec = e_G[..., -1, :][..., None]

    if A is None:
        return v.contiguous(), None, M, q_dec, k_dec, s_dec
    T = _unit_lower_inverse(A)
    # scalar gates scale T's columns (C x C) instead of V or K (C x V, C x K)
    U = (T * w[..., None, :]) @ v if w.dim() == 4 else T @ (v * w)
    if e_G.dim() == 4:                                                # scalar decay
        Y = (T * (e_G * b)[..., None, :]) @ k if b.dim() == 4 else T @ ((k * b) * e_G[..., None])
    else:                                                             # per key: kb from above
        Y = T @ (kb * e_G)
    return U, Y, M, q_dec, k_dec, s_dec


def cumulative(lam, dim: int):
    """The cumulative log decays of a chunk's tokens along `dim`, in float64 (see the module
    docstring: differences of float32 sums lose the small decays after large ones)."""
    return lam.to(torch.float64).cumsum(dim)


def decay(G, dtype, mask=None):
    """exp(G) in `dtype` for a float64 G (a cumulative log decay or a difference of two);
    positions where `mask` is True are 0 (exp(-inf))."""
    if mask is not None:
        G = G.masked_fill(mask, float("-inf"))
    return G.exp_().to(dtype) if mask is not None else G.exp().to(dtype)


def _unit_lower_inverse(A):
    """(I + A)^-1 for the strictly lower part of A [.., C, C], by block doubling.

    Level s completes the diagonal blocks of size 2s from those of size s:
    T21 = -T22 A21 T11, all blocks of all chunks in one batched product.
    Only A's strictly lower triangle is read. Batched small products beat a
    per-matrix triangular solve on the CPU.
    """
    *lead, C, _ = A.shape
    Cp = 1 << (C - 1).bit_length()                   # pad to a power of two: I + A stays unit lower
    if Cp != C:
        A = F.pad(A, (0, Cp - C, 0, Cp - C))
    T = torch.eye(Cp, dtype=A.dtype, device=A.device).expand(*lead, Cp, Cp).contiguous()
    s = 1
    while s < Cp:
        m = Cp // (2 * s)
        a = A.reshape(*lead, m, 2, s, m, 2, s).diagonal(dim1=-6, dim2=-3)   # [.., 2, s, 2, s, m]
        t = T.view(*lead, m, 2, s, m, 2, s).diagonal(dim1=-6, dim2=-3)
        if s == 1:                                   # T11 = T22 = 1
            t[..., 1, :, 0, :, :].copy_(a[..., 1, :, 0, :, :]).neg_()
        else:
            t21 = -(t[..., 1, :, 1, :, :].movedim(-1, -3) @ a[..., 1, :, 0, :, :].movedim(-1, -3)
                    @ t[..., 0, :, 0, :, :].movedim(-1, -3))
            t[..., 1, :, 0, :, :].copy_(t21.movedim(-3, -1))
        s *= 2
    return T[..., :C, :C] if Cp != C else T


def _pairwise_per_key(x, k, Gc):
    """P[r, s] = sum_k x[r,k] exp(G[r,k] - G[s,k]) k[s,k] for s < r, zero elsewhere.

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
        right = k.view(*lead, m, 2, s, K)[..., 0, :, :] * decay(Gn - G4[..., 0, :, :], k.dtype)
        left = x.view(*lead, R, m, 2, s, K)[..., 1, :, :] * decay(G4[..., 1, :, :] - Gn, k.dtype).unsqueeze(-4)
        block = left @ right.unsqueeze(-4).transpose(-1, -2)          # [.., R, m, s, s]
        # out as [.., R, m, 2, s, m', 2, s]; its diagonal over (m, m') is [.., R, 2, s, 2, s, m]
        diag = out.view(*lead, R, m, 2, s, m, 2, s).diagonal(dim1=-6, dim2=-3)
        diag[..., 1, :, 0, :, :].copy_(block.movedim(-3, -1))
        s //= 2
    return out
