"""Reverse mode of the recurrence in Triton: a TOKEN-SERIAL, V-tiled backward (not the chunked WY one).

This is the first Triton backward (docs/algorithm.md section 7). It walks the
tokens of each sequence one at a time in reverse, like `recurrent_backward.py`
(torch ops) and `kernels/cpu/csrc/backward.c` (the cpu backend), with the same
operands and outputs; the chunked (WY / UT transform) backward that the issue
asks for is still to do.

Two kernels, one program per (value tile of BV columns, sequence, state head),
grid (cdiv(V, BV), N * H); the state's columns are independent, so the tiles
need no communication:

- `_forward_kernel`: the recurrence over the sequence's tokens in a [K, BV]
  float32 register tile, writing o and the state at the start of every chunk
  of CHECKPOINT tokens, then the final state, into the checkpoint buffer
  (rows first[n] + c, final at first[n] + chunks: `cpu_backend`'s layout).
- `_backward_kernel`: per chunk in reverse, recompute the chunk's states from
  its checkpoint, storing the state *before* each token into a per-program
  global scratch [CHECKPOINT, BK, BV] (the state after the token is
  recomputed from it in the reverse step, together with u); then the reverse
  steps, with dS kept in registers:

      S' = diag(d) S_prev,  u = w v - S'^T (b k),  S = S' + k u^T
      dS  += scale sum_g q_g do_g^T     dq_g = scale S do_g
      du   = dS^T k                     dk   = dS u
      dw   = du v                       dv   = du w
      dS'  = dS - (b k) du^T            p    = S' du,  db = -k p,  dk -= b p
      dlam = rowsum(dS' S')             dS_prev = diag(d) dS'

  The state is never recovered by dividing by the decay (d may be 0: a reset).
  Reductions over the value axis (dq, dk, db, dlam) are partial per value
  tile: written to [NV, B, T, H, ...] buffers that the caller sums (no
  atomics); dv, dw and dS0 are per column, written once.

Operands (preprocessing already applied, `deltarule.backends._grad.Operands`):
float32, contiguous, in the API's token layout q [B, T, Hq, G, K],
k [B, T, Hk, K], v [B, T, H, V], g None | [B, T, H], gk None | [B, T, H, K],
b None | [B, T, H] | [B, T, H, K], w None | [B, T, H] | [B, T, H, V],
S0 None | [N, H, K, V]; sequences are spans of the flat [B * T] token axis
(`seq` [N, 3] int64: first token, length, first checkpoint row). Compute
only, no validation; the kernels write their outputs in place, so they are
never autotuned. Under `TRITON_INTERPRET=1` they run on CPU tensors.

Memory: the scratch is N * H * NV * min(CHECKPOINT, longest) * BK * BV * 4
bytes (the whole of one chunk's states for every program), the checkpoints
N * H * (chunks + 1) * K * V * 4 bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens between the states the forward keeps (the backward recomputes a chunk from its start).
CHECKPOINT = 64


@triton.jit
def _load_token(k, v, g, gk, b, w, i_t, i_h, o_th, H, Hk, K, V, o_k, o_v, m_k, m_v,
                HAS_G: tl.constexpr, HAS_GK: tl.constexpr, HAS_ERASE: tl.constexpr, ERASE_PER_KEY: tl.constexpr,
                HAS_WRITE: tl.constexpr, WRITE_PER_VALUE: tl.constexpr, BK: tl.constexpr):
    """One token's k [BK], v [BV], decay d = exp(g + gk) [BK], erase b [BK] (broadcast) and
    write w [BV] (broadcast; ones without a write gate), float32."""
    b_k = tl.load(k + (i_t * Hk + i_h // (H // Hk)) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + o_th * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_lam = tl.zeros([BK], dtype=tl.float32)
    if HAS_GK:
        b_lam += tl.load(gk + o_th * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    if HAS_G:
        b_lam += tl.load(g + o_th).to(tl.float32)
    b_b = tl.zeros([BK], dtype=tl.float32)
    if HAS_ERASE:
        if ERASE_PER_KEY:
            b_b = tl.load(b + o_th * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        else:
            b_b += tl.load(b + o_th).to(tl.float32)
    b_w = tl.full(b_v.shape, 1.0, dtype=tl.float32)
    if HAS_WRITE:
        if WRITE_PER_VALUE:
            b_w = tl.load(w + o_th * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        else:
            b_w = b_w * tl.load(w + o_th).to(tl.float32)
    return b_k, b_v, b_lam, b_b, b_w


@triton.jit
def _forward_kernel(
    q, k, v, g, gk, b, w, S0, ck, o, seq,
    scale, H, Hq, Hk, K, V,
    G: tl.constexpr, HAS_INIT: tl.constexpr,
    HAS_G: tl.constexpr, HAS_GK: tl.constexpr, HAS_ERASE: tl.constexpr, ERASE_PER_KEY: tl.constexpr,
    HAS_WRITE: tl.constexpr, WRITE_PER_VALUE: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """The recurrence of one [K, BV] state tile of state head h of sequence n, keeping the
    state at the start of every BT-token chunk in ck [R, H, K, V] (rows seq[n, 2] + c) and
    the final state after them; o [B, T, H, G, V]."""
    i_v = tl.program_id(0).to(tl.int64)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // H
    i_h = i_nh % H
    i_hq = i_h // (H // Hq)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    o_s = o_k[:, None] * V + o_v[None, :]                 # a [K, V] state's elements

    bos = tl.load(seq + 3 * i_n).to(tl.int64)
    n_len = tl.load(seq + 3 * i_n + 1).to(tl.int64)
    i_ck = tl.load(seq + 3 * i_n + 2).to(tl.int64)

    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INIT:
        b_s = tl.load(S0 + i_nh * K * V + o_s, mask=m_s, other=0.0).to(tl.float32)
    for t in range(n_len):
        if t % BT == 0:
            tl.store(ck + ((i_ck + t // BT) * H + i_h) * K * V + o_s, b_s, mask=m_s)
        i_t = bos + t
        o_th = i_t * H + i_h
        b_k, b_v, b_lam, b_b, b_w = _load_token(
            k, v, g, gk, b, w, i_t, i_h, o_th, H, Hk, K, V, o_k, o_v, m_k, m_v,
            HAS_G, HAS_GK, HAS_ERASE, ERASE_PER_KEY, HAS_WRITE, WRITE_PER_VALUE, BK)
        b_s = tl.exp(b_lam)[:, None] * b_s                   # S' = diag(d) S_prev
        b_u = b_w * b_v
        if HAS_ERASE:
            b_u -= tl.sum((b_b * b_k)[:, None] * b_s, axis=0)
        b_s += b_k[:, None] * b_u[None, :]
        for i_g in tl.static_range(G):
            b_q = tl.load(q + ((i_t * Hq + i_hq) * G + i_g) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_o = scale * tl.sum(b_q[:, None] * b_s, axis=0)
            tl.store(o + (o_th * G + i_g) * V + o_v, b_o, mask=m_v)
    n_ck = (n_len + BT - 1) // BT
    tl.store(ck + ((i_ck + n_ck) * H + i_h) * K * V + o_s, b_s, mask=m_s)


@triton.jit
def _backward_kernel(
    q, k, v, g, gk, b, w, ck, do, dS, seq, hs,
    dq, dk, dv, dlam, db, dw, dS0,
    scale, B, T, H, Hq, Hk, K, V, CS,
    G: tl.constexpr, HAS_DS: tl.constexpr, HAS_DS0: tl.constexpr,
    HAS_G: tl.constexpr, HAS_GK: tl.constexpr, HAS_ERASE: tl.constexpr, ERASE_PER_KEY: tl.constexpr,
    HAS_WRITE: tl.constexpr, WRITE_PER_VALUE: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """The reverse steps of one [K, BV] state tile of state head h of sequence n.

    ck: `_forward_kernel`'s checkpoints; do [B, T, H, G, V]; dS None | [N, H, K, V], the final
    state's gradient; hs the scratch, CS [BK, BV] tiles per program. Partial (this value tile's
    part) dq [NV, B, T, H, G, K], dk / dlam / db [NV, B, T, H, K]; whole dv / dw [B, T, H, V] and
    dS0 [N, H, K, V] (the initial state's gradient)."""
    i_v = tl.program_id(0).to(tl.int64)
    i_nh = tl.program_id(1).to(tl.int64)
    n_v = tl.num_programs(0).to(tl.int64)
    i_n = i_nh // H
    i_h = i_nh % H
    i_hq = i_h // (H // Hq)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    o_s = o_k[:, None] * V + o_v[None, :]
    p_hs = hs + (i_nh * n_v + i_v) * CS * BK * BV + o_k[:, None] * BV + tl.arange(0, BV)[None, :]
    o_part = i_v * B * T * H                               # this tile's slice of the partial sums

    bos = tl.load(seq + 3 * i_n).to(tl.int64)
    n_len = tl.load(seq + 3 * i_n + 1).to(tl.int64)
    i_ck = tl.load(seq + 3 * i_n + 2).to(tl.int64)
    n_ck = (n_len + BT - 1) // BT

    b_ds = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DS:
        b_ds = tl.load(dS + i_nh * K * V + o_s, mask=m_s, other=0.0).to(tl.float32)
    for i_c in range(n_ck):
        c = n_ck - 1 - i_c
        t0 = c * BT
        n_t = tl.minimum(n_len - t0, BT)
        # recompute: the state before each token of the chunk, into the scratch
        b_s = tl.load(ck + ((i_ck + c) * H + i_h) * K * V + o_s, mask=m_s, other=0.0)
        for j in range(n_t):
            tl.store(p_hs + j * BK * BV, b_s)
            i_t = bos + t0 + j
            b_k, b_v, b_lam, b_b, b_w = _load_token(
                k, v, g, gk, b, w, i_t, i_h, i_t * H + i_h, H, Hk, K, V, o_k, o_v, m_k, m_v,
                HAS_G, HAS_GK, HAS_ERASE, ERASE_PER_KEY, HAS_WRITE, WRITE_PER_VALUE, BK)
            b_s = tl.exp(b_lam)[:, None] * b_s
            b_u = b_w * b_v
            if HAS_ERASE:
                b_u -= tl.sum((b_b * b_k)[:, None] * b_s, axis=0)
            b_s += b_k[:, None] * b_u[None, :]
        tl.debug_barrier()
        # the reverse steps
        for i_j in range(n_t):
            j = n_t - 1 - i_j
            i_t = bos + t0 + j
            o_th = i_t * H + i_h
            b_k, b_v, b_lam, b_b, b_w = _load_token(
                k, v, g, gk, b, w, i_t, i_h, o_th, H, Hk, K, V, o_k, o_v, m_k, m_v,
                HAS_G, HAS_GK, HAS_ERASE, ERASE_PER_KEY, HAS_WRITE, WRITE_PER_VALUE, BK)
            b_d = tl.exp(b_lam)
            b_s1 = b_d[:, None] * tl.load(p_hs + j * BK * BV)       # S' = diag(d) S_prev
            b_bk = b_b * b_k
            b_u = b_w * b_v
            if HAS_ERASE:
                b_u -= tl.sum(b_bk[:, None] * b_s1, axis=0)
            b_s = b_s1 + b_k[:, None] * b_u[None, :]
            o_part_t = o_part + o_th
            for i_g in tl.static_range(G):
                o_thg = o_th * G + i_g
                b_q = tl.load(q + ((i_t * Hq + i_hq) * G + i_g) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
                b_do = tl.load(do + o_thg * V + o_v, mask=m_v, other=0.0).to(tl.float32)
                b_ds += scale * (b_q[:, None] * b_do[None, :])
                b_dq = scale * tl.sum(b_s * b_do[None, :], axis=1)
                tl.store(dq + (o_part_t * G + i_g) * K + o_k, b_dq, mask=m_k)
            b_du = tl.sum(b_ds * b_k[:, None], axis=0)
            b_dk = tl.sum(b_ds * b_u[None, :], axis=1)
            tl.store(dv + o_th * V + o_v, b_du * b_w, mask=m_v)
            if HAS_WRITE:
                tl.store(dw + o_th * V + o_v, b_du * b_v, mask=m_v)
            if HAS_ERASE:
                b_ds -= b_bk[:, None] * b_du[None, :]
                b_p = tl.sum(b_s1 * b_du[None, :], axis=1)
                tl.store(db + o_part_t * K + o_k, -b_k * b_p, mask=m_k)
                b_dk -= b_b * b_p
            tl.store(dk + o_part_t * K + o_k, b_dk, mask=m_k)
            if HAS_G or HAS_GK:
                tl.store(dlam + o_part_t * K + o_k, tl.sum(b_ds * b_s1, axis=1), mask=m_k)
                b_ds = b_d[:, None] * b_ds
        tl.debug_barrier()                                   # the scratch is rewritten next chunk
    if HAS_DS0:
        tl.store(dS0 + i_nh * K * V + o_s, b_ds, mask=m_s)


def _tiles(K: int, V: int, elements: int = 4096) -> tuple[int, int]:
    """(BK, BV): the whole key axis, and value tiles of at most `elements` (4096: 32 float32
    registers a thread at 4 warps). Compiled for sm_90 at K = 128 (benchmarks/triton_aot.py,
    ptxas -v): with BV = 64 both kernels spilled; with BV = 32 the forward did not, the backward
    (three live tiles) with per-key gates still did; the backward takes BV = 16 there (2048)."""
    BK = triton.next_power_of_2(K)
    return BK, min(64, max(16, elements // BK), triton.next_power_of_2(V))


BACKWARD_TILE = 2048


def _flags(g, gk, b, w) -> dict:
    return dict(HAS_G=g is not None, HAS_GK=gk is not None,
                HAS_ERASE=b is not None, ERASE_PER_KEY=b is not None and b.dim() == 4,
                HAS_WRITE=w is not None, WRITE_PER_VALUE=w is not None and w.dim() == 4)


def checkpoint_rows(lengths) -> torch.Tensor:
    """first [N + 1] int64: sequence n's checkpoints are rows first[n] .. first[n] + chunks (its
    chunk-start states, then its final state); first[N] is the buffer's row count."""
    chunks = torch.tensor([-(-n // CHECKPOINT) + 1 for n in lengths], dtype=torch.int64)
    return torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(chunks, 0)])


def forward(q, k, v, g, gk, b, w, S0, scale: float, seq, first, zero_outputs: bool):
    """(o [B, T, H, G, V], checkpoints [first[-1], H, K, V], final state [N, H, K, V]), float32.

    seq: [N, 3] int64 on the device (first flat token, length, first[n]); first: `checkpoint_rows`
    (host); zero_outputs: some tokens belong to no sequence (their output must read zero)."""
    B, T, H, V = v.shape
    Hq, G, K = q.shape[2], q.shape[3], q.shape[4]
    N = seq.shape[0]
    o = (torch.zeros if zero_outputs else torch.empty)(B, T, H, G, V, dtype=torch.float32, device=v.device)
    ck = torch.empty(int(first[-1]), H, K, V, dtype=torch.float32, device=v.device)
    if N * H:
        BK, BV = _tiles(K, V)
        _forward_kernel[(triton.cdiv(V, BV), N * H)](
            q=q, k=k, v=v, g=g, gk=gk, b=b, w=w, S0=S0, ck=ck, o=o, seq=seq,
            scale=float(scale), H=H, Hq=Hq, Hk=k.shape[2], K=K, V=V,
            G=G, HAS_INIT=S0 is not None, **_flags(g, gk, b, w), BT=CHECKPOINT, BK=BK, BV=BV,
        )
    return o, ck, ck.index_select(0, (first[1:] - 1).to(v.device))      # the final states


def backward(q, k, v, g, gk, b, w, ck, do, dS, scale: float, seq, max_len: int, zero_outputs: bool,
             need_dS0: bool = True):
    """Gradients of `forward`: (dq [B, T, H, G, K], dk [B, T, H, K] per state head, dv [B, T, H, V],
    dlam [B, T, H, K] | None (the log decay g + gk), db [B, T, H, K] | None (per key, also for a
    scalar erase), dw [B, T, H, V] | None (per value, also for a scalar write), dS0 [N, H, K, V] |
    None); do [B, T, H, G, V] (None: zero), dS [N, H, K, V] | None; float32."""
    B, T, H, V = v.shape
    Hq, G, K = q.shape[2], q.shape[3], q.shape[4]
    N, dev = seq.shape[0], v.device
    BK, BV = _tiles(K, V, BACKWARD_TILE)
    NV = triton.cdiv(V, BV)
    alloc = torch.zeros if zero_outputs else torch.empty
    new = lambda *shape: alloc(*shape, dtype=torch.float32, device=dev)  # noqa: E731
    dq, dk = new(NV, B, T, H, G, K), new(NV, B, T, H, K)
    dv = new(B, T, H, V)
    dlam = None if g is None and gk is None else new(NV, B, T, H, K)
    db = None if b is None else new(NV, B, T, H, K)
    dw = None if w is None else new(B, T, H, V)
    dS0 = torch.zeros(N, H, K, V, dtype=torch.float32, device=dev) if need_dS0 else None
    if do is None:
        do = torch.zeros(B, T, H, G, V, dtype=torch.float32, device=dev)
    CS = max(1, min(CHECKPOINT, max_len))
    if N * H:
        hs = torch.empty(N * H * NV * CS * BK * BV, dtype=torch.float32, device=dev)
        _backward_kernel[(NV, N * H)](
            q=q, k=k, v=v, g=g, gk=gk, b=b, w=w, ck=ck, do=do, dS=dS, seq=seq, hs=hs,
            dq=dq, dk=dk, dv=dv, dlam=dlam, db=db, dw=dw, dS0=dS0,
            scale=float(scale), B=B, T=T, H=H, Hq=Hq, Hk=k.shape[2], K=K, V=V, CS=CS,
            G=G, HAS_DS=dS is not None, HAS_DS0=dS0 is not None, **_flags(g, gk, b, w),
            BT=CHECKPOINT, BK=BK, BV=BV,
        )
    total = lambda x: None if x is None else x.sum(0)  # noqa: E731
    return total(dq), total(dk), dv, total(dlam), total(db), dw, dS0
