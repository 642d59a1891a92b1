"""Shared fixtures: the real llama-server binary and tiny generated models."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from router.flags import FlagTable, parse_help
from router.install import InstallError, find_llama_server
from router.tinymodel import write_tiny_model

pytest_plugins = ["browser"]

TESTS = Path(__file__).parent

# No test may reach the real Hugging Face Hub or see the developer's own HF cache: every test
# (and every router it starts) gets an empty cache and an endpoint nothing listens on, unless
# it points them at tests/fake_hub.py itself. huggingface-hub reads these at import time.
_HF_HOME = tempfile.mkdtemp(prefix="llama-router-tests-hf-")
os.environ["HF_HOME"] = _HF_HOME
os.environ["HF_HUB_CACHE"] = os.path.join(_HF_HOME, "hub")
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.pop("HF_TOKEN", None)


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
    models = {name: write_tiny_model(directory / f"{name}.gguf", seed=seed, name=name)
              for seed, name in enumerate(["alpha", "beta", "gamma", "embed"], start=1)}
    # A 32k training context: streams long enough to still be running when a test acts on
    # them, even on a fast machine (the model writes about 16k tokens/s).
    models["long"] = write_tiny_model(directory / "long.gguf", seed=9, name="long",
                                      n_ctx_train=32768)
    return models


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the test item (``browser.page`` screenshots failures)."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
