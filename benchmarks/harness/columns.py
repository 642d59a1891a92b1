"""The three targets every table compares: their keys in the JSON report and their labels."""

from __future__ import annotations

DIRECT, LLAMACPP, ROUTER = "direct", "llamacpp_router", "llama_router"
COLUMNS = (DIRECT, LLAMACPP, ROUTER)
ROUTERS = (LLAMACPP, ROUTER)
LABELS = {DIRECT: "direct", LLAMACPP: "llama.cpp router", ROUTER: "llama-router"}
