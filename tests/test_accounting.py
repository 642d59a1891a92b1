"""Memory accounting (router.core.accounting): estimates read once, except after a failure of the
moment (out of file descriptors), which is retried instead of costing the estimate for good.
Each estimate goes to the record's owner (``executor.note``), as the router's own do."""

from __future__ import annotations

import errno
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

import router.core.accounting as accounting_module
from router.config.presets import ModelPreset
from router.core.accounting import Accounting
from router.core.executor import note
from router.core.runtime import ModelRuntime
from router.logs import LogRing


def runtime_for(path: Path) -> ModelRuntime:
    preset = ModelPreset(id="m", args=MappingProxyType({"model": str(path)}))
    return ModelRuntime(preset, LogRing(10))


async def estimate(accounting: Accounting, runtime: ModelRuntime) -> int:
    """The model's estimate once its owner recorded what accounting read (if anything)."""
    estimated = await accounting.estimate(runtime)
    if estimated is not None:
        note(runtime, estimated)
    return runtime.estimate


async def test_an_estimate_is_read_once(tiny_models: dict[str, Path],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = accounting_module.estimate_for_args

    def counting(path: str, args: Any) -> Any:
        calls.append(path)
        return real(path, args)

    monkeypatch.setattr(accounting_module, "estimate_for_args", counting)
    accounting, runtime = Accounting([]), runtime_for(tiny_models["alpha"])
    first = await estimate(accounting, runtime)
    assert first > 0 and await estimate(accounting, runtime) == first
    assert len(calls) == 1


@pytest.mark.parametrize(("error", "retried"), [
    (OSError(errno.EMFILE, "Too many open files"), True),
    (OSError(errno.ENOENT, "No such file or directory"), False),
])
async def test_a_failure_of_the_moment_is_retried(tiny_models: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  error: OSError, retried: bool) -> None:
    real = accounting_module.estimate_for_args
    failures = [error]

    def flaky(path: str, args: Any) -> Any:
        if failures:
            # As memory.py reports it: a ValueError caused by the OSError.
            raise ValueError(f"{path}: not a GGUF file ({error})") from failures.pop()
        return real(path, args)

    monkeypatch.setattr(accounting_module, "estimate_for_args", flaky)
    accounting, runtime = Accounting([]), runtime_for(tiny_models["alpha"])
    assert await estimate(accounting, runtime) == 0  # unknown this time
    assert runtime.estimate_due is retried  # ``Accounting.run`` reads it again
    assert (await estimate(accounting, runtime) > 0) is retried
