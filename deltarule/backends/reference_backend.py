"""The `reference` backend: the float64 NumPy oracle behind the API contract."""

from __future__ import annotations

from .. import reference
from ..problem import Problem
from ._features import EVERYTHING

NAME = "reference"
DESCRIPTION = "float64 NumPy token-by-token recurrence, the oracle (slow)"
SUPPORTS = dict(EVERYTHING, devices="CPU computation (NumPy float64); tensors on any device",
                gradients="float64 torch autograd through the token loop (the oracle), every non-slab call")


def unavailable() -> str | None:
    return None             # NumPy only: runs wherever deltarule imports


def available() -> bool:
    return True


def supports(p: Problem) -> str | None:
    return None


run = reference.run
