"""Shared torch preparation: gates in float32, sequence packing, state gather/scatter.

Every torch-based backend turns a `Problem` into the same token-major operands
(gates and state float32; q, k, v in their input dtype, float32 after an in-kernel
L2 norm: the kernels widen them in their first copy), runs its kernels, then hands
the results back through `finish`:

    q [N, L, Hq/G, G, K] k [N, L, Hk, K]   v [N, L, Hv, V]      (token-major, input dtype)
    (GVA: q and k keep their Hk heads, each serving Hv / Hk consecutive state heads;
     GQA: G = Hq / Hv query heads per state head)
    lam  None | [N, L, Hv] | [N, L, Hv, K]    log decay (g + gk, raw arm applied)
    b    None | [N, L, Hv] | [N, L, Hv, K]    erase gate (scalar beta: [N, L, Hv])
    w    None | [N, L, Hv] | [N, L, Hv, V]    write gate
    S0   [N, Hv, K, V] float32 K-major (None: the backend reads the states where they lie)

Tokens past a sequence's length are identity steps (k = 0, lam = 0, all else 0),
so the state after L padded steps is the state after the sequence's last token.
The packing and the slab row indices come from the call's `BatchPlan` and are
kept with it (a reused plan reuses them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..problem import Problem


@dataclass
class Operands:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lam: torch.Tensor | None
    b: torch.Tensor | None
    w: torch.Tensor | None
    S0: torch.Tensor | None


@dataclass
class Packing:
    """Where each sequence's tokens live in the [B*T] flat token axis.

    `gather` [N, L] flat token index (0 where masked), `valid` [N, L] bool;
    `src` / `dst`: flat [N*L] positions to copy into flat [B*T] output tokens
    (the later sequence wins where clamped spans overlap; padding sequences
    and masked steps are left out). `identity` means sequences are the rows.
    """

    L: int
    identity: bool
    gather: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    src: torch.Tensor | None = None
    dst: torch.Tensor | None = None


def pack(p: Problem) -> Packing:
    """The call's `Packing`, built once per plan and device."""
    return p.plan.cached(("packing", p.device), lambda: _packing(p.plan, p.device))


def _packing(plan, device) -> Packing:
    L = plan.max_len
    if plan.dense:
        return Packing(L=L, identity=True)
    N, T = plan.N, plan.T
    gather = np.zeros((N, L), dtype=np.int64)
    valid = np.zeros((N, L), dtype=bool)
    for n, s in enumerate(plan.spans):
        base = s.row * T + s.start
        gather[n, : s.length] = np.arange(base, base + s.length)
        valid[n, : s.length] = True
    owner = plan.owner()
    dst = np.nonzero(owner >= 0)[0]
    starts = np.array([s.row * T + s.start for s in plan.spans], dtype=np.int64)
    src = owner[dst].astype(np.int64) * L + (dst - starts[owner[dst]])   # flat [N*L] source of each token
    as_t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return Packing(L=L, identity=False, gather=as_t(gather), valid=as_t(valid), src=as_t(src), dst=as_t(dst))


def _to_sequences(x: torch.Tensor, pk: Packing, B: int, T: int) -> torch.Tensor:
    """[B, T, H, ...] -> [N, L, H, ...] with masked steps zeroed."""
    if pk.identity:
        return x
    flat = x.reshape(B * T, *x.shape[2:])
    x = flat[pk.gather]
    return x.masked_fill(~pk.valid.view(*pk.valid.shape, *([1] * (x.dim() - 2))), 0)


