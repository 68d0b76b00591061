"""The `triton` backend: fused Triton kernels for CUDA tensors.

The fused recurrence for decode and sequences up to RECURRENT_MAX_LEN tokens;
longer sequences run the chunked kernels (every gate form: scalar / per-key
decay, beta / erase + write). Varlen (`cu_seqlens`), ragged (`seq_lens`) and
padded-slab batches run unpacked when their spans are disjoint: the kernels
address each sequence's span of the [B * T] token axis (chunk indices
computed once on the host), so a long sequence beside short ones costs no
padding. Both read the initial state where it lies (any
layout, strided) and, with `state_indices`, update the slab rows in place
(a negative index: the row is never touched, the output is zero). The
kernels take the operands as given and fuse the preprocessing: the raw-gate
arm, `beta_sigmoid` and `qk_l2norm`.
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


def token_layout(p: Problem, packed: bool = False) -> tuple[_prepare.Packing, list | None, list[int]]:
    """(packing, spans, slots) of a call. spans: None when the sequences are the rows of
    [B, T], else (first token, length) per sequence in the kernels' flat token axis; slots:
    the slab row (or sequence index; negative: padding) of each sequence the kernels run.

    Varlen / ragged / padded batches with disjoint spans run unpacked: the kernels address
    the spans of the [B * T] token axis (chunk indices computed once). Clamped cu_seqlens
    whose spans overlap (or `packed`) are packed into [N, L] rows, each run for its own
    length only: the kernels fuse the raw-gate arm, so a padded step would not be identity.
    """
    identity = not p.varlen and all(s.slot >= 0 for s in p.spans)
    flat = None if identity or packed else flat_spans(p)
    if flat is not None:
        return _prepare.Packing(L=p.T, identity=True), [(a, n) for a, n, _ in flat], [slot for *_, slot in flat]
    pk = _prepare.Packing(L=p.T, identity=True) if identity and not packed else _prepare.pack(p)
    slots = [s.slot for s in p.spans]
    if pk.identity:
        return pk, None, slots
    return pk, [(n * pk.L, max(s.length, 0)) for n, s in enumerate(p.spans)], slots


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels.triton_recurrent import recurrent

    pk, spans, slots = token_layout(p)
    x = _prepare.raw_operands(p, pk)
    idx = None
    if p.in_place:                                        # slab rows, -1 for padding: updated in place
        idx = torch.tensor(slots, dtype=torch.int64, device=p.device)
    kernel = recurrent
    if p.max_len > RECURRENT_MAX_LEN:
        from ..kernels.triton_chunked import chunked as kernel
    o, S = kernel(x.q, x.k, x.v, x.g, x.gk, x.b, x.w, p.initial_state, p.scale,
                  A_log=p.A_log, dt_bias=p.dt_bias, beta_sigmoid=p.beta_sigmoid,
                  l2norm_eps=p.l2norm_eps if p.qk_l2norm else None,
                  state_indices=idx, state_layout=p.state_layout, spans=spans)
    if p.in_place:
        return _prepare.finish(p, pk, o, None)
    # a new state in the caller's layout; finish takes a K-major view
    return _prepare.finish(p, pk, o, S if p.state_layout == "kv" else S.transpose(-1, -2))
