"""The `triton` backend: fused Triton kernels for CUDA tensors.

The fused recurrence for decode and sequences up to RECURRENT_MAX_LEN tokens;
longer sequences run the chunked kernels, for scalar gates only so far (per-key
decay and erase / write are declined there so that `auto` moves on).
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
DESCRIPTION = "fused Triton recurrence (decode, short sequences) + chunked prefill (scalar gates)"
RECURRENT_MAX_LEN = 64
SUPPORTS = dict(
    EVERYTHING,
    devices="CUDA tensors (CPU under TRITON_INTERPRET=1)",
    note=(f"prefill longer than {RECURRENT_MAX_LEN} tokens runs chunked, scalar g and beta only; "
          "per-key gk and erase / write gates are declined there for now"),
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
    x = _prepare.operands(p, pk)
    init = p.initial_state
    owned = init is None or x.S0.untyped_storage().data_ptr() != init.untyped_storage().data_ptr()
    # a gathered or zero-filled S0 is ours to update in place; the caller's never is
    kernel = recurrent
    if p.max_len > RECURRENT_MAX_LEN:
        from ..kernels.triton_chunked import chunked as kernel
    o, S = kernel(x.q, x.k, x.v, x.lam, x.b, x.w, x.S0, p.scale, S=x.S0 if owned else None)
    return _prepare.finish(p, pk, o, S)
