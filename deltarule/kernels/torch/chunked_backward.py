"""Reverse mode of the recurrence, chunk by chunk (WY / UT form; docs/algorithm.md section 7).

The same contract and results as `recurrent_backward.backward`, but each chunk's
work is batched matrix products; the only loop over time is the reverse state
pass, one step per chunk. Chunks are the forward's checkpoint intervals
(`recurrent_backward.CHECKPOINT` tokens, their entering states are `starts`),
padded with identity steps to a power of two when the decay is per key.

Per chunk (the forward of `kernels/torch/chunked.py`; G the cumulative log decay from
the chunk start, Γ_rs = exp(G_r - G_s) for r >= s, E = B*K*exp(G), WV = W*V):

    A = strict_lower((B*K) Γ K^T)   M = lower(Q Γ K^T)   T = (I + A)^-1
    U = T WV - T E S0               O = scale [(Q*exp G) S0 + M U]
    S_C = exp(G_C) S0 + (K*exp(G_C - G))^T U

Stages, in flash-linear-attention's chunk.py order (each a function below):

1. `recompute`: Γ factors, A, M, T, the WY factors (Y = T E, Ũ = T WV) and U
   from the chunk-entry states;
2. `local_dv`: the intra-chunk part of dU, scale M^T dO;
3. `reverse_state_pass`: dU += K̂ dS_C and dS_0 = exp(G_C) dS_C + scale
   (Q*exp G)^T dO - Y^T dU, chunk by chunk in reverse (the only sequential part);
4. `state_products`: dq's state term, dM, dY = -dU S0^T and the decay terms of
   the state products;
5. `wy_backward`: d(WV) = T^T dU, dE = T^T dY, dA = strict_lower(-T^T dT T^T);
6. `gate_products`: dM and dA through Γ into dq, dk, d(B*K) and dG, then E and
   WV into db, dk, dv, dw;
7. `decay_gradient`: dλ_r = Σ_{s>=r} dG_s, a reverse cumulative sum per chunk.

Numerical safety is the forward's: log decays are clamped at
`chunked.LOG_DECAY_FLOOR` (a -inf decay is a reset; its gradient is 0, as in the
token walk), every exponent is a difference G_r - G_s with r >= s or G_r (<= 0),
and per-key Γ goes through the recursive-halving factorisation of
`chunked._pairwise_per_key` (reference token n with s <= n <= r, both factors
in [0, 1]) in `_pairwise_per_key_backward`. The decay gradient of a pairwise
product P_rs = Σ_k X_rk Γ_rs,k K_sk is X*dX - K*dK, so it needs no exponent of
its own. Compute only: token-major operands as in `deltarule.backends._prepare`
(`recurrent`'s contract); float32, or float64 throughout for gradcheck.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import recurrent_backward
from .chunked import LOG_DECAY_FLOOR, _pairwise_per_key, _unit_lower_inverse, cumulative, decay

GROUP_ELEMENTS = 1 << 23      # elements of per-chunk temporaries per group of chunks (memory bound)


def backward(q, k, v, lam, b, w, starts, scale: float, do, dS, needs):
    """Gradients of `recurrent_backward.checkpointed`'s outputs, chunk by chunk.

    Same arguments and results as `recurrent_backward.backward`: starts
    [N, NC, H, K, V] holds the state entering every chunk of
    `recurrent_backward.CHECKPOINT` tokens; do [N, L, H, G, V]; dS [N, H, K, V]
    or None; needs seven bools for (q, k, v, lam, b, w, S0). Returns (dq, dk,
    dv, dlam, db, dw, dS0) shaped like the operands, None where not needed or
    absent; with b and w the same tensor both get their part.
    """
    dtype = starts.dtype
    N, L, Hk, K = k.shape
    Hq1, G = q.shape[2], q.shape[3]
    H, V = v.shape[2], v.shape[3]
    NC = starts.shape[1]
    C = recurrent_backward.CHECKPOINT
    per_key = lam is not None and lam.dim() == 4
    Cp = 1 << (C - 1).bit_length() if per_key else C     # _pairwise_per_key needs a power of two
    scalar_b = b is not None and b.dim() == 3
    scalar_w = w is not None and w.dim() == 3
    one_gate = w is b                                # scalar beta: b and w are one tensor
    f = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    q, k, v, lam, b, w, do = map(f, (q, k, v, lam, b, w, do))
    lam_c = None if lam is None else lam.clamp_min(LOG_DECAY_FLOOR)

    dq = q.new_zeros(N, L, H, G, K)
    dk = k.new_zeros(N, L, H, K)
    dv = v.new_zeros(N, L, H, V)
    dlam = None if lam is None else torch.zeros_like(lam)
    db = None if b is None else torch.zeros_like(b)
    dw = None if w is None else torch.zeros_like(w)
    dS = starts.new_zeros(N, H, K, V) if dS is None else dS.to(dtype).clone()

    per_chunk = N * H * (Cp * (6 * K + 6 * V + (3 * G + 6) * Cp) + 3 * K * V
                         + (4 * Cp * K * (G + 2) if per_key else 0))
    group = max(1, GROUP_ELEMENTS // max(per_chunk, 1))       # per_chunk is 0 when N = 0
    for c1 in range(NC, 0, -group):                  # groups of chunks, last first
        c0 = max(0, c1 - group)
        t0, t1 = c0 * C, min(c1 * C, L)
        ch = lambda x: None if x is None else _chunks(x[:, t0:t1], C, Cp, H)  # noqa: E731
        qc = ch(q).transpose(-3, -2)                 # [n, N, H, G, Cp, K]
        kc, vc, lc, bc = ch(k), ch(v), ch(lam_c), ch(b)
        wc = bc if one_gate else ch(w)
        doc = ch(do).transpose(-3, -2)               # [n, N, H, G, Cp, V]
        S0 = starts[:, c0:c1].transpose(0, 1)        # [n, N, H, K, V]
        r = recompute(qc, kc, vc, lc, bc, wc, S0)
        dU = local_dv(r, doc, scale)
        dS_end, dS = reverse_state_pass(r, doc, dU, dS, scale)
        st = state_products(r, doc, dU, dS_end, S0, scale)
        wy = wy_backward(r, dU, st.dY)
        g = gate_products(r, st, wy)
        dl = decay_gradient(g.dG, lc)
        # back to token-major, cropped to the group's tokens
        put = lambda out, x: out[:, t0:t1].copy_(_tokens(x, C, t1 - t0))  # noqa: E731
        put(dq, g.dq.transpose(-3, -2))
        put(dk, g.dk)
        put(dv, g.dv)
        if lam is not None:
            put(dlam, dl)
        if b is not None:
            put(db, g.db.sum(-1) if scalar_b else g.db)
        if w is not None:
            put(dw, g.dw.sum(-1) if scalar_w else g.dw)
    if lam is not None:
        dlam = torch.where(lam >= LOG_DECAY_FLOOR, dlam, 0.0)    # clamped (a reset): no gradient
    dq = dq.view(N, L, Hq1, H // Hq1, G, K).sum(3)
    dk = dk.view(N, L, Hk, H // Hk, K).sum(3)
    grads = (dq, dk, dv, dlam, db, dw, dS)
    return tuple(x if need else None for x, need in zip(grads, needs))


def _chunks(x, C: int, Cp: int, H: int):
    """x [N, l, Hx, *F] (l <= n*C) -> [n, N, H, Cp, *F], n = ceil(l / C): chunks of C tokens,
    heads expanded (each source head serves H / Hx consecutive heads), every chunk padded
    with identity steps (zeros) to Cp tokens, the last one to a full chunk first."""
    N, l, Hx, *feat = x.shape
    n = -(-l // C)
    pad = [0, 0] * len(feat)
    x = F.pad(x, pad + [0, 0, 0, n * C - l])
    x = x.view(N, n, C, Hx, *feat)
    if Cp != C:
        x = F.pad(x, pad + [0, 0, 0, Cp - C])
    if Hx != H:
        x = x.repeat_interleave(H // Hx, dim=3)
    return x.permute(1, 0, 3, 2, *range(4, x.dim())).contiguous()


def _tokens(x, C: int, l: int):
    """[n, N, H, Cp, *F] -> [N, l, H, *F]: the inverse of `_chunks` (crops the padding)."""
    n, N, H, Cp, *feat = x.shape
    x = x[:, :, :, :C].permute(1, 0, 3, 2, *range(4, x.dim()))
    return x.reshape(N, n * C, H, *feat)[:, :l]


@dataclass
class Recomputed:
    """The forward's per-chunk quantities (stage 1). Leading dims [n, N, H]; C = chunk size.

    q [.., G, C, K], k [.., C, K], v [.., C, V], b / w None or chunk-major gates;
    Gc cumulative log decay [.., C] (scalar) or [.., C, K], float64; e_G = exp(Gc);
    gamma [.., C, C] lower Γ (scalar decay only); kb = B*K (None without retrieval);
    M [.., G, C, C] (lower, unscaled); A [.., C, C] (strict lower part used) and T
    = (I + A)^-1, None without retrieval; WV = W*V; E = B*K*exp(G); Y = T E;
    U = T WV - Y S0 [.., C, V]; q_dec = Q*exp(G); k_dec = K*exp(G_C - G); s_dec =
    exp(G_C) [.., 1, 1] or [.., K, 1]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    b: torch.Tensor | None
    w: torch.Tensor | None
    per_key: bool
    Gc: torch.Tensor
    e_G: torch.Tensor
    gamma: torch.Tensor | None
    kb: torch.Tensor | None
    M: torch.Tensor
    A: torch.Tensor | None
    T: torch.Tensor | None
    WV: torch.Tensor
    E: torch.Tensor | None
    Y: torch.Tensor | None
    U: torch.Tensor
    q_dec: torch.Tensor
    k_dec: torch.Tensor
    s_dec: torch.Tensor


