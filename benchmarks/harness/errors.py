"""What ends a benchmark run: a target that fails, a measurement that cannot be taken."""

from __future__ import annotations


class BenchError(RuntimeError):
    pass
