"""Wall-clock timing: warm-up calls, then repeats within a time budget.

Short calls are timed in batches: a sample is the mean of as many back-to-back
calls as fill BATCH_SECONDS, so that a 0.1 ms decode step is not measured by
one perf_counter pair among the machine's noise, and every implementation of a
case (deltarule and each peer) is warmed up and sampled the same way.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

# Warm-up: calls until this many seconds have passed (at least one): caches, thread
# pools and the CPU's clock settle; a single warm-up call left the first timed
# decode calls ~30 % slower on the 2-core VM.
WARMUP_SECONDS = 0.1
# A sample covers at least this long: calls shorter than that are timed in batches.
BATCH_SECONDS = 0.002


@dataclass
class Timing:
    """The first call's return value and the timed samples (seconds per call)."""

    result: Any
    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


def measure(fn: Callable[[], Any], repeat: int, budget: float) -> Timing:
    """Call `fn` to warm up, then take up to `repeat` samples of its time per call.

    Repeats stop early once `budget` seconds have gone by (at least one sample
    always runs), so a case of several seconds costs a couple of calls while a
    decode step gets the full `repeat`, each sample the mean of a batch of calls
    lasting at least BATCH_SECONDS. The first call's return value is kept for
    checking the result outside the timed region.
    """
    start = time.perf_counter()
    result = fn()
    calls = 1
    while time.perf_counter() - start < WARMUP_SECONDS:
        fn()
        calls += 1
    per_call = (time.perf_counter() - start) / calls
    batch = max(1, math.ceil(BATCH_SECONDS / per_call))
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < repeat:
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        samples.append((time.perf_counter() - t0) / batch)
        if time.perf_counter() - start >= budget:
            break
    return Timing(result, samples)