def recompute(q, k, v, lam, b, w, S0) -> Recomputed:
    """Stage 1: the forward of a group of chunks again, from their entering states S0.

    Operands chunk-major [n, N, H, (G,) C, ...] (lam clamped, or None: no decay);
    S0 [n, N, H, K, V]. Forms Γ (scalar: a masked C x C matrix; per key: the
    halving factorisation), A, M, T, the WY factors and U = Ũ - Y S0 in batched
    products over all chunks: nothing here is sequential, since every chunk's
    entering state is known. Exponents: G_r - G_s (r >= s), G_r and G_C - G_r.
    """
    C = k.shape[-2]
    if lam is None:
        lam = k.new_zeros(k.shape[:-1])
    per_key = lam.dim() == 5
    kt = k.transpose(-1, -2)
    kb = None if b is None else k * (b[..., None] if b.dim() == 4 else b)
    A = gamma = None
    if not per_key:
        Gc = cumulative(lam, -1)                                       # [.., C] float64
        upper = torch.ones(C, C, dtype=torch.bool, device=k.device).triu(1)
        gamma = decay(Gc[..., :, None] - Gc[..., None, :], q.dtype, mask=upper)
        M = (q @ kt.unsqueeze(-3)) * gamma.unsqueeze(-3)
        e_G = decay(Gc, q.dtype)
        e_Gk = e_G[..., None]                                          # broadcasts over K
        q_dec = q * e_Gk.unsqueeze(-3)
        k_dec = k * decay(Gc[..., -1:] - Gc, q.dtype)[..., None]
        s_dec = e_G[..., -1, None, None]
        if kb is not None:
            A = (kb @ kt) * gamma
    else:
        Gc = cumulative(lam, -2)                                       # [.., C, K] float64
        G = q.shape[-3]
        rows = q if kb is None else torch.cat([q, kb.unsqueeze(-3)], dim=-3)
        P = _pairwise_per_key(rows, k, Gc)                             # strictly lower
        M = P[..., :G, :, :]
        M.diagonal(dim1=-2, dim2=-1).copy_((q * k.unsqueeze(-3)).sum(-1))
        A = P[..., G, :, :] if kb is not None else None
        e_G = e_Gk = decay(Gc, q.dtype)
        q_dec = q * e_G.unsqueeze(-3)
        k_dec = k * decay(Gc[..., -1:, :] - Gc, q.dtype)
        s_dec = e_G[..., -1, :, None]
    WV = v if w is None else v * (w[..., None] if w.dim() == 4 else w)
    T = E = Y = None
    if A is None:
        U = WV
    else:
        T = _unit_lower_inverse(A)
        E = kb * e_Gk
        Y = T @ E
        U = T @ WV - Y @ S0
    return Recomputed(q=q, k=k, v=v, b=b, w=w, per_key=per_key, Gc=Gc, e_G=e_G, gamma=gamma, kb=kb,
                      M=M, A=A, T=T, WV=WV, E=E, Y=Y, U=U, q_dec=q_dec, k_dec=k_dec, s_dec=s_dec)


