"""The benchmarks (``make bench``, docs/benchmarks.md); not part of the wheel.

Run from the repository root: ``python -m benchmarks.bench``. Three parts: the ``harness``
(the package ``harness``: the targets it starts, a direct llama-server, llama.cpp's router
mode and llama-router, the processes it owns and the shared measurements, one concept a
module; with ``standin``, ``streamclient``, ``floorrelay``, ``floorstart`` and
``llama_cpp_suite``); the phases, each a module that imports the harness (``mainphase``,
``relay``, ``realmodel``, ``multiturn``, ``warmswap``, ``keptcache``, ``fairness``,
``bodies``, ``sharing``); and the runner (``bench``), which imports both. All import the
installed ``router`` package (its ``foundation``, ``llama``, ``host``, ``config`` and
``children``; with the ``tiny`` extra: gguf, numpy).
"""
