"""Torch twins of the Triton chunked prefill's stages (`chunked.py`), one per stage, in float64.

Each `*_ref` takes what its stage takes (the same layouts: packed [N, L] rows or spans of
the flat [N * L] token axis, a `ChunkLayout`) and returns what the stage returns, written
plainly: one chunk of one sequence at a time, the decay matrix Γ formed whole, T by a dense
inverse. So a stage can be tested alone, on its twin's inputs (tests/test_triton_chunked.py),
and a first GPU failure narrowed to one stage. Torch only: importable without Triton. Rows
outside every span are NaN in the twins' outputs (the stages leave them unwritten).

    chunk_cumsum_ref   gc [N, L, H, K]           G per key, from each chunk's start
    chunk_intra_ref    (Ũ [N, L, H, V], Y [N, L, H, K])
    chunk_state_ref    (h [chunks, H, K, V], U [N, L, H, V], finals [sequences, H, K, V])
    chunk_output_ref   o [N, L, H, G, V]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..torch.chunked import LOG_DECAY_FLOOR

f64 = torch.float64


def sequences(lay) -> list[tuple[int, int, int]]:
    """(first token row, length, first global chunk) of every sequence of the layout."""
    if not lay.varlen:
        NC = -(-lay.L // lay.BT)
        return [(n * lay.L, lay.L, n * NC) for n in range(lay.N)]
    return [tuple(row) for row in lay.seq.tolist()]


def chunks(lay):
    """(sequence, chunk in it, global chunk, token rows) of every chunk, in global order."""
    for n, (bos, length, first) in enumerate(sequences(lay)):
        for c, c0 in enumerate(range(0, length, lay.BT)):
            yield n, c, first + c, slice(bos + c0, bos + min(c0 + lay.BT, length))


def _raw(x, A_log, dt_bias):
    """The raw-gate arm: -exp(A_log) * softplus(x + dt_bias), A_log broadcast over x's last axes."""
    rate = -torch.exp(A_log.to(f64))
    return rate.view(-1, *([1] * (dt_bias.dim() - 1))) * F.softplus(x + dt_bias.to(f64))