def local_dv(r: Recomputed, do, scale: float):
    """Stage 2: the intra-chunk part of dU, scale * sum_g M_g^T dO_g [.., C, V] (batched)."""
    return scale * (r.M.transpose(-1, -2) @ do).sum(-3)


def reverse_state_pass(r: Recomputed, do, dU, dS, scale: float):
    """Stage 3, the only sequential part: chunks of the group from last to first,

        dS_end[i] = dS                       (the gradient reaching chunk i's final state)
        dU_i     += K̂_i dS
        dS        = exp(G_C) dS + scale * sum_g (Q_g*exp G)^T dO_g - Y_i^T dU_i

    dU is completed in place. The (Q*exp G)^T dO terms do not depend on dS and are
    one batched product beforehand. Returns dS_end [n, N, H, K, V] and the gradient
    reaching the group's entering state (dS0 after the first group).
    """
    n, N, H, C, K = r.k.shape
    V = dU.shape[-1]
    NH = N * H
    local = scale * (r.q_dec.transpose(-1, -2) @ do).sum(-3)          # [n, N, H, K, V]
    dS_end = dS.new_empty(n, N, H, K, V)
    for i in reversed(range(n)):
        dS_end[i] = dS
        dU_i = dU[i].view(NH, C, V)
        dU_i.baddbmm_(r.k_dec[i].view(NH, C, K), dS.view(NH, K, V))
        dS = local[i].addcmul_(r.s_dec[i], dS)
        if r.Y is not None:
            dS.view(NH, K, V).baddbmm_(r.Y[i].view(NH, C, K).transpose(1, 2), dU_i, alpha=-1.0)
    return dS_end, dS


