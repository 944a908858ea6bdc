"""Timing shared by the CPU benchmarks: medians over alternating blocks, so drift hits every candidate."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def alternate(fns: dict[str, Callable[[], None]], *, reps: int, block: int = 5) -> dict[str, float]:
    """Median seconds per call, alternating blocks of calls between the candidates (after one warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(max(1, reps // block)):
        for name, fn in fns.items():
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}
