"""The `triton` backend: fused Triton kernels for CUDA tensors.

For now only the fused recurrence (decode and sequences up to
RECURRENT_MAX_LEN tokens); longer prefill is declined so that `auto` moves on.
Runs on CPU tensors under `TRITON_INTERPRET=1` (for tests), which must be set
before the first call imports the kernel module.
"""

from __future__ import annotations

import os

import torch

from ..problem import Problem
from . import _prepare
from ._features import EVERYTHING

NAME = "triton"
DESCRIPTION = "fused Triton recurrence (decode, short sequences); chunked prefill to come"
RECURRENT_MAX_LEN = 64
SUPPORTS = dict(
    EVERYTHING,
    devices="CUDA tensors (CPU under TRITON_INTERPRET=1)",
    note=f"prefill longer than {RECURRENT_MAX_LEN} tokens is declined for now",
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
        return (f"chunked Triton prefill not implemented yet: a sequence of {p.max_len} tokens "
                f"exceeds the fused recurrence's {RECURRENT_MAX_LEN}")
    return None


def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels.triton_recurrent import recurrent

    pk = _prepare.pack(p)
    x = _prepare.operands(p, pk)
    init = p.initial_state
    owned = init is None or x.S0.untyped_storage().data_ptr() != init.untyped_storage().data_ptr()
    # a gathered or zero-filled S0 is ours to update in place; the caller's never is
    o, S = recurrent(x.q, x.k, x.v, x.lam, x.b, x.w, x.S0, p.scale, S=x.S0 if owned else None)
    return _prepare.finish(p, pk, o, S)