@dataclass
class StateTerms:
    """Stage 4's products: dq_dec = scale dO S0^T [.., G, C, K], dM [.., G, C, C] (lower),
    dk_dec = U dS_end^T [.., C, K], dY = -dU S0^T [.., C, K] (None without retrieval),
    dU [.., C, V], and dG_state, the decay gradient of exp(G) in Q*exp(G), of
    K*exp(G_C - G) and of exp(G_C) S0 ([.., C] or [.., C, K])."""

    dq_dec: torch.Tensor
    dM: torch.Tensor
    dk_dec: torch.Tensor
    dY: torch.Tensor | None
    dU: torch.Tensor
    dG: torch.Tensor


def state_products(r: Recomputed, do, dU, dS_end, S0, scale: float) -> StateTerms:
    """Stage 4: the products with the entering and final states, batched over chunks.

    O = scale [(Q*exp G) S0 + M U] gives d(Q*exp G) = scale dO S0^T and dM = scale dO U^T;
    S_C = exp(G_C) S0 + K̂^T U gives dK̂ = U dS_C^T and d exp(G_C) = rowsum(dS_C * S0);
    U = Ũ - Y S0 gives dY = -dU S0^T. Their decay terms: d(x*exp(f)) / df = dx * x*exp(f).
    """
    S0t = S0.transpose(-1, -2)
    dq_dec = scale * (do @ S0t.unsqueeze(-3))
    C = r.k.shape[-2]
    lower = torch.ones(C, C, dtype=torch.bool, device=do.device).tril()
    dM = (scale * (do @ r.U.transpose(-1, -2).unsqueeze(-3))).masked_fill_(~lower, 0.0)
    dk_dec = r.U @ dS_end.transpose(-1, -2)
    dY = None if r.Y is None else -(dU @ S0t)
    t_q = (dq_dec * r.q_dec).sum(-3)                                   # [.., C, K]
    t_k = dk_dec * r.k_dec
    t_s = (dS_end * S0).sum(-1) * r.s_dec[..., 0]                      # [.., K] or [.., 1]
    if not r.per_key:
        t_q, t_k, t_s = t_q.sum(-1), t_k.sum(-1), t_s.sum(-1)
    dG = t_q - t_k                                                     # exp(G_C - G_r): -t_k at r
    if r.per_key:                                                      # ... and +t_k at C
        dG[..., -1, :] += t_k.sum(-2) + t_s
    else:
        dG[..., -1] += t_k.sum(-1) + t_s
    return StateTerms(dq_dec=dq_dec, dM=dM, dk_dec=dk_dec, dY=dY, dU=dU, dG=dG)


