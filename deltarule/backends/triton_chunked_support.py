"""Which problems the triton backend's chunked prefill (`kernels.triton_chunked`) takes.

Every gate form of the contract: scalar log decay `g`, per-key `gk`, both
(raw arm included) or none; scalar `beta`, channel-wise `erase` / `write`, or
none. Nothing is declined today; the function stays the one place the backend
asks, so that a future restriction has a home and a reason.
"""

from __future__ import annotations

from ..problem import Problem


def chunked_supported(p: Problem) -> str | None:
    """None if the chunked Triton prefill can run `p`, else the reason it cannot."""
    return None
