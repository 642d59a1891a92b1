"""The numbers of a measurement: percentiles, summaries in milliseconds, the rotating order
of interleaved rounds, a sample taken with the garbage collector off, and the megabyte."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence

MB = 1_000_000


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values]
    return {"n": len(ms), "p50": percentile(ms, 50), "p90": percentile(ms, 90),
            "p99": percentile(ms, 99), "mean": sum(ms) / len(ms), "min": min(ms),
            "max": max(ms)}


def rotate(seq: Sequence[str], by: int) -> list[str]:
    by %= len(seq)
    return [*seq[by:], *seq[:by]]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