@dataclass
class WYTerms:
    """Stage 5's results: dWV [.., C, V], dE [.., C, K] and dA [.., C, C] (strictly lower);
    without retrieval (T = I) dWV = dU and the others are None."""

    dWV: torch.Tensor
    dE: torch.Tensor | None
    dA: torch.Tensor | None


def wy_backward(r: Recomputed, dU, dY) -> WYTerms:
    """Stage 5: the WY backward. Ũ = T WV and Y = T E, T = (I + A)^-1:

        d(WV) = T^T dU,  dE = T^T dY,  dT = dU WV^T + dY E^T,  dA = strict_lower(-T^T dT T^T)
    """
    if r.T is None:
        return WYTerms(dWV=dU, dE=None, dA=None)
    Tt = r.T.transpose(-1, -2)
    dWV = Tt @ dU
    dE = Tt @ dY
    dT = dU @ r.WV.transpose(-1, -2) + dY @ r.E.transpose(-1, -2)
    dA = -(Tt @ dT @ Tt)
    C = dA.shape[-1]
    strict = torch.ones(C, C, dtype=torch.bool, device=dA.device).tril(-1)
    return WYTerms(dWV=dWV, dE=dE, dA=dA.masked_fill_(~strict, 0.0))


@dataclass
class GateTerms:
    """Stage 6's results, chunk-major: dq [.., G, C, K], dk [.., C, K], dv [.., C, V],
    db / dw in the per-channel shapes ([.., C, K], [.., C, V]) or None, and dG the whole
    decay gradient with respect to the cumulative log decay ([.., C] or [.., C, K])."""

    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    db: torch.Tensor | None
    dw: torch.Tensor | None
    dG: torch.Tensor


def gate_products(r: Recomputed, st: StateTerms, wy: WYTerms) -> GateTerms:
    """Stage 6: dM and dA through Γ into dq, dk, d(B*K) and dG; then E = B*K*exp(G) and
    WV = W*V into db, dk, dv and dw.

    For P_rs = sum_k X_rk Γ_rs,k K_sk: dX = (dP Γ) K, dK = (dP Γ)^T X (per key through
    `_pairwise_per_key_backward`, M's diagonal Γ_rr = 1 apart) and dG = X*dX - K*dK.
    """
    e_Gk = r.e_G if r.per_key else r.e_G[..., None]
    dq = st.dq_dec * e_Gk.unsqueeze(-3)
    dk = st.dk_dec * _exp_to_end(r)                                   # K̂ = K * exp(G_C - G)
    dG = st.dG
    dkb = None
    if not r.per_key:
        dMg = st.dM * r.gamma.unsqueeze(-3)                            # [.., G, C, C]
        dq = dq + dMg @ r.k.unsqueeze(-3)
        dk = dk + (dMg.transpose(-1, -2) @ r.q).sum(-3)
        MM = (st.dM * r.M).sum(-3)                                     # dM * M, summed over G
        # Γ_rr = 1 does not depend on G: its terms cancel in exact arithmetic, but beside a strong
        # decay's tiny off-diagonal ones float32 keeps their rounding (1e-7 where 1e-14 is right)
        MM.diagonal(dim1=-2, dim2=-1).zero_()
        dG = dG + MM.sum(-1) - MM.sum(-2)
        if wy.dA is not None:
            dAg = wy.dA * r.gamma
            dkb = dAg @ r.k
            dk = dk + dAg.transpose(-1, -2) @ r.kb
            AA = wy.dA * r.A
            AA.diagonal(dim1=-2, dim2=-1).zero_()                      # likewise
            dG = dG + AA.sum(-1) - AA.sum(-2)
    else:
        G = r.q.shape[-3]
        rows, dP = r.q, st.dM
        if wy.dA is not None:
            rows = torch.cat([r.q, r.kb.unsqueeze(-3)], dim=-3)
            dP = torch.cat([st.dM, wy.dA.unsqueeze(-3)], dim=-3)
        dx, dkc = _pairwise_per_key_backward(dP, rows, r.k, r.Gc)      # M's diagonal is skipped
        dG = dG + (rows * dx).sum(-3) - r.k * dkc
        diag = st.dM.diagonal(dim1=-2, dim2=-1)[..., None]              # [.., G, C, 1]: Γ_rr = 1
        dq = dq + dx[..., :G, :, :] + diag * r.k.unsqueeze(-3)
        dk = dk + dkc + (diag * r.q).sum(-3)
        if wy.dA is not None:
            dkb = dx[..., G, :, :]
    if wy.dE is not None:                                              # E = kb * exp(G)
        dkb = wy.dE * e_Gk if dkb is None else dkb + wy.dE * e_Gk
        t = wy.dE * r.E
        dG = dG + (t if r.per_key else t.sum(-1))
    db = None
    if dkb is not None:                                                # kb = B * K
        bk = r.b[..., None] if r.b.dim() == 4 else r.b
        dk = dk + dkb * bk
        db = dkb * r.k
    dWV = wy.dWV
    dv = dWV if r.w is None else dWV * (r.w[..., None] if r.w.dim() == 4 else r.w)
    dw = None if r.w is None else dWV * r.v
    return GateTerms(dq=dq, dk=dk, dv=dv, db=db, dw=dw, dG=dG)


