"""The `triton` backend: fused Triton kernels for CUDA tensors.

The fused recurrence for decode and sequences up to RECURRENT_MAX_LEN tokens;
longer sequences run the chunked kernels (every gate form: scalar / per-key
decay, beta / erase + write). Varlen (`cu_seqlens`), ragged (`seq_lens`) and
padded-slab batches run unpacked when their spans are disjoint: the kernels
address each sequence's span of the [B * T] token axis (chunk indices
computed once on the host), so a long sequence beside short ones costs no
padding. Both read the initial state where it lies (any
layout, strided) and, with `state_indices`, update the slab rows in place
(a negative index: the row is never touched, the output is zero).
Runs on CPU tensors under `TRITON_INTERPRET=1` (for tests), which must be set
before the first call imports the kernel module.
"""

from __future__ import annotations

import os

import torch

from ..problem import Problem
from . import _prepare
from ._features import EVERYTHING
from .triton_chunked_support import chunked_supported

NAME = "triton"
DESCRIPTION = "fused Triton recurrence (decode, short sequences) + chunked prefill"
RECURRENT_MAX_LEN = 64
SUPPORTS = dict(
    EVERYTHING,
    devices="CUDA tensors (CPU under TRITON_INTERPRET=1)",
    note=(f"prefill longer than {RECURRENT_MAX_LEN} tokens runs chunked (64-token chunks, "
          "16-token sub-chunks for per-key decay); the slab is updated in place"),
)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or _interpreting()


def supports(p: Problem) -> str | None:
    if p.device.type != "cuda" and not _interpreting():
        return f"CUDA tensors only (or TRITON_INTERPRET=1), got device {p.device}"
    if p.max_len > RECURRENT_MAX_LEN:
        reason = chunked_supported(p)
        if reason is not None:
            return f"{reason}; the fused recurrence takes at most {RECURRENT_MAX_LEN}"
    return None


def flat_spans(p: Problem) -> list[tuple[int, int, int]] | None:
    """(first token in the flat [B * T] axis, length, slot) of every non-padding sequence, when
    they are disjoint (the kernels then read and write the caller's token layout directly); None
    when clamped `cu_seqlens` make spans overlap (then the later one must win: packed path)."""
    kept = [(s.row * p.T + s.start, max(s.length, 0), s.slot) for s in p.spans if s.slot >= 0]
    busy = sorted((a, n) for a, n, _ in kept if n > 0)
    if any(a0 + n0 > a1 for (a0, n0), (a1, _) in zip(busy, busy[1:])):
        return None
    return kept


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels.triton_recurrent import recurrent

    identity = not p.varlen and all(s.slot >= 0 for s in p.spans)
    flat = None if identity else flat_spans(p)
    # varlen / ragged / padded batches with disjoint spans: no packing, the kernels address the
    # spans of the [B * T] token axis (chunk indices computed once); else packed [N, L]
    pk = _prepare.Packing(L=p.T, identity=True) if flat is not None else _prepare.pack(p)
    x = _prepare.operands(p, pk, gather_states=False)     # the kernels read the states where they lie
    seqs = flat if flat is not None else [(None, None, s.slot) for s in p.spans]
    idx = None
    if p.in_place:                                        # slab rows, -1 for padding: updated in place
        idx = torch.tensor([slot for _, _, slot in seqs], dtype=torch.int64, device=p.device)
    kernel = recurrent
    if p.max_len > RECURRENT_MAX_LEN:
        from ..kernels.triton_chunked import chunked as kernel
    o, S = kernel(x.q, x.k, x.v, x.lam, x.b, x.w, p.initial_state, p.scale,
                  state_indices=idx, state_layout=p.state_layout,
                  spans=None if flat is None else [(a, n) for a, n, _ in flat])
    if p.in_place:
        return _prepare.finish(p, pk, o, None)
    # a new state in the caller's layout; finish takes a K-major view
    return _prepare.finish(p, pk, o, S if p.state_layout == "kv" else S.transpose(-1, -2))
