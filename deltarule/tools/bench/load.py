"""`deltarule bench --load N`: N processes that spin on the CPU for the whole run, so that a
measurement on a busy machine (a server sharing its cores with other jobs) can be reproduced.

Each is a separate Python interpreter running `while True: pass` (a process, not a thread:
no GIL shared with the benchmark, and the scheduler treats it as the other jobs of a shared
machine), started before the first case and killed when the run ends, also on an error or
Ctrl-C.

    >>> from deltarule.tools.bench.load import busy
    >>> with busy(1) as spinners:
    ...     len(spinners)
    1
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from typing import Iterator

SPIN = "while True: pass"
# The spinners are given this long to start before the run's first timing.
SETTLE_SECONDS = 0.2


@contextlib.contextmanager
def busy(n: int) -> Iterator[list[subprocess.Popen]]:
    """Runs the body while `n` (>= 0) processes spin; yields their Popen handles."""
    spinners: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            spinners.append(subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if n:
            time.sleep(SETTLE_SECONDS)
        yield spinners
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
