"""Wall-clock timing: warm-up calls, then repeats within a time budget.

Short calls are timed in batches: a sample is the mean of as many back-to-back
calls as fill BATCH_SECONDS, so that a 0.1 ms decode step is not measured by
one perf_counter pair among the machine's noise, and every implementation of a
case (deltarule and each peer) is warmed up and sampled the same way. (With
2 ms batches, a 5 ms decode was one call after another implementation's batch
had evicted its states: +-55 % over rounds; 10 ms batches.)

`interleaved` times several implementations of one case in rounds: each round
takes one batch of every implementation, in an order rotated round to round, with
a pause before each batch. A slow phase of the machine (another process, a clock
change) then falls on every implementation alike, and a ratio of two is taken
per round (`Timing.ratios`), so its spread over rounds says how far to trust it.
The pause lets threads that spin after a call (ONNX Runtime's intra-op pool,
OpenMP's, deltarule's helpers) go to sleep, so that one implementation's spinning
does not slow the next one's batch on a machine with few cores.
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
BATCH_SECONDS = 0.01
# ... and this long on a busy machine (`deltarule bench --load`): a scheduler quantum there (a
# descheduled thread, 1-12 ms on the 2-core VM) is then a tenth of a sample at most, and a
# sample is the mean cost of a call, stalls included (with 10 ms batches of a few slow calls a
# single stall decided a sample: per-round ratios spread over 100x).
LOADED_BATCH_SECONDS = 0.1
# `interleaved`: the pause before each batch (spinning threads go idle within it).
PAUSE_SECONDS = 0.02


@dataclass
class Timing:
    """The first call's return value and the timed samples (seconds per call)."""

    result: Any
    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def ratios(self, other: "Timing") -> list[float]:
        """self / other, round by round (samples of `interleaved` with the same index were
        taken in the same round)."""
        return [a / b for a, b in zip(self.samples, other.samples)]


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


def interleaved(fns: dict[str, Callable[[], Any]], repeat: int, budget: float,
                batch_seconds: float = BATCH_SECONDS) -> dict[str, Timing]:
    """Time every callable of `fns` in up to `repeat` rounds (module docstring): each is warmed up
    in turn as `measure` does (its first return value kept), then every round takes one batch of
    each (of calls lasting at least `batch_seconds`), in the order rotated by one per round,
    after a PAUSE_SECONDS sleep. Rounds stop once
    `budget` seconds per callable have gone by (at least one round always runs). Every Timing
    has the same number of samples, the i-th from round i."""
    names = list(fns)
    results, batches = {}, {}
    for name in names:
        fn = fns[name]
        start = time.perf_counter()
        results[name] = fn()
        calls = 1
        while time.perf_counter() - start < WARMUP_SECONDS:
            fn()
            calls += 1
        batches[name] = max(1, math.ceil(batch_seconds / ((time.perf_counter() - start) / calls)))
    samples: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for round_ in range(repeat):
        for i in range(len(names)):
            name = names[(round_ + i) % len(names)]
            fn, batch = fns[name], batches[name]
            time.sleep(PAUSE_SECONDS)
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            samples[name].append((time.perf_counter() - t0) / batch)
        if time.perf_counter() - start >= budget * len(names):
            break
    return {name: Timing(results[name], samples[name]) for name in names}


@dataclass
class Paired:
    """`paired`'s medians: of a's calls, of b's calls and of a - b, call pair by call pair (s)."""

    a: float
    b: float
    difference: float


def paired(a: Callable[[], Any], b: Callable[[], Any], budget: float, pairs: int = 2000) -> Paired:
    """Times `a` and `b` alternated call by call, each call by its own clock pair, for up to
    `pairs` pairs or `budget` seconds (after WARMUP_SECONDS of both): the difference of two
    calls that find the same caches and threads in the same state. What `deltarule bench` takes
    a call's overhead over its kernel from (a few microseconds, below the spread of separate
    batches)."""
    start = time.perf_counter()
    while time.perf_counter() - start < WARMUP_SECONDS:
        a()
        b()
    times_a, times_b = [], []
    clock = time.perf_counter
    start = clock()
    while len(times_a) < pairs and (not times_a or clock() - start < budget):
        t0 = clock()
        a()
        t1 = clock()
        b()
        t2 = clock()
        times_a.append(t1 - t0)
        times_b.append(t2 - t1)
    return Paired(statistics.median(times_a), statistics.median(times_b),
                  statistics.median(x - y for x, y in zip(times_a, times_b)))
