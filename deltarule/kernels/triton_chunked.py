"""Chunked (WY / UT-transform) prefill in Triton, scalar gates, see ../shared/ALGORITHM.md.

Scalar log decay lam [N, L, H] (or none) and scalar beta (b is w, or none).
Per chunk of BT tokens with cumulative log decay G (from the chunk start) and
Γ_rs = exp(G_r - G_s) for r >= s:

    A = strict_lower(diag(β) (K K^T) ⊙ Γ)    T = (I + A)^-1
    Ũ = T (β V)    Y = T (β exp(G) K)        U = Ũ - Y S0
    O = scale [(Q exp(G)) S0 + (lower(Q K^T) ⊙ Γ) U]
    S_C = exp(G_C) S0 + (K exp(G_C - G))^T U

Three kernels, float32 throughout:

1. `_intra_kernel`, grid (NC, N * H), only for the delta rules: A, T by
   forward substitution in registers, Ũ [N, L, H, V] and Y [N, L, H, K].
2. `_state_kernel`, grid (cdiv(V, BV), N * H): keeps the [K, BV] state tile in
   registers across the chunks, stores each chunk's entering state
   [N, H, NC, K, V], turns Ũ into U in place, stores the final state.
   Without retrieval U is v itself (T = I, w absent).
3. `_output_kernel`, grid (NC, cdiv(V, BV), N * H): O for the G query rows of
   the state head.

Every exponent is a difference G_r - G_s with r >= s, masked before `exp`.
Tokens past L in the last chunk are masked (loaded as zeros: identity steps).

Compute only: token-major operands as described in
`deltarule.backends._prepare`; q, k, v in their input dtype (widened to float32
when loaded); no validation. The kernels write state, so none is autotuned.
Under `TRITON_INTERPRET=1` (set before this module is imported) they run on CPU
tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64


@triton.jit
def _intra_kernel(
    k, v, lam, b, u, y,
    L, H, Hk, K, V,
    HAS_DECAY: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """State-free part of chunk i_c of state head h of sequence n (delta rules).

    k [N, L, Hk, K], v [N, L, H, V], lam [N, L, H], b [N, L, H] (beta, also
    the write gate); writes u [N, L, H, V] = T (β v) and
    y [N, L, H, K] = T (β exp(G) k), float32.
    """
    i_c = tl.program_id(0).to(tl.int64)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // H
    i_h = i_nh % H
    i_hk = i_h // (H // Hk)

    o_r = tl.arange(0, BT)
    o_t = i_c * BT + o_r
    m_t = o_t < L
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    i_t = i_n * L + o_t                          # token rows in the [N * L] token axis
    o_th = i_t * H + i_h                         # (token, state head) rows of v, u, y and the gates

    p_k = k + (i_t * Hk + i_hk)[:, None] * K + o_k[None, :]
    b_k = tl.load(p_k, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    b_beta = tl.load(b + o_th, mask=m_t, other=0.0).to(tl.float32)
    b_g = tl.zeros([BT], dtype=tl.float32)
    if HAS_DECAY:
        b_g = tl.cumsum(tl.load(lam + o_th, mask=m_t, other=0.0).to(tl.float32), axis=0)

    # A = diag(β) (K K^T) ⊙ Γ, strictly lower; the exponent is masked before exp
    m_a = o_r[:, None] > o_r[None, :]
    b_a = tl.dot(b_k, tl.trans(b_k), input_precision="ieee")
    b_a = b_a * b_beta[:, None]
    if HAS_DECAY:
        b_a = b_a * tl.exp(tl.where(m_a, b_g[:, None] - b_g[None, :], 0.0))
    b_a = tl.where(m_a, b_a, 0.0)

    # T = (I + A)^-1 by forward substitution: T_i = e_i - sum_{j<i} A_ij T_j
    b_T = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0)
    for i in range(1, BT):
        m_i = o_r == i
        b_ai = tl.sum(tl.where(m_i[:, None], b_a, 0.0), axis=0)          # row i of A, over j
        b_ti = tl.sum(b_ai[:, None] * b_T, axis=0)                        # sum_j A_ij T_j
        b_T = tl.where(m_i[:, None], b_T - b_ti[None, :], b_T)

    # Y = T (β exp(G) k)
    b_kb = b_k * (b_beta * tl.exp(b_g))[:, None]
    b_y = tl.dot(b_T, b_kb, input_precision="ieee")
    p_y = y + o_th[:, None] * K + o_k[None, :]
    tl.store(p_y, b_y, mask=m_t[:, None] & m_k[None, :])

    # Ũ = T (β v), one value tile at a time
    b_Tb = b_T * b_beta[None, :]
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + o_th[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_u = tl.dot(b_Tb, b_v, input_precision="ieee")
        tl.store(u + o_th[:, None] * V + o_v[None, :], b_u, mask=m_tv)


@triton.jit
def _state_kernel(
    k, u, y, lam, S0, S, h,
    L, NC, H, Hk, K, V,
    HAS_DECAY: tl.constexpr, HAS_ERASE: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """Chunk-to-chunk state passing for one [K, BV] state tile.

    u [N, L, H, V]: Ũ on entry (float32, rewritten in place as U) with
    retrieval, else v itself (input dtype, only read); y [N, L, H, K];
    S0 [N, H, K, V] read once; h [N, H, NC, K, V] the state entering each
    chunk; S [N, H, K, V] written once at the end.
    """
    i_v = tl.program_id(0).to(tl.int64)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // H
    i_h = i_nh % H
    i_hk = i_h // (H // Hk)

    o_r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    o_s = o_k[:, None] * V + o_v[None, :]

    b_s = tl.load(S0 + i_nh * K * V + o_s, mask=m_s, other=0.0).to(tl.float32)
    for i_c in range(NC):
        tl.store(h + (i_nh * NC + i_c) * K * V + o_s, b_s, mask=m_s)
        o_t = i_c * BT + o_r
        m_t = o_t < L
        i_t = i_n * L + o_t
        o_th = i_t * H + i_h
        m_tv = m_t[:, None] & m_v[None, :]
        m_tk = m_t[:, None] & m_k[None, :]

        p_u = u + o_th[:, None] * V + o_v[None, :]
        b_u = tl.load(p_u, mask=m_tv, other=0.0).to(tl.float32)
        if HAS_ERASE:                            # U = Ũ - Y S
            b_y = tl.load(y + o_th[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_u = b_u - tl.dot(b_y, b_s, input_precision="ieee")
            tl.store(p_u, b_u, mask=m_tv)

        b_k = tl.load(k + (i_t * Hk + i_hk)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        if HAS_DECAY:
            b_l = tl.load(lam + o_th, mask=m_t, other=0.0).to(tl.float32)
            b_g = tl.cumsum(b_l, axis=0)
            b_gl = tl.sum(b_l, axis=0)           # G at the chunk's end (masked tokens add 0)
            b_k = b_k * tl.exp(b_gl - b_g)[:, None]
            b_s = b_s * tl.exp(b_gl)
        b_s = b_s + tl.dot(tl.trans(b_k), b_u, input_precision="ieee")

    tl.store(S + i_nh * K * V + o_s, b_s, mask=m_s)


@triton.jit
def _output_kernel(
    q, k, u, lam, h, o,
    scale, L, NC, H, Hq, Hk, K, V,
    G: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """O = scale [(Q exp(G)) S_in + (lower(Q K^T) ⊙ Γ) U] for one chunk and value tile.

    q [N, L, Hq, G, K]; u [N, L, H, V] (U, or v without retrieval);
    h [N, H, NC, K, V]; o [N, L, H, G, V] float32.
    """
    i_c = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1).to(tl.int64)
    i_nh = tl.program_id(2).to(tl.int64)
    i_n = i_nh // H
    i_h = i_nh % H
    i_hq = i_h // (H // Hq)
    i_hk = i_h // (H // Hk)

    o_r = tl.arange(0, BT)
    o_t = i_c * BT + o_r
    m_t = o_t < L
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    i_t = i_n * L + o_t
    o_th = i_t * H + i_h

    b_k = tl.load(k + (i_t * Hk + i_hk)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    b_u = tl.load(u + o_th[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
    b_s = tl.load(h + (i_nh * NC + i_c) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    m_m = o_r[:, None] >= o_r[None, :]
    b_e = tl.full([BT], 1.0, dtype=tl.float32)
    b_gam = tl.where(m_m, 1.0, 0.0)
    if HAS_DECAY:
        b_g = tl.cumsum(tl.load(lam + o_th, mask=m_t, other=0.0).to(tl.float32), axis=0)
        b_e = tl.exp(b_g)
        b_gam = tl.where(m_m, tl.exp(tl.where(m_m, b_g[:, None] - b_g[None, :], 0.0)), 0.0)

    for g in tl.static_range(G):
        p_q = q + ((i_t * Hq + i_hq) * G + g)[:, None] * K + o_k[None, :]
        b_q = tl.load(p_q, mask=m_tk, other=0.0).to(tl.float32)
        b_m = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * b_gam
        b_o = tl.dot(b_q * b_e[:, None], b_s, input_precision="ieee")
        b_o = scale * (b_o + tl.dot(b_m, b_u, input_precision="ieee"))
        p_o = o + (o_th * G + g)[:, None] * V + o_v[None, :]
        tl.store(p_o, b_o, mask=m_tv)


def chunked(q, k, v, lam, b, w, S0, scale: float, S=None):
    """Chunked prefill; returns (o [N, L, H, G, V], S [N, H, K, V]), float32.

    q [N, L, Hq, G, K], k [N, L, Hk, K], v [N, L, H, V] (Hq, Hk divide H);
    lam None or [N, L, H] (scalar log decay); b None or [N, L, H] (scalar
    beta; w must then be b, or an equal tensor); S0 [N, H, K, V] float32.
    `S` is the contiguous output state buffer (default a new tensor; S0
    itself updates the states in place: each state tile is read before it is
    written, by the same program). Per-key decay and channel-wise gates are
    not handled here (see `backends.triton_chunked_support`).
    """
    if (lam is not None and lam.dim() != 3) or (b is not None and b.dim() != 3) \
            or (w is not None and w.dim() != 3) or ((b is None) != (w is None)):
        raise ValueError("triton chunked: scalar decay and scalar beta only")
    N, L, H, V = v.shape
    Hq, G, K = q.shape[2], q.shape[3], q.shape[4]
    Hk = k.shape[2]
    contig = lambda x: None if x is None else x.contiguous()  # noqa: E731
    q, k, v, lam, b = map(contig, (q, k, v, lam, b))
    S0 = S0.contiguous()
    if S is None:
        S = torch.empty_like(S0)
    o = torch.empty(N, L, H, G, V, dtype=torch.float32, device=v.device)
    if N * H == 0:
        return o, S
    BT = CHUNK
    NC = triton.cdiv(L, BT)
    BK = max(16, triton.next_power_of_2(K))
    BV = min(64, max(16, triton.next_power_of_2(V)))
    NV = triton.cdiv(V, BV)
    has_decay = lam is not None
    has_erase = b is not None
    u, y = v, None
    if has_erase and NC > 0:
        u = torch.empty(N, L, H, V, dtype=torch.float32, device=v.device)
        y = torch.empty(N, L, H, K, dtype=torch.float32, device=v.device)
        _intra_kernel[(NC, N * H)](
            k, v, lam, b, u, y,
            L, H, Hk, K, V,
            HAS_DECAY=has_decay, BT=BT, BK=BK, BV=BV,
        )
    h = torch.empty(N, H, max(NC, 1), K, V, dtype=torch.float32, device=v.device)
    _state_kernel[(NV, N * H)](
        k, u, y, lam, S0, S, h,
        L, NC, H, Hk, K, V,
        HAS_DECAY=has_decay, HAS_ERASE=has_erase and NC > 0,
        BT=BT, BK=BK, BV=BV,
    )
    if NC > 0:
        _output_kernel[(NC, NV, N * H)](
            q, k, u, lam, h, o,
            float(scale), L, NC, H, Hq, Hk, K, V,
            G=G, HAS_DECAY=has_decay, BT=BT, BK=BK, BV=BV,
        )
    return o, S
