"""The `reference` backend: the float64 NumPy oracle behind the API contract."""

from __future__ import annotations

from .. import reference
from ..problem import Problem

NAME = "reference"
DESCRIPTION = "float64 NumPy token-by-token recurrence, the oracle (slow)"
SUPPORTS = {
    "devices": "CPU computation (NumPy float64); tensors on any device",
    "rules": "linear, gated, delta, gated_delta",
    "decay": "g, gk, g + gk, raw-gate arm (A_log, dt_bias)",
    "update": "beta, erase + write, beta_sigmoid",
    "heads": "GVA (Hv multiple of Hk), GQA (Hq multiple of Hv)",
    "batching": "dense, cu_seqlens, seq_lens, state slab (state_indices)",
    "dtypes": "float32, float16, bfloat16 inputs; float32 state",
}


def available() -> bool:
    return True


def supports(p: Problem) -> str | None:
    return None


run = reference.run
