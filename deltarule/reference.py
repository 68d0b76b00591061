"""The float64 oracle: the recurrence of docs/design.md section 1, token by token.

Straight from the formula, in NumPy float64, one sequence at a time; every
other backend is tested against `solve`. Slow by design. `differentiable` is
its torch twin, for gradients: the same loop in float64 torch ops, which
autograd differentiates (the oracle of every backward kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .problem import Problem


def _f64(x: torch.Tensor | None) -> np.ndarray | None:
    return None if x is None else x.detach().to("cpu", torch.float64).numpy()


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _l2norm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


@dataclass
class Solution:
    """The float64 results of a call, K-major, before any cast or store.

    o: [B, T, Ho, V], zero where no live sequence owns the token.
    finals: [N, Hv, K, V], each sequence's final state (zeros for padding).
    token_states: [W, Hv, K, V], the state after each per-token store of the
        plan (`BatchPlan.token_writes` order); W = 0 without 2-D state_indices.
    capture: None without `p.capture`, else `Captured`: sequence n's first
        count[n] = min(C, length) transitions (zeros past it and for padding).
    """

    o: np.ndarray
    finals: np.ndarray
    token_states: np.ndarray
    capture: "Captured | None" = None


@dataclass
class Captured:
    """The factors of captured transitions, float64: decay [N, C, Dw] (exp of the log
    decay, 1 without one), key [N, C, Hk, K] (after qk_l2norm), delta [N, C, Hv, V]
    (w * v - S'^T (b * k)), count [N] int; S_t = diag(decay) S_{t-1} + key delta^T."""

    decay: np.ndarray
    key: np.ndarray
    delta: np.ndarray
    count: np.ndarray


def solve(p: Problem) -> Solution:
    """Run the recurrence in float64 without touching any input.

    The state read from a 16-bit `initial_state` is its exact value; the
    state is carried in float64 between tokens (the kernels carry float32).
    """
    q, k, v = _f64(p.q), _f64(p.k), _f64(p.v)
    if p.qk_l2norm:
        q, k = _l2norm(q, p.l2norm_eps), _l2norm(k, p.l2norm_eps)
    lam = _log_decay(p)
    b, w = _erase_write(p)
    s0 = _initial_states(p)

    Hv, G = p.Hv, p.G
    key_head = np.arange(Hv) // (Hv // p.Hk)
    # GVA: query head = key head of each state head; GQA: G query heads per state head.
    query_heads = key_head[:, None] if p.Hq <= p.Hv else np.arange(p.Hq).reshape(Hv, G)

    o = np.zeros((p.B, p.T, p.Ho, p.V))
    finals = np.zeros((p.N, Hv, p.K, p.V))
    store_n, store_t, _ = p.plan.token_writes()
    token_states = np.zeros((len(store_n), Hv, p.K, p.V))
    stores = {(n, t): i for i, (n, t) in enumerate(zip(store_n.tolist(), store_t.tolist()))}
    cap = _captured(p)
    for n, span in enumerate(p.spans):
        if not span.live:
            continue
        S = s0[n].copy()
        for t in range(span.start, span.end):
            kt = k[span.row, t][key_head]                      # [Hv, K]
            if lam is not None:
                S = np.exp(lam[span.row, t])[:, :, None] * S   # D_t S_{t-1}
            u = v[span.row, t] * (1.0 if w is None else w[span.row, t])
            if b is not None:
                u = u - np.einsum("hk,hkv->hv", b[span.row, t] * kt, S)
            S = S + kt[:, :, None] * u[:, None, :]
            i = t - span.start
            if cap is not None and i < cap.decay.shape[1]:
                if lam is not None:
                    cap.decay[n, i] = np.broadcast_to(np.exp(lam[span.row, t]), (Hv, p.K))[
                        :, : cap.decay.shape[2] // Hv].reshape(-1)
                cap.key[n, i], cap.delta[n, i], cap.count[n] = k[span.row, t], u, i + 1
            qt = q[span.row, t][query_heads]                   # [Hv, G, K]
            o[span.row, t] = p.scale * np.einsum("hgk,hkv->hgv", qt, S).reshape(p.Ho, p.V)
            i = stores.get((n, t - span.start))
            if i is not None:
                token_states[i] = S
        finals[n] = S
    return Solution(o, finals, token_states, cap)


def _captured(p: Problem) -> Captured | None:
    """The empty `Captured` of a call with a capture buffer (decay factors 1), else None."""
    if p.capture is None:
        return None
    C = p.capacity
    return Captured(decay=np.ones((p.N, C, p.decay_width)), key=np.zeros((p.N, C, p.Hk, p.K)),
                    delta=np.zeros((p.N, C, p.Hv, p.V)), count=np.zeros(p.N, dtype=np.int64))


def expected_capture(p: Problem, cap: Captured) -> np.ndarray:
    """The capture buffer [N, C * (Dw + Hk*K + Hv*V)] a call leaves, float64: the captured
    prefix of each sequence, NaN where the call writes nothing (past a sequence's count)."""
    C, N = p.capacity, p.N
    out = np.full((N, p.capture.shape[1]), np.nan)
    widths = (p.decay_width, p.Hk * p.K, p.Hv * p.V)
    base = 0
    for part, w in zip((cap.decay, cap.key, cap.delta), widths):
        view = out[:, base: base + C * w].reshape(N, C, w)
        for n, c in enumerate(cap.count.tolist()):
            view[n, :c] = part[n, :c].reshape(c, w)
        base += C * w
    return out


def store_capture(p: Problem, cap: Captured) -> None:
    """Write the captured prefix of each sequence into `p.capture` (float32, in place); the
    entries past a sequence's count are left as they were."""
    decay, key, delta = p.capture_parts()
    for n, c in enumerate(cap.count.tolist()):
        for part, values in ((decay, cap.decay), (key, cap.key), (delta, cap.delta)):
            part[n, :c] = torch.from_numpy(values[n, :c]).to(part.device, part.dtype)


def _log_decay(p: Problem) -> np.ndarray | None:
    """[B, T, Hv, K] (broadcastable) natural-log decay, or None without decay."""
    g, gk = _f64(p.g), _f64(p.gk)
    if p.A_log is not None:
        rate = -np.exp(_f64(p.A_log))
        if g is not None:
            g = rate * _softplus(g + _f64(p.dt_bias))
        else:
            gk = rate[:, None] * _softplus(gk + _f64(p.dt_bias))
    if g is None and gk is None:
        return None
    total = np.zeros((p.B, p.T, p.Hv, 1))
    if g is not None:
        total = total + g[..., None]
    if gk is not None:
        total = total + gk
    return total


def _erase_write(p: Problem) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Erase [B,T,Hv,K] and write [B,T,Hv,V] gates (broadcastable), None when absent."""
    if not p.retrieves:
        return None, None
    act = _sigmoid if p.beta_sigmoid else (lambda x: x)
    if p.beta is not None:
        beta = act(_f64(p.beta))[..., None]
        return beta, beta
    return act(_f64(p.erase)), act(_f64(p.write))


def _initial_states(p: Problem) -> np.ndarray:
    """[N, Hv, K, V] float64 starting state of each sequence (its read row)."""
    s0 = np.zeros((p.N, p.Hv, p.K, p.V))
    if p.initial_state is None:
        return s0
    init = _f64(p.initial_state)
    if p.state_layout == "vk":
        init = init.swapaxes(-1, -2)
    for n, span in enumerate(p.spans):
        if span.live:
            s0[n] = init[span.read]
    return s0


def expected_state(p: Problem, sol: Solution) -> torch.Tensor:
    """The returned state of the call in float64, in `p.state_layout`: the final states
    [N, Hv, ...], or with a slab the whole slab after the call (rows not addressed as
    they were, the final and per-token rows replaced)."""
    finals, tokens = torch.from_numpy(sol.finals), torch.from_numpy(sol.token_states)
    if p.state_layout == "vk":
        finals, tokens = finals.transpose(-1, -2), tokens.transpose(-1, -2)
    if not p.in_place:
        return finals
    slab = p.initial_state.detach().to("cpu", torch.float64).clone()
    p.plan.store(slab, finals, tokens)
    return slab


def differentiable(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, Ho, V], finals [N, Hv, K, V] K-major), float64 on p's device, computed
    from p's tensors by float64 torch ops that autograd follows back to them. For calls
    without a slab (the gradient path's contract); zero outputs where no sequence owns
    a token."""
    f64 = torch.float64
    x64 = lambda x: None if x is None else x.to(f64)  # noqa: E731
    q, k, v = x64(p.q), x64(p.k), x64(p.v)
    if p.qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + p.l2norm_eps)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + p.l2norm_eps)
    g, gk = x64(p.g), x64(p.gk)
    if p.A_log is not None:
        rate = -torch.exp(x64(p.A_log))
        if g is not None:
            g = rate * torch.nn.functional.softplus(g + x64(p.dt_bias))
        else:
            gk = rate[:, None] * torch.nn.functional.softplus(gk + x64(p.dt_bias))
    act = torch.sigmoid if p.beta_sigmoid else (lambda x: x)
    if p.beta is not None:
        b = w = act(x64(p.beta))[..., None]
    elif p.retrieves:
        b, w = act(x64(p.erase)), act(x64(p.write))
    else:
        b = w = None
    init = x64(p.initial_state)
    if init is not None and p.state_layout == "vk":
        init = init.transpose(-1, -2)

    Hv, G = p.Hv, p.G
    key_head = torch.arange(Hv, device=p.device) // (Hv // p.Hk)
    query_heads = key_head[:, None] if p.Hq <= p.Hv else torch.arange(p.Hq, device=p.device).reshape(Hv, G)
    owner = p.plan.owner()
    zero = q.new_zeros(p.Ho, p.V)
    rows = [[zero] * p.T for _ in range(p.B)]
    finals = []
    for n, span in enumerate(p.spans):
        S = q.new_zeros(Hv, p.K, p.V) if init is None else init[n]
        for t in range(span.start, span.end):
            kt = k[span.row, t][key_head]
            if g is not None or gk is not None:
                lam = 0.0
                if g is not None:
                    lam = lam + g[span.row, t][:, None]
                if gk is not None:
                    lam = lam + gk[span.row, t]
                S = torch.exp(lam)[:, :, None] * S
            u = v[span.row, t] if w is None else v[span.row, t] * w[span.row, t]
            if b is not None:
                u = u - torch.einsum("hk,hkv->hv", b[span.row, t] * kt, S)
            S = S + kt[:, :, None] * u[:, None, :]
            if owner[span.row * p.T + t] == n:
                qt = q[span.row, t][query_heads]
                rows[span.row][t] = p.scale * torch.einsum("hgk,hkv->hgv", qt, S).reshape(p.Ho, p.V)
        finals.append(S)
    o = torch.stack([torch.stack(r) for r in rows]) if p.T and p.B else q.new_zeros(p.B, p.T, p.Ho, p.V)
    finals = torch.stack(finals) if finals else q.new_zeros(0, Hv, p.K, p.V)
    # A call with no work (no sequence, no token) still answers in the graph, as every backend
    # does: its gradients are zeros, not missing. An empty slice of each input sums to an exact 0.
    anchor = sum(x.reshape(-1)[:0].sum() for x in p.differentiable_inputs()
                 if x is not None and x.requires_grad)
    return o + anchor, finals + anchor


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """The `reference` backend: `solve`, then the API's output dtype and state contract
    (the returned state in the state's storage dtype, rounded to nearest even). With
    inputs that require grad: `differentiable`, gradients by autograd in float64."""
    if p.requires_grad:
        o, finals = differentiable(p)
        if p.state_layout == "vk":
            finals = finals.transpose(-1, -2)
        return o.to(p.v.dtype), finals.to(p.state_dtype).contiguous()
    sol = solve(p)
    if sol.capture is not None:
        store_capture(p, sol.capture)
    o = torch.from_numpy(sol.o).to(p.v.device, p.v.dtype)
    if not p.in_place:
        return o, expected_state(p, sol).to(p.v.device, p.state_dtype).contiguous()
    finals, tokens = torch.from_numpy(sol.finals), torch.from_numpy(sol.token_states)
    if p.state_layout == "vk":
        finals, tokens = finals.transpose(-1, -2), tokens.transpose(-1, -2)
    p.plan.store(p.initial_state, finals, tokens)
    return o, p.initial_state
