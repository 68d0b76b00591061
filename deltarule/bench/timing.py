"""Wall-clock timing: one untimed warm-up call, then repeats within a time budget."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Timing:
    """The warm-up call's return value and the timed repeats, in seconds."""

    result: Any
    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def measure(fn: Callable[[], Any], repeat: int, budget: float) -> Timing:
    """Call `fn` once untimed, then time it up to `repeat` times.

    Repeats stop early once `budget` seconds have gone by (at least one timed
    call always runs), so a case of several seconds costs a couple of calls
    while a decode step gets the full `repeat`. The warm-up's return value is
    kept for checking the result outside the timed region.
    """
    result = fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < repeat:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if time.perf_counter() - start >= budget:
            break
    return Timing(result, samples)