def _flat(x):
    """[N, L, ...] -> [N * L, ...] in float64 (None stays None)."""
    return None if x is None else x.to(f64).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _keys(k, H, l2norm_eps):
    """k [N, L, Hk, K] -> [N * L, H, K] float64 per state head (head h reads key head h // (H / Hk)),
    L2-normalised with `l2norm_eps`."""
    kk = _flat(k)
    if l2norm_eps is not None:
        kk = kk * torch.rsqrt((kk * kk).sum(-1, keepdim=True) + l2norm_eps)
    return kk.repeat_interleave(H // kk.shape[1], dim=1)


def _log_decays(g, A_log, dt_bias, gc, rows, like):
    """The chunk's cumulative log decay G [C, H, K] (float64, `like`'s shape) from gc (per key)
    or g (scalar, summed here), zeros without decay."""
    if gc is not None:
        return gc.reshape(-1, *gc.shape[2:])[rows].to(f64)
    if g is None:
        return torch.zeros_like(like)
    lam = _flat(g)[rows]
    if A_log is not None:
        lam = _raw(lam, A_log, dt_bias)
    lam = lam.clamp_min(LOG_DECAY_FLOOR)
    return lam.cumsum(0)[..., None].expand(like.shape)


def _pairwise(G, strict: bool):
    """Γ [C, C, H, K]: exp(G_r - G_s) where r > s (strict) or r >= s, else 0."""
    C = G.shape[0]
    r = torch.arange(C, device=G.device)
    keep = (r[:, None] > r[None, :]) if strict else (r[:, None] >= r[None, :])
    D = (G[:, None] - G[None, :]).masked_fill(~keep[:, :, None, None], float("-inf"))
    return D.exp()


def chunk_cumsum_ref(g, gk, A_log, dt_bias, lay) -> torch.Tensor:
    """Twin of `chunk_cumsum`: gc [N, L, H, K] float64."""
    N, L, H, K = gk.shape
    x = _flat(gk)
    if A_log is not None:
        x = _raw(x, A_log, dt_bias.reshape(H, K))
    if g is not None:
        x = x + _flat(g)[..., None]
    x = x.clamp_min(LOG_DECAY_FLOOR)
    gc = torch.full_like(x, float("nan"))
    for _, _, _, rows in chunks(lay):
        gc[rows] = x[rows].cumsum(0)
    return gc.view(N, L, H, K)


def chunk_intra_ref(k, v, g, A_log, dt_bias, gc, b, w, lay, *, beta_sigmoid=False, l2norm_eps=None):
    """Twin of `chunk_intra`: (Ũ [N, L, H, V], Y [N, L, H, K]) float64, per chunk
    A = strict_lower((b ⊙ k) Γ k^T), T = (I + A)^-1, Ũ = T (w ⊙ v), Y = T (exp(G) ⊙ b ⊙ k)."""
    N, L, H, V = v.shape
    K = k.shape[3]
    kk = _keys(k, H, l2norm_eps)
    act = torch.sigmoid if beta_sigmoid else (lambda x: x)
    bb, ww = act(_flat(b)), act(_flat(w))
    bb, ww = (x if x.dim() == 3 else x[..., None] for x in (bb, ww))
    vv = _flat(v)
    u = torch.full((N * L, H, V), float("nan"), dtype=f64, device=v.device)
    y = torch.full((N * L, H, K), float("nan"), dtype=f64, device=v.device)
    for _, _, _, rows in chunks(lay):
        kb = kk[rows] * bb[rows]
        G = _log_decays(g, A_log, dt_bias, gc, rows, kb)
        A = torch.einsum("rhk,rshk,shk->hrs", kb, _pairwise(G, strict=True), kk[rows])
        T = torch.linalg.inv(torch.eye(A.shape[-1], dtype=f64, device=A.device) + A)
        y[rows] = torch.einsum("hrs,shk->rhk", T, G.exp() * kb)
        u[rows] = torch.einsum("hrs,shv->rhv", T, ww[rows] * vv[rows])
    return u.view(N, L, H, V), y.view(N, L, H, K)


def chunk_state_ref(k, u, y, g, A_log, dt_bias, gc, S0, lay, *, l2norm_eps=None):
    """Twin of `chunk_state` (plain states: S0 None or [sequences, H, K, V]): (h [chunks, H, K, V],
    U [N, L, H, V] = Ũ - Y S per chunk (u itself without y), finals [sequences, H, K, V]),
    float64. Per chunk S' = exp(G_C) S + (K ⊙ exp(G_C - G))^T U."""
    N, L, H, V = u.shape
    K = k.shape[3]
    kk = _keys(k, H, l2norm_eps)
    U = _flat(u).clone()
    seqs = sequences(lay)
    S = torch.zeros(len(seqs), H, K, V, dtype=f64, device=u.device) if S0 is None else S0.to(f64).clone()
    h = torch.full((max(lay.n_chunks, 1), H, K, V), float("nan"), dtype=f64, device=u.device)
    for n, _, i, rows in chunks(lay):
        h[i] = S[n]
        if y is not None:
            U[rows] = U[rows] - torch.einsum("rhk,hkv->rhv", _flat(y)[rows], S[n])
        G = _log_decays(g, A_log, dt_bias, gc, rows, kk[rows])
        last = G[-1]
        S[n] = last.exp()[..., None] * S[n] + torch.einsum("rhk,rhv->hkv", kk[rows] * (last - G).exp(), U[rows])
    return h, U.view(N, L, H, V), S


def chunk_output_ref(q, k, u, g, A_log, dt_bias, gc, h, lay, *, scale, l2norm_eps=None):
    """Twin of `chunk_output`: o [N, L, H, G, V] float64, O = scale [(Q ⊙ exp(G)) h + M U] per
    chunk with M = lower(Q Γ K^T); zero outside every span."""
    N, L, H, V = u.shape
    Gq = q.shape[3]
    kk = _keys(k, H, l2norm_eps)
    qq = _flat(q)                                            # [N * L, Hq, G, K]
    if l2norm_eps is not None:
        qq = qq * torch.rsqrt((qq * qq).sum(-1, keepdim=True) + l2norm_eps)
    qq = qq.repeat_interleave(H // qq.shape[1], dim=1)      # state head h reads query head h // (H / Hq)
    U = _flat(u)
    o = torch.zeros(N * L, H, Gq, V, dtype=f64, device=u.device)
    for _, _, i, rows in chunks(lay):
        G = _log_decays(g, A_log, dt_bias, gc, rows, kk[rows])
        inter = torch.einsum("rhgk,rhk,hkv->rhgv", qq[rows], G.exp(), h[i].to(f64))
        M = torch.einsum("rhgk,rshk,shk->hgrs", qq[rows], _pairwise(G, strict=False), kk[rows])
        o[rows] = scale * (inter + torch.einsum("hgrs,shv->rhgv", M, U[rows]))
    return o.view(N, L, H, Gq, V)