def _exp_to_end(r: Recomputed):
    """exp(G_C - G_r) [.., C, K] (or [.., C, 1] scalar): the factor of K̂ = K*exp(G_C - G)."""
    if r.per_key:
        return decay(r.Gc[..., -1:, :] - r.Gc, r.k.dtype)
    return decay(r.Gc[..., -1:] - r.Gc, r.k.dtype)[..., None]


def decay_gradient(dG, lam):
    """Stage 7: dλ_r = sum_{s >= r} dG_s within each chunk (G_s = sum_{i <= s} λ_i), a
    reverse cumulative sum over the chunk's tokens; None without decay. The clamp at
    LOG_DECAY_FLOOR is applied by the caller (a clamped decay gets 0)."""
    if lam is None:
        return None
    dim = -2 if lam.dim() == 5 else -1
    return dG.flip(dim).cumsum(dim).flip(dim)


def _pairwise_per_key_backward(dP, x, k, Gc):
    """The reverse of `chunked._pairwise_per_key`: for P_rs = sum_k x_rk exp(G_rk - G_sk) k_sk
    (s < r) and its gradient dP [.., R, C, C] (only the strict lower part is read), returns
    dx [.., R, C, K] and dk [.., C, K] (summed over the R row groups).

    The same recursive halving and the same reference token n (last of the even block),
    so both factors exp(G_r - G_n) and exp(G_n - G_s) lie in [0, 1]: at each level the
    block's product left @ right^T reverses to dleft = dblock @ right and dright =
    dblock^T @ left, each one batched product.
    """
    *lead, C, K = k.shape
    R = x.shape[-3]
    dx = torch.zeros_like(x)
    dk = torch.zeros_like(k)
    s = C // 2
    while s >= 1:
        m = C // (2 * s)
        G4 = Gc.view(*lead, m, 2, s, K)
        Gn = G4[..., 0, s - 1:s, :]                                   # [.., m, 1, K]
        f_right = decay(Gn - G4[..., 0, :, :], k.dtype)                # [.., m, s, K]
        f_left = decay(G4[..., 1, :, :] - Gn, k.dtype).unsqueeze(-4)   # [.., 1, m, s, K]
        right = k.view(*lead, m, 2, s, K)[..., 0, :, :] * f_right
        left = x.view(*lead, R, m, 2, s, K)[..., 1, :, :] * f_left
        dblock = dP.view(*lead, R, m, 2, s, m, 2, s).diagonal(dim1=-6, dim2=-3)[..., 1, :, 0, :, :]
        dblock = dblock.movedim(-1, -3)                               # [.., R, m, s, s]
        dx.view(*lead, R, m, 2, s, K)[..., 1, :, :] += (dblock @ right.unsqueeze(-4)) * f_left
        dk.view(*lead, m, 2, s, K)[..., 0, :, :] += (dblock.transpose(-1, -2) @ left).sum(-4) * f_right
        s //= 2
    return dx, dk
