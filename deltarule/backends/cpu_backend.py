"""The `cpu` backend: a fused numba recurrence for decode and short sequences,
the torch chunked kernel for prefill. CPU tensors only."""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.chunked import chunked
from ..problem import Problem
from . import _prepare
from ._features import EVERYTHING

NAME = "cpu"
DESCRIPTION = "fused numba recurrence (decode, short sequences) + torch chunked prefill"
SUPPORTS = dict(EVERYTHING, devices="CPU tensors")
# Sequences up to this many tokens take the fused recurrence, longer ones the
# chunked kernel: on the 16-head K = V = 128 layer the fused recurrence wins up
# to T = 48 at B = 8 and ties at T = 64 for B = 1 (docs/performance.md).
RECURRENT_MAX_LEN = 48
# The chunk_size argument is a hint; on this CPU 32-token chunks measured 4-16 %
# faster than 64 on the bench.json prefill shapes (docs/performance.md).
CHUNK_SIZE = 32


def available() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def supports(p: Problem) -> str | None:
    if p.device.type != "cpu":
        return f"CPU tensors only, got device {p.device}"
    return None


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    pk = _prepare.pack(p)
    recurrent = pk.L <= RECURRENT_MAX_LEN
    # A K-major slab is read and written where it lies (no gather, no scatter).
    direct = recurrent and p.in_place and p.state_layout == "kv" and p.initial_state.is_contiguous()
    x = _prepare.operands(p, pk, gather_states=not direct)
    if direct:
        slab = p.initial_state
        slots = torch.tensor([s.slot for s in p.spans], dtype=torch.int64)
        o = _fused_recurrent(x, p.scale, slab, slab, slots, in_place=True)
        return _prepare.finish(p, pk, o, None)
    if recurrent:
        S = torch.empty_like(x.S0)
        o = _fused_recurrent(x, p.scale, x.S0, S, torch.arange(p.N), in_place=False)
    else:
        o, S = chunked(x.q, x.k, x.v, x.lam, x.b, x.w, x.S0, p.scale, CHUNK_SIZE)
    return _prepare.finish(p, pk, o, S)


def _fused_recurrent(x: _prepare.Operands, scale: float, S0, S, slots, *, in_place: bool):
    """o [N, L, H, G, V]; sequence n's final state lands in S[slots[n]]."""
    from ..kernels.cpu_recurrent import recurrent_steps

    N, L, H, V = x.v.shape
    G = x.q.shape[3]
    o = torch.empty(N, L, H, G, V, dtype=torch.float32)

    def gate(t):
        if t is None:
            return np.empty((0, 0, 0, 1), dtype=np.float32), False
        t = t if t.dim() == 4 else t.unsqueeze(-1)
        return t.contiguous().numpy(), True

    lam, has_lam = gate(x.lam)
    b, has_b = gate(x.b)
    w, has_w = gate(x.w)
    f32 = lambda t: t.to(torch.float32).contiguous().numpy()  # noqa: E731
    recurrent_steps(f32(x.q), f32(x.k), f32(x.v),
                    lam, b, w, S0.contiguous().numpy(), S.numpy(), slots.numpy(), o.numpy(),
                    np.float32(scale), has_lam, has_b, has_w, in_place)
    return o
