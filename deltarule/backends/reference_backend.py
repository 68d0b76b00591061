"""The `reference` backend: the float64 NumPy oracle behind the API contract."""

from __future__ import annotations

from .. import reference
from ..problem import Problem

NAME = "reference"
DESCRIPTION = "float64 NumPy token-by-token recurrence, the oracle (slow)"


def available() -> bool:
    return True


def supports(p: Problem) -> str | None:
    return None


run = reference.run
