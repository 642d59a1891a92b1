"""Shared fixtures: the real llama-server binary and tiny generated models."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.flags import FlagTable, parse_help
from router.install import InstallError, find_llama_server
from router.tinymodel import write_tiny_model

TESTS = Path(__file__).parent


@pytest.fixture(scope="session")
def help_table() -> FlagTable:
    """The flag table of llama-server b11434, from its recorded --help (no binary needed)."""
    return FlagTable(parse_help((TESTS / "data" / "llama-server-help.txt").read_text()))


@pytest.fixture(scope="session")
def llama_server() -> Path:
    """The real binary. Missing is a failure, not a skip: `make test` builds it first."""
    try:
        return find_llama_server()
    except InstallError as exc:
        pytest.fail(f"real llama-server needed: {exc}")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("models")
    return {name: write_tiny_model(directory / f"{name}.gguf", seed=seed, name=name)
            for seed, name in enumerate(["alpha", "beta", "gamma", "embed"], start=1)}
