"""Fused token-by-token recurrence in Triton: decode and short sequences.

One program per (value tile, sequence, state head): grid
(cdiv(V, BV), N * H). The program keeps its [K, BV] float32 state tile in
registers across the L tokens of its sequence. Per token it reads the old
state once for both the retrieval and the output (docs/algorithm.md, "Decode"):

    r = S'^T (b k),  p = S'^T q   with S' = D S, D = diag(exp(g + gk))
    u = w v - r,     o = scale (p + (k . q) u),   S = S' + k u^T

and stores the state once at the end. Columns of the state are independent,
so value tiles need no communication.

Compact transition capture (`capture`): the factors of each sequence's first
C transitions, S_t = diag(d) S_{t-1} + k u^T, are written as they are formed
into the sequence's capture row (struct of arrays, ONNX Runtime's
`state_update` layout: C decays, then C keys, then C deltas). Each value tile
writes its columns of u; the decay and the key are the same in every value
tile (and the key in every state head of a key head's group), so only value
tile 0 writes the decay, and only its first state head of each group the key:
each element has one writer.

The state is read from, and written to, wherever it lies: any strides (a
K-major or V-major state, float32, bfloat16 or float16 storage; float32 in
registers), optionally at slab rows `state_indices[n]` (a negative index is
padding: that row is never touched), in place. Speculative decoding
(`token_rows`): the state after token t is stored into row token_rows[n, t]
as soon as it is formed, and no final state is stored; the read at the start
precedes every store of the program, so a sequence may rewrite its read row.

The input preprocessing is fused in (`triton_common`): the raw-gate arm
(A_log, dt_bias), `beta_sigmoid` and `qk_l2norm` are applied to each token's
gates and q / k rows as they are loaded, so a decode step is one launch.

Compute only: token-major operands as described in
`deltarule.backends._prepare` (`raw_operands`), in their input dtype; absent
gates are None; no validation. The kernel writes its state, so it is never
autotuned. Under `TRITON_INTERPRET=1`
(set before this module is imported) it runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (gate_flags, l2norm_vector, load_state_tile, new_state, raw_log_decay, state_strides,
                            store_state_tile, update_gate)


@triton.jit
def _recurrent_kernel(
    q, k, v, g, gk, A, dtb, b, w, S0, S, o, idx, tok, seq, cap,
    scale, eps, L, H, Hq, Hk, K, V, W, C, c_n, c_key, c_delta,
    s0_n, s0_h, s0_k, s0_v, s_n, s_h, s_k, s_v,
    G: tl.constexpr, VARLEN: tl.constexpr, HAS_INIT: tl.constexpr, HAS_INDEX: tl.constexpr,
    TOKEN_ROWS: tl.constexpr, HAS_CAPTURE: tl.constexpr,
    HAS_G: tl.constexpr, HAS_GK: tl.constexpr, RAW: tl.constexpr,
    HAS_ERASE: tl.constexpr, ERASE_PER_KEY: tl.constexpr,
    HAS_WRITE: tl.constexpr, WRITE_PER_VALUE: tl.constexpr,
    SIGMOID: tl.constexpr, L2NORM: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    """L steps of one [K, BV] state tile of state head h of sequence n.

    q [N, L, Hq, G, K], k [N, L, Hk, K], v [N, L, H, V] (Hq, Hk divide H);
    g [N, L, H] and gk [N, L, H, K] log decays (RAW: the one given is the raw
    projection, with A [H] and dtb [H] or [H, K]); b [N, L, H] or [N, L, H, K];
    w [N, L, H] or [N, L, H, V] (SIGMOID: their sigmoid is taken); L2NORM: q
    and k rows are L2-normalised as they are loaded; o [N, L, H, G, V]. The
    state is read once at the start from S0 (zeros unless HAS_INIT) and
    written once at the end to S, both addressed by element strides (slot,
    head, key, value), so K-major and V-major states alike, at row idx[n]
    (HAS_INDEX: a slab; a negative row is a padding sequence: nothing read
    or written) or n. TOKEN_ROWS: instead of the final store, the state after
    token t is stored at row tok[n * W + t] (negative: not stored). S may be
    S0 itself (in place: each program reads its own tile before it stores
    it). VARLEN: sequence n is the span seq[n, 0] .. + seq[n, 1] of the flat
    token axis (no packing), its capture row seq[n, 2]; else tokens n * L .. + L,
    capture row n. HAS_CAPTURE: the first min(C, length) transitions of a live
    sequence go to its row of cap (row stride c_n, float32): decays exp(lam)
    [C, Dw] at 0 (Dw = H * K with HAS_GK, else H), keys [C, Hk, K] at c_key,
    deltas u [C, H, V] at c_delta; nothing else of cap is written.
    """
    i_v = tl.program_id(0).to(tl.int64)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // H
    i_h = i_nh % H
    i_hq = i_h // (H // Hq)
    i_hk = i_h // (H // Hk)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]

    i_row = i_n
    if HAS_INDEX:
        i_row = tl.load(idx + i_n).to(tl.int64)
    m_row = m_s & ((o_k * 0 + i_row) >= 0)[:, None]      # a padding row: no read, no write
    b_s = load_state_tile(S0, i_row, i_h, s0_n, s0_h, s0_k, s0_v, o_k, o_v, m_row, HAS_INIT, BK, BV)
    if RAW:                                               # per head, loaded once
        b_a = tl.load(A + i_h).to(tl.float32)
        if HAS_GK:
            b_dtb = tl.load(dtb + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        else:
            b_dtb = tl.load(dtb + i_h).to(tl.float32)

    if VARLEN:
        bos = tl.load(seq + 3 * i_n).to(tl.int64)
        n_len = tl.load(seq + 3 * i_n + 1).to(tl.int64)
    else:
        bos = i_n * L
        n_len = bos * 0 + L
    if HAS_CAPTURE:
        i_v0 = o_k * 0 + i_v                    # masks are blocks: the scalar tests broadcast
        if VARLEN:
            i_c = tl.load(seq + 3 * i_n + 2).to(tl.int64)
        else:
            i_c = i_n
        if HAS_GK:
            DW = H * K
            o_cd = i_h * K + o_k
            m_cd = m_k & (i_v0 == 0)
        else:                                   # one scalar decay per head: lane 0 writes it
            DW = H
            o_cd = i_h + o_k * 0
            m_cd = (o_k == 0) & (i_v0 == 0)
        p_cd = cap + i_c * c_n + o_cd
        p_ck = cap + i_c * c_n + c_key + i_hk * K + o_k
        p_cu = cap + i_c * c_n + c_delta + i_h * V + o_v
        # the key is the same for every state head of its group: the group's first one writes it
        m_ck = m_k & (i_v0 == 0) & ((o_k * 0 + i_h) % (H // Hk) == 0)
        # padding sequences (negative slab row) capture nothing; only the first C tokens
        n_cap = tl.where(i_row >= 0, tl.minimum(n_len, C), 0)
    for t in range(n_len):
        i_t = bos + t                           # token row in the flat token axis
        o_th = i_t * H + i_h                    # (token, state head) row of v, o and the gates
        p_k = k + (i_t * Hk + i_hk) * K + o_k
        p_v = v + o_th * V + o_v
        b_k = l2norm_vector(tl.load(p_k, mask=m_k, other=0.0).to(tl.float32), eps, L2NORM)
        b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)
        b_lam = tl.zeros([BK], dtype=tl.float32)           # log decay per key
        if HAS_GK:
            b_gk = tl.load(gk + o_th * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            if RAW:
                b_gk = raw_log_decay(b_gk, b_a, b_dtb)
            b_lam += b_gk
        if HAS_G:
            b_g = tl.load(g + o_th).to(tl.float32)
            if RAW and not HAS_GK:
                b_g = raw_log_decay(b_g, b_a, b_dtb)
            b_lam += b_g
        b_d = tl.exp(b_lam)
        b_u = b_v
        if HAS_WRITE:
            if WRITE_PER_VALUE:
                b_u = b_v * update_gate(tl.load(w + o_th * V + o_v, mask=m_v, other=0.0), SIGMOID)
            else:
                b_u = b_v * update_gate(tl.load(w + o_th), SIGMOID)
        if HAS_ERASE:
            if ERASE_PER_KEY:
                b_b = update_gate(tl.load(b + o_th * K + o_k, mask=m_k, other=0.0), SIGMOID)
            else:
                b_b = update_gate(tl.load(b + o_th), SIGMOID)
            # retrieval from the old state: S'^T (b k) = S^T (exp(lam) b k)
            b_u = b_u - tl.sum((b_d * b_b * b_k)[:, None] * b_s, axis=0)
        for i_g in tl.static_range(G):
            p_q = q + ((i_t * Hq + i_hq) * G + i_g) * K + o_k
            p_o = o + (o_th * G + i_g) * V + o_v
            b_q = l2norm_vector(tl.load(p_q, mask=m_k, other=0.0).to(tl.float32), eps, L2NORM)
            # output from the old state too: S_t^T q = S'^T q + (k . q) u
            b_o = scale * (tl.sum((b_d * b_q)[:, None] * b_s, axis=0) + tl.sum(b_k * b_q) * b_u)
            tl.store(p_o, b_o, mask=m_v)
        b_s = b_d[:, None] * b_s + b_k[:, None] * b_u[None, :]
        if HAS_CAPTURE:
            if t < n_cap:
                tl.store(p_cd + t * DW, b_d, mask=m_cd)
                tl.store(p_ck + t * (Hk * K), b_k, mask=m_ck)
                tl.store(p_cu + t * (H * V), b_u, mask=m_v)
        if TOKEN_ROWS:
            i_w = tl.load(tok + i_n * W + t).to(tl.int64)
            m_w = m_row & ((o_k * 0 + i_w) >= 0)[:, None]
            store_state_tile(S, b_s, i_w, i_h, s_n, s_h, s_k, s_v, o_k, o_v, m_w)

    if not TOKEN_ROWS:
        store_state_tile(S, b_s, i_row, i_h, s_n, s_h, s_k, s_v, o_k, o_v, m_row)


def recurrent(q, k, v, g, gk, b, w, S0, scale: float, S=None, *, A_log=None, dt_bias=None,
              beta_sigmoid: bool = False, l2norm_eps: float | None = None,
              state_indices=None, token_rows=None, state_layout: str = "kv", spans=None,
              capture=None, capture_rows=None):
    """Run the fused recurrence; returns (o [N, L, H, G, V] float32, S).

    q [N, L, Hq, G, K], k [N, L, Hk, K], v [N, L, H, V]; g None or
    [N, L, H] and gk None or [N, L, H, K], log decays; b None, [N, L, H] or
    [N, L, H, K] (erase; scalar beta); w None, [N, L, H] or [N, L, H, V]
    (write; scalar beta: b itself); all in their input dtype. Fused into the
    kernel: `A_log` [H] with `dt_bias` ([H] beside g, [H, K] beside gk; only
    one of g and gk then) make the decay -exp(A_log) * softplus(gate + dt_bias);
    `beta_sigmoid` takes the sigmoid of b and w; `l2norm_eps` (not None)
    L2-normalises q and k rows with that epsilon.
    S0: None (zeros) or [N, H, K, V] ("kv") / [N, H, V, K] ("vk"), float32,
    bfloat16 or float16, any strides. `S` is the output state buffer, same
    layout (default a new contiguous tensor in S0's dtype; S0 itself updates
    the states in place); stores round to its dtype. With `state_indices`
    [N] (int), S0 is a slab: sequence n reads row state_indices[n] and,
    unless `S` is given, writes that row in place; a negative index is
    padding: no slab row is read or written for it (its output is computed
    from a zero state; the caller discards it). `token_rows` [N, W] (int,
    with `state_indices`): the state after token t of sequence n is stored
    at row token_rows[n, t] (negative: not stored) instead of the final
    state. `spans` (varlen, no packing): a host list of disjoint
    (first token, length) in the flat [N * L] token axis, one per sequence;
    o [N, L, H, G, V] then holds each span's outputs in place (zeros elsewhere).
    `capture`: None, or a float32 contiguous [R, C * (Dw + Hk * K + H * V)]
    buffer (Dw = H * K with gk, else H; C >= 1 from its width) written in
    place: row r receives the first min(C, length) transitions of its
    sequence as (decay exp(lam) [C, Dw], key after the L2 norm [C, Hk, K],
    delta u = w v - S'^T (b k) [C, H, V]), struct of arrays; entries past a
    sequence's length, and padding sequences' rows, are not written.
    `capture_rows` (with `spans`): a host list, the capture row of each span's
    sequence (default: sequence n writes row n).
    """
    N, L, H, V = v.shape
    Hq, G, K = q.shape[2], q.shape[3], q.shape[4]
    Hk = k.shape[2]
    contig = lambda x: None if x is None else x.contiguous()  # noqa: E731
    q, k, v, g, gk, b, w, A_log, dt_bias = map(contig, (q, k, v, g, gk, b, w, A_log, dt_bias))
    n_seq, seq, covered = N, None, True
    if spans is not None:
        n_seq = len(spans)
        rows = range(n_seq) if capture_rows is None else capture_rows
        seq = torch.tensor([(bos, n, r) for (bos, n), r in zip(spans, rows)],
                           dtype=torch.int64).reshape(-1, 3).to(v.device)
        covered = sum(n for _, n in spans) == N * L
    if S is None:
        S = new_state(S0, state_indices, n_seq, H, K, V, state_layout, v.device)
    o = (torch.empty if covered else torch.zeros)(N, L, H, G, V, dtype=torch.float32, device=v.device)
    if n_seq * H == 0:
        return o, S
    idx = tok = None
    if state_indices is not None:
        idx = state_indices.to(device=v.device, dtype=torch.int64).contiguous()
    if token_rows is not None:
        tok = token_rows.to(device=v.device, dtype=torch.int64).contiguous()
    BK = triton.next_power_of_2(K)
    BV = min(64, triton.next_power_of_2(V))
    grid = (triton.cdiv(V, BV), n_seq * H)
    _recurrent_kernel[grid](
        q, k, v, g, gk, A_log, dt_bias, b, w, S0, S, o, idx, tok, seq, capture,
        float(scale), float(l2norm_eps or 0.0), L, H, Hq, Hk, K, V, 0 if tok is None else tok.shape[1],
        *capture_geometry(capture, H * K if gk is not None else H, Hk * K, H * V),
        *state_strides(S0, state_layout), *state_strides(S, state_layout),
        G=G, VARLEN=seq is not None, HAS_INIT=S0 is not None, HAS_INDEX=idx is not None,
        TOKEN_ROWS=tok is not None, HAS_CAPTURE=capture is not None,
        **gate_flags(g, gk, b, w, A_log), SIGMOID=beta_sigmoid, L2NORM=l2norm_eps is not None,
        BK=BK, BV=BV,
    )
    return o, S


def capture_geometry(capture, Dw: int, Dk: int, Du: int) -> tuple[int, int, int, int]:
    """(C, row stride, key offset C * Dw, delta offset C * (Dw + Dk)) in elements of a capture
    buffer [R, C * (Dw + Dk + Du)]: Dw decays, Dk = Hk * K key and Du = H * V delta elements per
    transition; zeros without one (the kernel then reads none of them)."""
    if capture is None:
        return (0, 0, 0, 0)
    C = capture.shape[1] // (Dw + Dk + Du)
    return (C, capture.stride(0), C * Dw, C * (Dw + Dk))
