"""The benchmark harness (``make bench``, docs/benchmarks.md); not part of the wheel.

Run from the repository root: ``python -m benchmarks.bench``. ``bench`` measures a direct
llama-server, llama.cpp's router mode and llama-router; ``sharing`` is its CPU-sharing phase.
Both import the installed ``router`` package (with the ``tiny`` extra: gguf, numpy).
"""
