"""Which problems the triton backend's chunked prefill (`kernels.triton_chunked`) takes.

The chunked kernels handle scalar gates only: scalar log decay `g` (raw arm
included) or none, and scalar `beta` or none. Per-key decay (`gk`, alone or
with `g`) and channel-wise `erase` / `write` gates are declined with a reason,
so that `backend="auto"` moves on for prefill longer than the fused recurrence
takes.
"""

from __future__ import annotations

from ..problem import Problem

PREFIX = "chunked Triton prefill not implemented yet"


def chunked_supported(p: Problem) -> str | None:
    """None if the chunked Triton prefill can run `p`, else the reason it cannot."""
    if p.gk is not None:
        what = "per-key decay gk" + (" (with g)" if p.g is not None else "")
        return f"{PREFIX} for {what}: scalar decay g only (sequence of {p.max_len} tokens)"
    if p.retrieves and (p.erase is not None or p.write is not None):
        return (f"{PREFIX} for channel-wise erase / write gates: scalar beta only "
                f"(sequence of {p.max_len} tokens)")
    return None
