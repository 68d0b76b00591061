"""Chunked (WY / UT-transform) prefill in Triton, see docs/algorithm.md.

Every gate form: scalar log decay g [N, L, H], per-key gk [N, L, H, K], both
(lam = g + gk) or none; scalar beta (b is w, [N, L, H]) or channel-wise erase
b [N, L, H, K] and write w [N, L, H, V], or none.
Per chunk of BT = 64 tokens with cumulative log decay G (from the chunk start,
per key channel) and Γ_rs = exp(G_r - G_s) for r >= s:

    A = strict_lower(Σ_k (b ⊙ k)_r Γ_rs k_s)      M = lower(Σ_k q_r Γ_rs k_s)
    T = (I + A)^-1    Ũ = T (w ⊙ v)    Y = T (exp(G) ⊙ b ⊙ k)    U = Ũ - Y S0
    O = scale [(Q ⊙ exp(G)) S0 + M U]
    S_C = diag(exp(G_C)) S0 + (K ⊙ exp(G_C - G))^T U

Four named stages, each a kernel and a host function that launches it by keyword and
returns its outputs (`chunked` composes them; `chunked_ref.py` holds a torch twin of each,
`*_ref`, against which tests/test_triton_chunked.py tests every stage alone; a
`ChunkLayout` from `chunk_layout` says where the chunks lie, for all four). Float32
throughout. Chunk kernels run one program per (chunk,
state head): grid (NC, N * H) over packed [N, L] sequences, or, VARLEN, grid
(total chunks, H) over spans of the flat token axis with the chunk indices
(sequence, chunk) computed once on the host (`spans_tensors`), so sequences of
very different lengths cost no padding.

0. `chunk_cumsum` (`_cumsum_kernel`), per-key decay only: G = cumsum(gk + g) per chunk into a
   float64 scratch gc [tokens, H, K] (so other rows' G can be loaded). A scalar
   g alone is summed where it is used (`_scalar_log_decay`, 64 values).
1. `chunk_intra` (`_intra_kernel`), only for the delta rules: A (scalar decay: one product
   masked by the C x C decay matrix; per key: `_pairwise_per_key`), T by
   `_unit_lower_inverse` (16 x 16 diagonal blocks, then block merges),
   Ũ [tokens, H, V] and Y [tokens, H, K].
2. `chunk_state` (`_state_kernel`), grid (cdiv(V, BV), sequences * H): keeps the [K, BV]
   state tile in registers across the chunks of its sequence, stores each
   chunk's entering state h [chunks, H, K, V], turns Ũ into U in place,
   stores the final state. It reads the initial state from, and writes the
   final state to, row `idx[n]` (or n) of a state or slab with arbitrary
   strides (K-major or V-major, in place or not); a negative row is a padding
   sequence: no read, no write. Without retrieval U is v itself (T = I).
3. `chunk_output` (`_output_kernel`), grid (chunks, cdiv(V, BV), heads): O for the G query
   rows of the state head.

Numerical safety: no exponent is ever positive, and log decays are clamped at
LOG_DECAY_FLOOR (a -inf reset would give -inf - -inf = NaN in the differences
below; exp of the floor is 0 in float32 too). With scalar decay every
exponent is a difference G_r - G_s with r >= s, masked before `exp`. With
per-key decay (`_pairwise_per_key`) the chunk is cut into sub-chunks of
BC = 16 tokens: a block of rows r in sub-chunk i against columns s in an
earlier sub-chunk j meets through the reference n = last token of j
(s <= n < r), Γ_rs = exp(G_r - G_n) exp(G_n - G_s), both factors in [0, 1], so
the block is one product; the diagonal 16 x 16 blocks are formed element-wise
(one column offset of all four sub-chunks at a time). Tokens past L in the last
chunk are masked (identity steps). The cumulative sums G are float64 and only their
exponentials float32 (`_decay`): a float32 G loses the small decays after large ones
(strong decays or resets early in a chunk; 32 resets gave 6e-5 relative error in o).

The input preprocessing is fused in (`triton_common`), applied where the
operands are loaded: the raw-gate arm (A_log, dt_bias) in the cumsum kernel
(per key) or `_scalar_log_decay`, `beta_sigmoid` in the intra kernel,
`qk_l2norm` on every load of q and k rows (one row reduction each, no
normalised copy in memory).

Compute only: token-major operands as described in
`deltarule.backends._prepare` (`raw_operands`); q, k, v and the gates in their
input dtype (widened to float32 when loaded); no validation. The kernels write state, so none is autotuned.
Under `TRITON_INTERPRET=1` (set before this module is imported) they run on CPU
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..torch import chunked as chunked_torch
from .common import (dot, dot_dtype, gate_flags, l2norm_rows, load_state_tile, new_state, raw_log_decay,
                            state_strides, store_state_tile, update_gate)

CHUNK = 64
SUB = 16
LOG_DECAY_FLOOR = tl.constexpr(chunked_torch.LOG_DECAY_FLOOR)


@triton.jit
def _chunk_coords(i_c, i_x, seq, chunks, L, NC, H, VARLEN: tl.constexpr):
    """(sequence, head, chunk in the sequence, first token row, length, global chunk) of a
    chunk program: program axis 0 = i_c, the other = i_x. Packed [N, L] sequences: grid
    (NC, N * H). VARLEN: grid (total chunks, H); chunks [*, 2] = (sequence, chunk) and
    seq [N, 3] = (first token, length, first global chunk), computed once on the host."""
    if VARLEN:
        i_h = i_x
        i_n = tl.load(chunks + 2 * i_c).to(tl.int64)
        i_cs = tl.load(chunks + 2 * i_c + 1).to(tl.int64)
        bos = tl.load(seq + 3 * i_n).to(tl.int64)
        n_len = tl.load(seq + 3 * i_n + 1).to(tl.int64)
        i_cg = tl.load(seq + 3 * i_n + 2).to(tl.int64) + i_cs
    else:
        i_n = i_x // H
        i_h = i_x % H
        i_cs = i_c
        bos = i_n * L
        n_len = bos * 0 + L
        i_cg = i_n * NC + i_c
    return i_n, i_h, i_cs, bos, n_len, i_cg


@triton.jit
def _seq_coords(i_n, seq, L, NC, VARLEN: tl.constexpr):
    """(first token row, length, first global chunk) of sequence i_n."""
    if VARLEN:
        bos = tl.load(seq + 3 * i_n).to(tl.int64)
        n_len = tl.load(seq + 3 * i_n + 1).to(tl.int64)
        i_cg = tl.load(seq + 3 * i_n + 2).to(tl.int64)
    else:
        bos = i_n * L
        n_len = bos * 0 + L
        i_cg = i_n * NC
    return bos, n_len, i_cg


@triton.jit
def _scalar_log_decay(g, A, dtb, o_th, i_h, m_t, RAW: tl.constexpr):
    """[BT] scalar log decay of the chunk's rows (zero on masked rows), the raw-gate arm applied,
    clamped at LOG_DECAY_FLOOR."""
    b_g = tl.load(g + o_th, mask=m_t, other=0.0).to(tl.float32)
    if RAW:
        b_g = tl.where(m_t, raw_log_decay(b_g, tl.load(A + i_h).to(tl.float32), tl.load(dtb + i_h).to(tl.float32)), 0.0)
    return tl.maximum(b_g, LOG_DECAY_FLOOR, propagate_nan=tl.PropagateNan.ALL)   # a NaN gate stays NaN


@triton.jit
def _load_k(k, i_t, i_hk, Hk, K, o_k, m_tk, eps, L2NORM: tl.constexpr):
    """[rows, BK] float32 key rows (zero where masked), L2-normalised with `qk_l2norm`."""
    b_k = tl.load(k + (i_t * Hk + i_hk)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    return l2norm_rows(b_k, eps, L2NORM)


@triton.jit
def _decay(b_x):
    """exp of a float64 cumulative log decay (or a difference of two), in float32."""
    return tl.exp(b_x.to(tl.float32))


@triton.jit
def _pairwise_per_key(b_x, b_k, b_g, k, gc, bos, i_c, n_len, i_h, i_hk, H, Hk, K, eps,
                      STRICT: tl.constexpr, L2NORM: tl.constexpr, DT: tl.constexpr,
                      BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """P [BT, BT]: P_rs = Σ_k x_rk exp(G_rk - G_sk) k_sk for s < r (s <= r unless STRICT).

    b_x, b_k [BT, BK] float32, zero on masked rows; b_g [BT, BK] the chunk's G
    as stored in gc (float64, zero on masked rows). Rows and columns are the chunk's
    tokens. Off-diagonal sub-chunk blocks: one product per earlier sub-chunk j
    through its last valid token n; diagonal blocks element-wise, loading the
    column token's k (L2-normalised with L2NORM) and G from memory. Every
    exponent is <= 0.
    """
    o_r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_t = i_c * BT + o_r
    m_t = o_t < n_len
    i_sub = o_r // BC
    n_last = tl.minimum(n_len - i_c * BT, BT) - 1   # last valid row of the chunk
    b_p = tl.zeros([BT, BT], dtype=tl.float32)
    for j in tl.static_range(BT // BC - 1):
        n = tl.minimum(j * BC + BC - 1, n_last)     # reference: last valid token of sub-chunk j
        m_left = (i_sub > j) & m_t                  # rows after sub-chunk j (so after n)
        m_right = (i_sub == j) & m_t                # columns in sub-chunk j (at or before n)
        b_gn = tl.sum(tl.where((o_r == n)[:, None], b_g, 0.0), axis=0)
        b_left = tl.where(m_left[:, None], b_g - b_gn[None, :], 0.0)
        b_left = tl.where(m_left[:, None], b_x * _decay(b_left), 0.0)
        b_right = tl.where(m_right[:, None], b_gn[None, :] - b_g, 0.0)
        b_right = tl.where(m_right[:, None], b_k * _decay(b_right), 0.0)
        b_p += dot(b_left, tl.trans(b_right), DT)
    # diagonal blocks: step j takes column s(r) = (first row of r's sub-chunk) + j for every row r
    for j in range(BC):
        o_rs = i_sub * BC + j
        if STRICT:
            m_d = m_t & (o_rs < o_r)
        else:
            m_d = m_t & (o_rs <= o_r)
        i_ts = bos + i_c * BT + o_rs
        m_dk = m_d[:, None] & m_k[None, :]
        b_ks = _load_k(k, i_ts, i_hk, Hk, K, o_k, m_dk, eps, L2NORM)
        b_gs = tl.load(gc + (i_ts * H + i_h)[:, None] * K + o_k[None, :], mask=m_dk, other=0.0)
        b_e = _decay(tl.where(m_dk, b_g - b_gs, 0.0))
        b_col = tl.sum(b_x * b_e * b_ks, axis=1)
        b_p = tl.where((o_r[None, :] == o_rs[:, None]) & m_d[:, None], b_col[:, None], b_p)
    return b_p


@triton.jit
def _unit_lower_inverse(b_a, BT: tl.constexpr, BC: tl.constexpr, LEVELS: tl.constexpr):
    """(I + A)^-1 for A [BT, BT] strictly lower (zero elsewhere).

    First the BC x BC diagonal blocks, all at once by forward substitution
    (BC - 1 steps; the blocks have disjoint column supports, so one reduction
    serves the same row of every block), then merges that double the block
    size: with D the inverse of the block diagonal part and A_l the lower-left
    blocks of the next size, (I + A)^-1 restricted to it is D - D A_l D.
    """
    o_r = tl.arange(0, BT)
    i_sub = o_r // BC
    m_blk = i_sub[:, None] == i_sub[None, :]
    b_ad = tl.where(m_blk, b_a, 0.0)
    b_t = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0)
    for i in range(1, BC):
        m_i = (o_r % BC) == i
        b_ai = tl.sum(tl.where(m_i[:, None], b_ad, 0.0), axis=0)          # row i of every block, over j
        b_ti = tl.sum(b_ai[:, None] * b_t, axis=0)                        # (A T)_ic, c in that row's block
        b_t = tl.where(m_i[:, None] & m_blk, b_t - b_ti[None, :], b_t)
    for lvl in tl.static_range(LEVELS):        # blocks of s = BC << lvl merge into 2s
        m_l = ((o_r[:, None] // (BC << (lvl + 1))) == (o_r[None, :] // (BC << (lvl + 1)))) \
            & ((o_r[:, None] // (BC << lvl)) % 2 == 1) & ((o_r[None, :] // (BC << lvl)) % 2 == 0)
        b_al = tl.where(m_l, b_a, 0.0)
        b_t -= tl.dot(tl.dot(b_t, b_al, input_precision="ieee"), b_t, input_precision="ieee")
    return b_t


@triton.jit
def _cumsum_kernel(g, gk, A, dtb, gc, seq, chunks, L, NC, H, K,
                   VARLEN: tl.constexpr, HAS_G: tl.constexpr, RAW: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr):
    """gc [tokens, H, K] float64: per-key log decay gk (+ scalar g with HAS_G) summed from each
    chunk's start; RAW: gk is the raw projection (A [H], dtb [H, K])."""
    i_n, i_h, i_c, bos, n_len, i_cg = _chunk_coords(
        tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), seq, chunks, L, NC, H, VARLEN)
    o_t = i_c * BT + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_tk = (o_t < n_len)[:, None] & (o_k < K)[None, :]
    o_th = (bos + o_t) * H + i_h
    p = o_th[:, None] * K + o_k[None, :]
    b_l = tl.load(gk + p, mask=m_tk, other=0.0).to(tl.float32)
    if RAW:
        b_dtb = tl.load(dtb + i_h * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)
        b_l = tl.where(m_tk, raw_log_decay(b_l, tl.load(A + i_h).to(tl.float32), b_dtb[None, :]), 0.0)
    if HAS_G:
        b_l += tl.load(g + o_th, mask=o_t < n_len, other=0.0).to(tl.float32)[:, None]
    b_l = tl.maximum(b_l, LOG_DECAY_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    tl.store(gc + p, tl.cumsum(b_l.to(tl.float64), axis=0), mask=m_tk)


@triton.jit
def _intra_kernel(
    k, v, g, A, dtb, gc, b, w, u, y, seq, chunks,
    eps, L, NC, H, Hk, K, V,
    VARLEN: tl.constexpr, HAS_DECAY: tl.constexpr, DECAY_PER_KEY: tl.constexpr, RAW: tl.constexpr,
    ERASE_PER_KEY: tl.constexpr, WRITE_PER_VALUE: tl.constexpr, SIGMOID: tl.constexpr, L2NORM: tl.constexpr,
    DT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, LEVELS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """State-free part of chunk i_c of state head h of sequence n (delta rules).

    k [N, L, Hk, K], v [N, L, H, V], g [N, L, H] (scalar decay; RAW: with A,
    dtb), gc [N, L, H, K] (per key: G), b [N, L, H] or [N, L, H, K], w
    [N, L, H] or [N, L, H, V] (SIGMOID: their sigmoid); writes u [N, L, H, V] = T (w v) and
    y [N, L, H, K] = T (exp(G) b k), float32 (VARLEN: the token axis is the
    flat [B * T] one and sequences are spans of it).
    """
    i_n, i_h, i_c, bos, n_len, i_cg = _chunk_coords(
        tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), seq, chunks, L, NC, H, VARLEN)
    i_hk = i_h // (H // Hk)

    o_r = tl.arange(0, BT)
    o_t = i_c * BT + o_r
    m_t = o_t < n_len
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    i_t = bos + o_t                              # token rows in the [N * L] (VARLEN: [B * T]) token axis
    o_th = i_t * H + i_h                         # (token, state head) rows of v, u, y and the gates

    b_k = _load_k(k, i_t, i_hk, Hk, K, o_k, m_tk, eps, L2NORM)
    if ERASE_PER_KEY:
        b_kb = b_k * update_gate(tl.load(b + o_th[:, None] * K + o_k[None, :], mask=m_tk, other=0.0), SIGMOID)
    else:
        b_kb = b_k * update_gate(tl.load(b + o_th, mask=m_t, other=0.0), SIGMOID)[:, None]

    m_a = o_r[:, None] > o_r[None, :]
    if DECAY_PER_KEY:
        b_g = tl.load(gc + o_th[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_a = _pairwise_per_key(b_kb, b_k, b_g, k, gc, bos, i_c, n_len, i_h, i_hk, H, Hk, K, eps,
                                STRICT=True, L2NORM=L2NORM, DT=DT, BT=BT, BC=BC, BK=BK)
        b_kbe = b_kb * _decay(b_g)
    else:
        # A = (b k) K^T ⊙ Γ, strictly lower; the exponent is masked before exp
        b_a = dot(b_kb, tl.trans(b_k), DT)
        b_kbe = b_kb
        if HAS_DECAY:
            b_g = tl.cumsum(_scalar_log_decay(g, A, dtb, o_th, i_h, m_t, RAW).to(tl.float64), axis=0)
            b_a = b_a * _decay(tl.where(m_a, b_g[:, None] - b_g[None, :], 0.0))
            b_kbe = b_kb * _decay(b_g)[:, None]
        b_a = tl.where(m_a, b_a, 0.0)

    b_T = _unit_lower_inverse(b_a, BT=BT, BC=BC, LEVELS=LEVELS)

    # Y = T (exp(G) b k)
    tl.store(y + o_th[:, None] * K + o_k[None, :], dot(b_T, b_kbe, DT), mask=m_tk)

    # Ũ = T (w v), one value tile at a time
    if not WRITE_PER_VALUE:
        b_T = b_T * tl.where(m_t, update_gate(tl.load(w + o_th, mask=m_t, other=0.0), SIGMOID), 0.0)[None, :]
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + o_th[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        if WRITE_PER_VALUE:
            b_v = b_v * update_gate(tl.load(w + o_th[:, None] * V + o_v[None, :], mask=m_tv, other=0.0), SIGMOID)
        tl.store(u + o_th[:, None] * V + o_v[None, :], dot(b_T, b_v, DT), mask=m_tv)


@triton.jit
def _state_kernel(
    k, u, y, g, A, dtb, gc, S0, S, h, idx, seq,
    eps, L, NC, H, Hk, K, V,
    s0_n, s0_h, s0_k, s0_v, s_n, s_h, s_k, s_v,
    VARLEN: tl.constexpr, HAS_DECAY: tl.constexpr, DECAY_PER_KEY: tl.constexpr, RAW: tl.constexpr,
    HAS_ERASE: tl.constexpr, L2NORM: tl.constexpr, HAS_INIT: tl.constexpr, HAS_INDEX: tl.constexpr, DT: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """Chunk-to-chunk state passing for one [K, BV] state tile.

    u [N, L, H, V]: Ũ on entry (float32, rewritten in place as U) with
    retrieval, else v itself (input dtype, only read); y [N, L, H, K];
    g [N, L, H] (scalar decay; RAW: with A, dtb) or gc [N, L, H, K] (per
    key: G); k rows L2-normalised with L2NORM;
    S0 read once (zeros unless HAS_INIT), S written once at the end, both
    addressed by element strides (slot, head, key, value) at row idx[n] (HAS_INDEX; a negative
    row: nothing read or written) or n; they may be the same memory (each
    tile is read before the same program writes it); h [chunks, H, K, V]
    the state entering each chunk (global chunk order).
    """
    i_v = tl.program_id(0).to(tl.int64)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // H
    i_h = i_nh % H
    i_hk = i_h // (H // Hk)
    bos, n_len, i_cg = _seq_coords(i_n, seq, L, NC, VARLEN)

    o_r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    o_s = o_k[:, None] * V + o_v[None, :]

    i_row = i_n
    if HAS_INDEX:
        i_row = tl.load(idx + i_n).to(tl.int64)
    m_row = m_s & ((o_k * 0 + i_row) >= 0)[:, None]      # a padding row: no read, no write
    b_s = load_state_tile(S0, i_row, i_h, s0_n, s0_h, s0_k, s0_v, o_k, o_v, m_row, HAS_INIT, BK, BV)
    for i_c in range((n_len + BT - 1) // BT):
        tl.store(h + ((i_cg + i_c) * H + i_h) * K * V + o_s, b_s, mask=m_s)
        o_t = i_c * BT + o_r
        m_t = o_t < n_len
        i_t = bos + o_t
        o_th = i_t * H + i_h
        m_tv = m_t[:, None] & m_v[None, :]
        m_tk = m_t[:, None] & m_k[None, :]

        p_u = u + o_th[:, None] * V + o_v[None, :]
        b_u = tl.load(p_u, mask=m_tv, other=0.0).to(tl.float32)
        if HAS_ERASE:                            # U = Ũ - Y S
            b_y = tl.load(y + o_th[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_u = b_u - dot(b_y, b_s, DT)
            tl.store(p_u, b_u, mask=m_tv)

        b_k = _load_k(k, i_t, i_hk, Hk, K, o_k, m_tk, eps, L2NORM)
        if HAS_DECAY:
            if DECAY_PER_KEY:                    # G from the cumsum kernel's scratch: no scan here
                b_g = tl.load(gc + o_th[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
                i_last = bos + i_c * BT + tl.minimum(n_len - i_c * BT, BT) - 1
                b_gl = tl.load(gc + (i_last * H + i_h) * K + o_k, mask=m_k, other=0.0)   # G at the chunk's end
                b_k = b_k * _decay(tl.where(m_tk, b_gl[None, :] - b_g, 0.0))
                b_s = b_s * _decay(b_gl)[:, None]
            else:
                b_l = _scalar_log_decay(g, A, dtb, o_th, i_h, m_t, RAW)
                b_g = tl.cumsum(b_l.to(tl.float64), axis=0)
                # G at the chunk's end as the cumsum has it (not a separate sum: its rounding differs,
                # which a large |G| after a clamped reset would turn into a visible error)
                i_end = tl.minimum(n_len - i_c * BT, BT) - 1
                b_gl = tl.sum(tl.where(o_r == i_end, b_g, 0.0), axis=0)
                b_k = b_k * _decay(b_gl - b_g)[:, None]
                b_s = b_s * _decay(b_gl)
        b_s = b_s + dot(tl.trans(b_k), b_u, DT)

    store_state_tile(S, b_s, i_row, i_h, s_n, s_h, s_k, s_v, o_k, o_v, m_row)


@triton.jit
def _output_kernel(
    q, k, u, g, A, dtb, gc, h, o, seq, chunks,
    scale, eps, L, NC, H, Hq, Hk, K, V,
    G: tl.constexpr, VARLEN: tl.constexpr,
    HAS_DECAY: tl.constexpr, DECAY_PER_KEY: tl.constexpr, RAW: tl.constexpr, L2NORM: tl.constexpr,
    DT: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """O = scale [(Q ⊙ exp(G)) S_in + M U] for one chunk and value tile.

    q [N, L, Hq, G, K] and k rows L2-normalised with L2NORM; u [N, L, H, V]
    (U, or v without retrieval); g [N, L, H] (scalar decay; RAW: with A,
    dtb) or gc [N, L, H, K] (per key: G);
    h [chunks, H, K, V]; o [N, L, H, G, V] float32.
    """
    i_v = tl.program_id(1).to(tl.int64)
    i_n, i_h, i_c, bos, n_len, i_cg = _chunk_coords(
        tl.program_id(0).to(tl.int64), tl.program_id(2).to(tl.int64), seq, chunks, L, NC, H, VARLEN)
    i_hq = i_h // (H // Hq)
    i_hk = i_h // (H // Hk)

    o_r = tl.arange(0, BT)
    o_t = i_c * BT + o_r
    m_t = o_t < n_len
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_tk = m_t[:, None] & m_k[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    i_t = bos + o_t
    o_th = i_t * H + i_h

    b_k = _load_k(k, i_t, i_hk, Hk, K, o_k, m_tk, eps, L2NORM)
    b_u = tl.load(u + o_th[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
    b_s = tl.load(h + (i_cg * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    m_m = o_r[:, None] >= o_r[None, :]
    if DECAY_PER_KEY:
        b_g = tl.load(gc + o_th[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_e = _decay(b_g)
    else:
        b_e = tl.full([BT], 1.0, dtype=tl.float32)
        b_gam = tl.where(m_m, 1.0, 0.0)
        if HAS_DECAY:
            b_g = tl.cumsum(_scalar_log_decay(g, A, dtb, o_th, i_h, m_t, RAW).to(tl.float64), axis=0)
            b_e = _decay(b_g)
            b_gam = tl.where(m_m, _decay(tl.where(m_m, b_g[:, None] - b_g[None, :], 0.0)), 0.0)

    for i_g in tl.static_range(G):
        p_q = q + ((i_t * Hq + i_hq) * G + i_g)[:, None] * K + o_k[None, :]
        b_q = l2norm_rows(tl.load(p_q, mask=m_tk, other=0.0).to(tl.float32), eps, L2NORM)
        if DECAY_PER_KEY:
            b_m = _pairwise_per_key(b_q, b_k, b_g, k, gc, bos, i_c, n_len, i_h, i_hk, H, Hk, K, eps,
                                    STRICT=False, L2NORM=L2NORM, DT=DT, BT=BT, BC=BC, BK=BK)
            b_o = dot(b_q * b_e, b_s, DT)
        else:
            b_m = dot(b_q, tl.trans(b_k), DT) * b_gam
            b_o = dot(b_q * b_e[:, None], b_s, DT)
        b_o = scale * (b_o + dot(b_m, b_u, DT))
        p_o = o + (o_th * G + i_g)[:, None] * V + o_v[None, :]
        tl.store(p_o, b_o, mask=m_tv)


def spans_tensors(spans, BT: int, device):
    """Host-side, once per call: seq [N, 3] = (first token, length, first global chunk) and
    chunks [total, 2] = (sequence, chunk), int64 on `device`, for spans [(first token, length)]."""
    seq, chunks, first = [], [], 0
    for n, (bos, length) in enumerate(spans):
        nc = -(-length // BT)
        seq.append((bos, length, first))
        chunks += [(n, c) for c in range(nc)]
        first += nc
    as_t = lambda x, w: torch.tensor(x, dtype=torch.int64).reshape(-1, w).to(device)  # noqa: E731
    return as_t(seq, 3), as_t(chunks, 2), first


@dataclass(frozen=True)
class ChunkLayout:
    """Where a call's chunks lie, host-side, shared by every stage.

    Packed ([N, L] rows are the sequences): seq = chunks = None, NC chunks per row, grids
    (NC, N * H). VARLEN (`spans`: (first token, length) per sequence in the flat [N * L] token
    axis): seq [sequences, 3] and chunks [n_chunks, 2] (`spans_tensors`), grids (n_chunks, H).
    `n_seq` sequences, `n_chunks` chunks in all (the global chunk order of h), BT tokens each."""

    N: int
    L: int
    H: int
    n_seq: int
    n_chunks: int
    NC: int
    seq: torch.Tensor | None
    chunks: torch.Tensor | None
    covered: bool                 # every token belongs to a sequence (else o starts zeroed)
    BT: int = CHUNK
    BC: int = SUB

    @property
    def varlen(self) -> bool:
        return self.seq is not None

    @property
    def chunk_grid(self) -> tuple[int, int]:
        """(chunk axis, head axis) of the per-chunk stages."""
        return (self.n_chunks, self.H) if self.varlen else (self.NC, self.N * self.H)


def chunk_layout(N: int, L: int, H: int, spans, device) -> ChunkLayout:
    """The `ChunkLayout` of [N, L] rows (spans None) or of `spans` in their flat token axis."""
    if spans is None:
        NC = triton.cdiv(L, CHUNK)
        return ChunkLayout(N=N, L=L, H=H, n_seq=N, n_chunks=N * NC, NC=NC, seq=None, chunks=None, covered=True)
    seq, chunks, n_chunks = spans_tensors(spans, CHUNK, device)
    covered = sum(length for _, length in spans) == N * L
    # NC is unused with spans: every chunk program reads its coordinates
    return ChunkLayout(N=N, L=L, H=H, n_seq=len(spans), n_chunks=n_chunks, NC=0, seq=seq, chunks=chunks,
                       covered=covered)


def _tiles(K: int, V: int) -> tuple[int, int]:
    """(BK, BV): the whole key axis, value tiles of up to 64."""
    return max(16, triton.next_power_of_2(K)), min(64, max(16, triton.next_power_of_2(V)))


def chunk_cumsum(g, gk, A_log, dt_bias, lay: ChunkLayout) -> torch.Tensor:
    """Stage 0, per-key decay: gc [N, L, H, K] float64, the log decay gk (the raw-gate arm applied
    with A_log [H] / dt_bias [H, K]; + g [N, L, H] when given) clamped at LOG_DECAY_FLOOR and
    summed from each chunk's start. Rows outside every span are not written."""
    gc = torch.empty(gk.shape, dtype=torch.float64, device=gk.device)
    if lay.n_chunks == 0:
        return gc
    K = gk.shape[3]
    _cumsum_kernel[lay.chunk_grid](
        g=g, gk=gk, A=A_log, dtb=dt_bias, gc=gc, seq=lay.seq, chunks=lay.chunks, L=lay.L, NC=lay.NC, H=lay.H, K=K,
        VARLEN=lay.varlen, HAS_G=g is not None, RAW=A_log is not None, BT=lay.BT, BK=_tiles(K, 1)[0])
    return gc


def chunk_intra(k, v, g, A_log, dt_bias, gc, b, w, lay: ChunkLayout, *, beta_sigmoid: bool = False,
                l2norm_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1, the delta rules: per chunk A = strict_lower((b ⊙ k) Γ k^T), T = (I + A)^-1 and
    (Ũ [N, L, H, V], Y [N, L, H, K]) = (T (w ⊙ v), T (exp(G) ⊙ b ⊙ k)), float32. k [N, L, Hk, K],
    v [N, L, H, V], g [N, L, H] (scalar decay) or gc (`chunk_cumsum`: per key), b [N, L, H] or
    [N, L, H, K], w [N, L, H] or [N, L, H, V] (their sigmoid with `beta_sigmoid`); k rows
    L2-normalised with `l2norm_eps`."""
    N, L, H, V = v.shape
    Hk, K = k.shape[2], k.shape[3]
    u = torch.empty(N, L, H, V, dtype=torch.float32, device=v.device)
    y = torch.empty(N, L, H, K, dtype=torch.float32, device=v.device)
    if lay.n_chunks == 0:
        return u, y
    BK, BV = _tiles(K, V)
    flags = gate_flags(g, gc, b, w, A_log)
    _intra_kernel[lay.chunk_grid](
        k=k, v=v, g=g, A=A_log, dtb=dt_bias, gc=gc, b=b, w=w, u=u, y=y, seq=lay.seq, chunks=lay.chunks,
        eps=float(l2norm_eps or 0.0), L=L, NC=lay.NC, H=H, Hk=Hk, K=K, V=V,
        VARLEN=lay.varlen, HAS_DECAY=flags["HAS_G"] or flags["HAS_GK"], DECAY_PER_KEY=flags["HAS_GK"],
        RAW=flags["RAW"], ERASE_PER_KEY=flags["ERASE_PER_KEY"], WRITE_PER_VALUE=flags["WRITE_PER_VALUE"],
        SIGMOID=beta_sigmoid, L2NORM=l2norm_eps is not None, DT=dot_dtype(k),
        BT=lay.BT, BC=lay.BC, LEVELS=(lay.BT // lay.BC).bit_length() - 1, BK=BK, BV=BV)
    return u, y


def chunk_state(k, u, y, g, A_log, dt_bias, gc, S0, S, lay: ChunkLayout, *, l2norm_eps: float | None = None,
                state_indices=None, state_layout: str = "kv") -> torch.Tensor:
    """Stage 2, chunk to chunk: returns h [n_chunks, H, K, V] float32, the state entering each
    chunk (global chunk order); with y (the delta rules) rewrites u from Ũ to U = Ũ - Y S in
    place (without, u is v itself and only read); writes each sequence's final state into S.
    S0 None (zeros) or [*, H, K, V] ("kv") / [*, H, V, K] ("vk"), any strides, read at row
    state_indices[n] (or n; negative: padding, neither read nor written); S likewise written
    (it may be S0 itself: each tile is read before the same program writes it). Decays as
    `chunk_intra`'s."""
    H, V = u.shape[2], u.shape[3]
    Hk, K = k.shape[2], k.shape[3]
    h = torch.empty(max(lay.n_chunks, 1), H, K, V, dtype=torch.float32, device=u.device)
    if lay.n_seq * H == 0:
        return h
    idx = None if state_indices is None else state_indices.to(device=u.device, dtype=torch.int64).contiguous()
    BK, BV = _tiles(K, V)
    s0_n, s0_h, s0_k, s0_v = state_strides(S0, state_layout)
    s_n, s_h, s_k, s_v = state_strides(S, state_layout)
    _state_kernel[(triton.cdiv(V, BV), lay.n_seq * H)](
        k=k, u=u, y=y, g=g, A=A_log, dtb=dt_bias, gc=gc, S0=S0, S=S, h=h, idx=idx, seq=lay.seq,
        eps=float(l2norm_eps or 0.0), L=lay.L, NC=lay.NC, H=H, Hk=Hk, K=K, V=V,
        s0_n=s0_n, s0_h=s0_h, s0_k=s0_k, s0_v=s0_v, s_n=s_n, s_h=s_h, s_k=s_k, s_v=s_v,
        VARLEN=lay.varlen, HAS_DECAY=g is not None or gc is not None, DECAY_PER_KEY=gc is not None,
        RAW=A_log is not None, HAS_ERASE=y is not None, L2NORM=l2norm_eps is not None,
        HAS_INIT=S0 is not None, HAS_INDEX=idx is not None, DT=dot_dtype(k), BT=lay.BT, BK=BK, BV=BV)
    return h


def chunk_output(q, k, u, g, A_log, dt_bias, gc, h, lay: ChunkLayout, *, scale: float,
                 l2norm_eps: float | None = None) -> torch.Tensor:
    """Stage 3: o [N, L, H, G, V] float32, O = scale [(Q ⊙ exp(G)) h + M U] per chunk with
    M = lower(Q Γ K^T); q [N, L, Hq, G, K], u the U of `chunk_state` (or v without retrieval),
    h its states; rows outside every span are zero. Decays as `chunk_intra`'s."""
    N, L, H, V = u.shape
    Hq, G, K = q.shape[2], q.shape[3], q.shape[4]
    o = (torch.empty if lay.covered else torch.zeros)(N, L, H, G, V, dtype=torch.float32, device=u.device)
    if lay.n_chunks == 0 or lay.n_seq * H == 0:
        return o
    BK, BV = _tiles(K, V)
    grid_c, grid_h = lay.chunk_grid
    _output_kernel[(grid_c, triton.cdiv(V, BV), grid_h)](
        q=q, k=k, u=u, g=g, A=A_log, dtb=dt_bias, gc=gc, h=h, o=o, seq=lay.seq, chunks=lay.chunks,
        scale=float(scale), eps=float(l2norm_eps or 0.0), L=L, NC=lay.NC, H=H, Hq=Hq, Hk=k.shape[2], K=K, V=V,
        G=G, VARLEN=lay.varlen, HAS_DECAY=g is not None or gc is not None, DECAY_PER_KEY=gc is not None,
        RAW=A_log is not None, L2NORM=l2norm_eps is not None, DT=dot_dtype(k),
        BT=lay.BT, BC=lay.BC, BK=BK, BV=BV)
    return o


def chunked(q, k, v, g, gk, b, w, S0, scale: float, S=None, *, A_log=None, dt_bias=None,
            beta_sigmoid: bool = False, l2norm_eps: float | None = None,
            state_indices=None, state_layout: str = "kv", spans=None):
    """Chunked prefill, the stages in turn; returns (o, S), o float32.

    q [N, L, Hq, G, K], k [N, L, Hk, K], v [N, L, H, V] (Hq, Hk divide H);
    g None or [N, L, H], gk None or [N, L, H, K] (log decays, summed when
    both are given); b None, [N, L, H] (scalar beta: w is b, or an equal
    tensor) or [N, L, H, K] (erase, with w [N, L, H, V] the write gate); all
    in their input dtype. Fused into the kernels: `A_log` [H] with `dt_bias`
    ([H] beside g, [H, K] beside gk; only one of g and gk then) make the
    decay -exp(A_log) * softplus(gate + dt_bias); `beta_sigmoid` takes the
    sigmoid of b and w; `l2norm_eps` (not None) L2-normalises q and k rows
    with that epsilon. S0 None (zeros) or float32 [N, H, K, V] ("kv") /
    [N, H, V, K] ("vk"), any strides. o is [N, L, H, G, V].

    `spans` (varlen, no packing): a host list of (first token, length) in the
    flat [N * L] token axis of the operands, one per sequence, disjoint; the
    sequence count is len(spans), chunk indices are computed once here, and
    o [N, L, H, G, V] holds each span's outputs in place (zeros elsewhere).

    `S` is the output state buffer, same layout as S0 (default a new
    contiguous tensor; S0 itself updates the states in place: each state
    tile is read before it is written, by the same program). With
    `state_indices` [sequences] (int), S0 is a slab: sequence n reads row
    state_indices[n] and, unless `S` is given, writes that row in place
    (negative: padding, the slab row is neither read nor written; its
    output is computed from a zero state and is the caller's to discard).
    """
    if (g is not None and g.dim() != 3) or (gk is not None and gk.dim() != 4) or (b is None) != (w is None) \
            or (b is not None and (b.dim() not in (3, 4) or (b.dim() == 3) != (w.dim() == 3))) \
            or (A_log is not None and (g is None) == (gk is None)):
        raise ValueError("triton chunked: g [N,L,H], gk [N,L,H,K] (one of them with A_log); b, w both "
                         "scalar [N,L,H] or erase [N,L,H,K] with write [N,L,H,V]")
    N, L, H, V = v.shape
    K = k.shape[3]
    contig = lambda x: None if x is None else x.contiguous()  # noqa: E731
    q, k, v, g, gk, b, w, A_log, dt_bias = map(contig, (q, k, v, g, gk, b, w, A_log, dt_bias))
    lay = chunk_layout(N, L, H, spans, v.device)
    if S is None:
        S = new_state(S0, state_indices, lay.n_seq, H, K, V, state_layout, v.device)
    if lay.n_seq * H == 0:
        return (torch.empty if lay.covered else torch.zeros)(N, L, H, q.shape[3], V, dtype=torch.float32,
                                                             device=v.device), S
    # per-key decay: G from its own stage (allocated even without chunks: the state kernel takes a pointer)
    gc = None if gk is None else chunk_cumsum(g, gk, A_log, dt_bias, lay)
    g_scalar = None if gk is not None else g          # with gk, g is summed into gc
    u, y = v, None
    if b is not None and lay.n_chunks > 0:
        u, y = chunk_intra(k, v, g_scalar, A_log, dt_bias, gc, b, w, lay, beta_sigmoid=beta_sigmoid,
                           l2norm_eps=l2norm_eps)
    h = chunk_state(k, u, y, g_scalar, A_log, dt_bias, gc, S0, S, lay, l2norm_eps=l2norm_eps,
                    state_indices=state_indices, state_layout=state_layout)
    o = chunk_output(q, k, u, g_scalar, A_log, dt_bias, gc, h, lay, scale=scale, l2norm_eps=l2norm_eps)
    return o, S
