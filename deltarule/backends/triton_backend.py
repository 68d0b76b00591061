"""The `triton` backend: fused Triton kernels for CUDA tensors.

The fused recurrence for decode and sequences up to RECURRENT_MAX_LEN tokens;
longer sequences run the chunked kernels (every gate form: scalar / per-key
decay, beta / erase + write). Both read the initial state where it lies (any
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


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels.triton_recurrent import recurrent

    pk = _prepare.pack(p)
    x = _prepare.operands(p, pk, gather_states=False)     # the kernels read the states where they lie
    idx = None
    if p.in_place:                                        # slab rows, -1 for padding: updated in place
        idx = torch.tensor([s.slot for s in p.spans], dtype=torch.int64, device=p.device)
    kernel = recurrent
    if p.max_len > RECURRENT_MAX_LEN:
        from ..kernels.triton_chunked import chunked as kernel
    o, S = kernel(x.q, x.k, x.v, x.lam, x.b, x.w, p.initial_state, p.scale,
                  state_indices=idx, state_layout=p.state_layout)
    if p.in_place:
        return _prepare.finish(p, pk, o, None)
    # a new state in the caller's layout; finish takes a K-major view
    return _prepare.finish(p, pk, o, S if p.state_layout == "kv" else S.transpose(-1, -2))
