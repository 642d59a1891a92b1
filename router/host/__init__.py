"""What this machine has: memory and its estimate for a model (``memory``), NVIDIA GPUs
(``gpus``), CPU cores and how children share them (``cpus``), file descriptors (``fdlimit``),
and the systemd notify protocol (``systemd``).

It owns no state of the router's: it measures and parses. It may import ``foundation`` and
``llama`` (a model's memory depends on its GGUF header and its llama-server flags).
"""
