"""The benchmark harness (``make bench``, docs/benchmarks.md); not part of the wheel.

Run from the repository root: ``python -m benchmarks.bench``. ``bench`` measures a direct
llama-server, llama.cpp's router mode and llama-router on tiny generated models; its phases
with the real SmolLM2-135M-Instruct are ``realmodel`` (tokens/s, TTFT, identical output, swap)
and ``multiturn`` (conversations on two replicas: prefix vs least-busy routing); ``sharing`` is
its CPU-sharing phase. All import the installed ``router`` package (with the ``tiny`` extra:
gguf, numpy).
"""
