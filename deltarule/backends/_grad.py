"""Shared pieces of the gradient path (docs/design.md section 2, "Gradients").

A call whose inputs require grad runs in three parts:

1. the preprocessing in float32 torch ops that autograd follows: `qk_l2norm`,
   the raw-gate arm, `beta_sigmoid`, the state's layout and dtype
   (`differentiable_operands`, from `_prepare`);
2. the recurrence as one `torch.autograd.Function` per backend, whose
   backward is that backend's reverse kernel;
3. the output's dtype and the state's layout and dtype (`differentiable_state`).

Only the recurrence is a kernel: the rest is elementwise and cheap beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..problem import Problem
from . import _prepare


@dataclass
class Operands:
    """float32 operands in the API's token layout, each still attached to autograd:
    q [B, T, Hq/G, G, K], k [B, T, Hk, K], v [B, T, Hv, V], g None | [B, T, Hv],
    gk None | [B, T, Hv, K] (log decays, raw arm applied), b None | [B, T, Hv] |
    [B, T, Hv, K], w None | [B, T, Hv] | [B, T, Hv, V] (b itself with scalar beta),
    S0 None | [N, Hv, K, V] (K-major)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor | None
    gk: torch.Tensor | None
    b: torch.Tensor | None
    w: torch.Tensor | None
    S0: torch.Tensor | None


def differentiable_operands(p: Problem) -> Operands:
    f32 = torch.float32
    contiguous = lambda x: None if x is None else x.to(f32).contiguous()  # noqa: E731
    q, k = _prepare.normalized_qk(p)
    g, gk = _prepare.log_decays(p)
    b, w = _prepare.update_gates(p)
    b_c = contiguous(b)
    S0 = None if p.initial_state is None else _prepare.initial_states(p)
    return Operands(q=contiguous(q).view(p.B, p.T, p.Hq // p.G, p.G, p.K), k=contiguous(k), v=contiguous(p.v),
                    g=contiguous(g), gk=contiguous(gk), b=b_c, w=b_c if w is b else contiguous(w), S0=S0)


def differentiable_state(p: Problem, S: torch.Tensor) -> torch.Tensor:
    """[N, Hv, K, V] float32 K-major -> the returned state's layout and dtype."""
    if p.state_layout == "vk":
        S = S.transpose(-1, -2)
    return S.to(p.state_dtype).contiguous()


def head_sums(p: Problem, dq, dk):
    """Per-state-head dq [B, T, Hv, G, K] and dk [B, T, Hv, K] -> the gradients of q
    [B, T, Hq/G, G, K] and k [B, T, Hk, K]: heads that share a query or key head sum."""
    Hq1 = p.Hq // p.G
    if dq is not None and Hq1 != p.Hv:
        dq = dq.view(p.B, p.T, Hq1, p.Hv // Hq1, p.G, p.K).sum(3)
    if p.Hk != p.Hv:
        dk = dk.view(p.B, p.T, p.Hk, p.Hv // p.Hk, p.K).sum(3)
    return dq, dk
