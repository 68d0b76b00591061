"""The float64 oracle: the recurrence of DESIGN.md section 1, token by token.

Straight from the formula, in NumPy float64, one sequence at a time; every
other backend is tested against `solve`. Slow by design.
"""

from __future__ import annotations

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


def solve(p: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Run the recurrence in float64 without touching any input.

    Returns:
        o: [B, T, Ho, V] float64, zero where no sequence (or a padding one) wrote.
        states: [N, Hv, K, V] float64, K-major, the final state of each
            sequence in span order (zeros for padding sequences).
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
    states = np.zeros((p.N, Hv, p.K, p.V))
    for n, span in enumerate(p.spans):
        if span.slot < 0:
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
            qt = q[span.row, t][query_heads]                   # [Hv, G, K]
            o[span.row, t] = p.scale * np.einsum("hgk,hkv->hgv", qt, S).reshape(p.Ho, p.V)
        states[n] = S
    return o, states


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
    """[N, Hv, K, V] float64 starting state of each sequence."""
    s0 = np.zeros((p.N, p.Hv, p.K, p.V))
    if p.initial_state is None:
        return s0
    init = _f64(p.initial_state)
    if p.state_layout == "vk":
        init = init.swapaxes(-1, -2)
    for n, span in enumerate(p.spans):
        if span.slot >= 0:
            s0[n] = init[span.slot]
    return s0


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """The `reference` backend: `solve`, then the API's output dtype and state contract."""
    o64, states64 = solve(p)
    o = torch.from_numpy(o64).to(p.v.device, p.v.dtype)
    states = torch.from_numpy(states64).to(p.v.device, torch.float32)
    if p.state_layout == "vk":
        states = states.transpose(-1, -2)
    if not p.in_place:
        return o, states.contiguous()
    slab = p.initial_state
    for n, span in enumerate(p.spans):
        if span.slot >= 0:
            slab[span.slot].copy_(states[n])
    return o, slab
