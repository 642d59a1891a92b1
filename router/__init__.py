"""llama-router: one endpoint for many local GGUF models."""

import sys

# httpx imports its command-line client (click, pygments: about 0.5 MB of a serving router's
# RSS) unless that fails, when it defines a stub ``httpx.main``. The router never runs
# httpx's CLI (the ``httpx`` command is a process of its own, unaffected): skip it.
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
