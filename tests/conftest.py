"""Shared fixtures (the real llama-server binary, tiny generated models) and the tier guard:
a test that starts a process must carry a process marker."""

from __future__ import annotations

import _posixsubprocess
import gc
import inspect
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from router.llama.flags import FlagTable, parse_help
from router.llama.install import InstallError, find_llama_server
from router.llama.tinymodel import write_tiny_model

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


@pytest.fixture(autouse=True)
def _collect_what_an_async_test_leaves(request: pytest.FixtureRequest) -> Iterator[None]:
    """Once an async test's event loop is closed, collect the garbage: what the test left open
    on that loop (a transport, a pipe, a socket: a cycle with its protocol, so only the
    collector frees it) then warns, and fails, in this test's teardown, and not in whichever
    later test the collector happens to run in. A child's output pipes left open by
    test_spawn.py's last test failed test_sse.py's HEAD test that way ("multiple unraisable
    exception warnings": two ``_UnixReadPipeTransport`` and their files), the next test to
    allocate much. Autouse fixtures are set up first, so this one is torn down after the
    test's event loop (pytest-asyncio's runner fixture)."""
    yield
    if inspect.iscoroutinefunction(getattr(request.node, "obj", None)):
        gc.collect()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the test item (``browser.page`` screenshots failures)."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


# The test tiers (docs/development.md#test-tiers): a test that starts any process carries one of
# these markers, so that `make test-fast` (`-m 'not real and not fake and not process'`) runs no
# process at all. Unmarked tests are refused every way of starting one.
PROCESS_MARKERS = ("real", "fake", "process")


class UnmarkedProcessError(RuntimeError):
    """Raised where an unmarked test starts a process."""


def _refusal(item: pytest.Item, what: str) -> str:
    return (f"{item.nodeid} started a process ({what}) without a process marker: mark it "
            "`@pytest.mark.process` (or `pytestmark = pytest.mark.process` for the whole file); "
            "`real` if that process is (or starts) the real llama-server, `fake` if it is (or "
            "starts) tests/fake_llama_server.py (docs/development.md#test-tiers)")


@contextmanager
def _no_processes(item: pytest.Item) -> Iterator[None]:
    """Within an unmarked test's setup, call or teardown, starting a process fails the test.

    The attempt raises where it happens and is also recorded, so that the test fails even where
    the code under test catches that exception (say, as an ``OSError`` from a missing tool)."""
    if any(item.get_closest_marker(name) for name in PROCESS_MARKERS):
        yield
        return
    attempts: list[str] = []

    def refuse(what: str) -> UnmarkedProcessError:
        attempts.append(what)
        return UnmarkedProcessError(_refusal(item, what))

    def execute_child(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        __tracebackhide__ = True
        raise refuse(f"subprocess {args!r}")

    def low_level(name: str) -> Any:
        def refused(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            shown = f" {args[0]!r}" if args and name != "os.fork" else ""
            raise refuse(f"{name}{shown}")
        return refused

    with pytest.MonkeyPatch.context() as patch:
        # Popen covers subprocess.run/check_output/..., os.popen and asyncio's subprocesses.
        patch.setattr(subprocess.Popen, "_execute_child", execute_child)
        # What does not go through Popen: multiprocessing, os.system, fork and the os.spawn*
        # family (built on os.fork), posix_spawn.
        patch.setattr(_posixsubprocess, "fork_exec", low_level("_posixsubprocess.fork_exec"))
        for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                patch.setattr(os, name, low_level(f"os.{name}"))
        try:
            yield
        except (UnmarkedProcessError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            if attempts:
                raise UnmarkedProcessError(_refusal(item, attempts[0])) from exc
            raise
    if attempts:
        pytest.fail(_refusal(item, attempts[0]), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    # Setup too: a module- or session-scoped fixture that starts a router counts.
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _no_processes(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with _no_processes(item):
        return (yield)


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct's GGUF. Missing is a failure, not a skip: `make test` installs it."""
    from router.llama.smollm2 import INSTALL_HINT, find_smollm2

    path = find_smollm2()
    if path is None:
        pytest.fail(f"SmolLM2 is not installed: {INSTALL_HINT}")
    return path