def log_decays(p: Problem) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(g [B, T, Hv], gk [B, T, Hv, K]) log decays in float32, the raw-gate arm applied."""
    f32 = torch.float32
    g = None if p.g is None else p.g.to(f32)
    gk = None if p.gk is None else p.gk.to(f32)
    if p.A_log is not None:
        rate = -torch.exp(p.A_log.to(f32))
        if g is not None:
            g = rate * F.softplus(g + p.dt_bias.to(f32))
        else:
            gk = rate[:, None] * F.softplus(gk + p.dt_bias.to(f32))
    return g, gk


def normalized_qk(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as given, or L2-normalised per head in float32 (`qk_l2norm`)."""
    q, k = p.q, p.k                     # the kernels widen to float32 in their first copy
    if p.qk_l2norm:
        f32 = torch.float32
        q, k = q.to(f32), k.to(f32)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + p.l2norm_eps)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + p.l2norm_eps)
    return q, k


def update_gates(p: Problem) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(b, w): the erase and the write gate in float32 in the API's token layout
    [B, T, Hv(, K or V)], sigmoid applied with `beta_sigmoid`; with scalar beta, b is w."""
    if not p.retrieves:
        return None, None
    f32 = torch.float32
    act = torch.sigmoid if p.beta_sigmoid else (lambda x: x)
    if p.beta is not None:
        b = act(p.beta.to(f32))
        return b, b
    return act(p.erase.to(f32)), act(p.write.to(f32))


def gates(p: Problem) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(lam, b, w) in float32 in the API's token layout [B, T, Hv(, K or V)]:
    the log decay (g + gk, raw arm applied) and `update_gates`."""
    g, gk = log_decays(p)
    lam = gk if g is None else (g if gk is None else gk + g[..., None])
    return (lam, *update_gates(p))


