"""What the benchmarks share: the median of repeated wall-clock timings."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


#: The clocks a benchmark may time by: wall-clock seconds, or the CPU seconds of this process (all its threads),
#: which a busy machine's other processes hardly move (run one thread each: NUMBA_NUM_THREADS=1
#: OPENBLAS_NUM_THREADS=1, so that no thread spins waiting for a descheduled peer).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def median_time(fn: Callable[[], object], repeat: int, clock: str = "wall") -> float:
    """Median seconds of `repeat` calls of fn, on `clock` (:data:`CLOCKS`)."""
    now = CLOCKS[clock]
    times = []
    for _ in range(repeat):
        t0 = now()
        fn()
        times.append(now() - t0)
    return statistics.median(times)