def operands(p: Problem, pk: Packing, gather_states: bool = True) -> Operands:
    """The kernels' operands; `S0` is None when `gather_states` is False (the
    backend reads the initial states itself, e.g. from a slab in place)."""
    q, k = normalized_qk(p)
    G = p.G
    q = q.reshape(p.B, p.T, p.Hq // G, G * p.K)         # GQA: G query heads per state head
    seq = lambda x: None if x is None else _to_sequences(x, pk, p.B, p.T)  # noqa: E731
    lam, b, w = gates(p)
    qs = seq(q)
    qs = qs.view(*qs.shape[:3], G, p.K)
    bs = seq(b)
    return Operands(q=qs, k=seq(k), v=seq(p.v), lam=seq(lam), b=bs,
                    w=bs if w is b else seq(w), S0=initial_states(p) if gather_states else None)


@dataclass
class RawOperands:
    """The operands as given, token-major, for kernels that fuse the preprocessing
    (raw-gate arm, `beta_sigmoid`, `qk_l2norm`) themselves: q [N, L, Hq/G, G, K],
    k [N, L, Hk, K], v [N, L, Hv, V], g [N, L, Hv], gk [N, L, Hv, K], b (beta or erase),
    w (beta, b itself, or write), each None when absent, all in their input dtype."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None
    gk: torch.Tensor | None
    b: torch.Tensor | None
    w: torch.Tensor | None


def raw_operands(p: Problem, pk: Packing) -> RawOperands:
    """`RawOperands` of `p`, packed by `pk` (masked steps zeroed; a kernel that takes them
    must not run steps past a sequence's length: a zero raw gate is not an identity step)."""
    G = p.G
    seq = lambda x: None if x is None else _to_sequences(x, pk, p.B, p.T)  # noqa: E731
    qs = seq(p.q.reshape(p.B, p.T, p.Hq // G, G * p.K))
    b = p.beta if p.beta is not None else p.erase
    bs = seq(b)
    return RawOperands(q=qs.view(*qs.shape[:3], G, p.K), k=seq(p.k), v=seq(p.v), g=seq(p.g), gk=seq(p.gk),
                       b=bs, w=bs if p.beta is not None else seq(p.write))


def store_capture(p: Problem, x: Operands, deltas: torch.Tensor) -> None:
    """Write the compact capture of a token-serial run into `p.capture` (docs/design.md,
    "Compact capture"): of sequence n, the first min(C, length) transitions' decay factors
    exp(lam), keys (`x.k`, normalised) and `deltas` [N, R, Hv, V] (R = min(C, L)); the
    entries past a sequence's count, and the rows of padding sequences, stay as they were."""
    R = deltas.shape[1]
    decay, key, delta = (part[:, :R] for part in p.capture_parts())
    counts = torch.tensor([min(s.length, p.capacity) if s.live else 0 for s in p.spans], device=p.device)
    kept = torch.arange(R, device=p.device) < counts[:, None]               # [N, R]
    f32 = torch.float32
    if x.lam is None:
        factors = torch.ones_like(decay)
    else:
        factors = x.lam[:, :R].to(f32).exp().reshape(decay.shape)
    for part, new in ((decay, factors), (key, x.k[:, :R].to(f32)), (delta, deltas.to(f32))):
        mask = kept.view(*kept.shape, *([1] * (part.dim() - 2)))
        part.copy_(torch.where(mask, new, part))


def initial_states(p: Problem) -> torch.Tensor:
    """[N, Hv, K, V] float32 K-major starting states (zeros for padding / no state): a
    copy, or the caller's float32 tensor itself (kernels never write their initial state)."""
    shape = (p.N, p.Hv, p.K, p.V)
    if p.initial_state is None:
        return torch.zeros(shape, dtype=torch.float32, device=p.device)
    init = p.initial_state
    if p.state_layout == "vk":
        init = init.transpose(-1, -2)
    if not p.in_place:
        return init.to(torch.float32).contiguous()
    if not any(s.live for s in p.spans):                # all padding (or none): a slab may have no row
        return torch.zeros(shape, dtype=torch.float32, device=p.device)
    rows, pad = p.plan.cached(("read_rows", p.device), lambda: (
        torch.tensor([max(s.read, 0) for s in p.spans], dtype=torch.int64, device=p.device),
        torch.tensor([not s.live for s in p.spans], dtype=torch.bool, device=p.device).view(-1, 1, 1, 1)))
    return init.index_select(0, rows).to(torch.float32).masked_fill(pad, 0.0).contiguous()


def finish(p: Problem, pk: Packing, o: torch.Tensor, S: torch.Tensor | None,
           token_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel results -> the API's (o [B,T,Ho,V] in v's dtype, state in layout and dtype).

    `o` is [N, L, Hv, G, V] float32; `S` [N, Hv, K, V] float32 K-major; with a
    speculative plan `token_states` [N, L, Hv, K, V] holds the state after every
    token. With a slab, stores the final and per-token states of the live
    sequences in place (`BatchPlan.store`) and returns the slab; S None means
    the kernel already updated the slab where it lies.
    """
    N, L, Hv, G, V = o.shape
    o = o.reshape(N, L, p.Ho, V)
    if not pk.identity:
        flat = o.new_zeros(p.B * p.T, p.Ho, V)
        flat[pk.dst] = o.reshape(N * L, p.Ho, V)[pk.src]
        o = flat.view(p.B, p.T, p.Ho, V)
    o = o.to(p.v.dtype)
    if S is None:
        return o, p.initial_state
    layout = (lambda x: x.transpose(-1, -2)) if p.state_layout == "vk" else (lambda x: x)  # noqa: E731
    if not p.in_place:
        state = layout(S).to(p.state_dtype)
        # no step ran: never hand back the caller's tensor (a differentiable call's S is fresh:
        # `torch_backend.Recurrence`; its tensors may be torch.func's, which have no data_ptr)
        if p.initial_state is not None and not p.requires_grad and state.data_ptr() == p.initial_state.data_ptr():
            state = state.clone()
        return o, state.contiguous()
    if token_states is not None:
        sequences, tokens, _ = p.plan.token_writes()
        flat = p.plan.cached(("token states", L, token_states.device),
                             lambda: torch.from_numpy(sequences * L + tokens).to(token_states.device))
        token_states = layout(token_states.reshape(N * L, Hv, p.K, p.V).index_select(0, flat))
    p.plan.store(p.initial_state, layout(S), token_states)
    return o, p.initial_state
