"""Descriptor ownership checks for tests: each descriptor has one owner that closes it once,
and one that an event loop watches is closed only through the loop (``remove_reader`` or the
transport's own close) first.

* ``watched()``: the descriptors this process has registered in an epoll instance: every
  event loop's (asyncio's selector, uvloop's libuv), read from ``/proc/self/fdinfo``. libuv
  hands a new registration to epoll on its next poll, so a descriptor registered in the same
  loop step as it is closed is not seen.
* ``CloseGuard``: while installed, every ``os.close(fd)`` of this process (any thread) is
  checked first and recorded as a violation, with where it was called, when ``fd`` is not
  open (a second close: had the number been reused, it would have closed another owner's
  descriptor) or is still watched by an epoll instance (closed underneath its loop: libuv
  then aborts, or refuses the number's next user with ``EEXIST``). The close happens anyway,
  as asked: the guard observes, it does not repair.
* Run as a launcher, ``python fdcheck.py -m module args...`` runs ``module`` as ``python -m``
  would, with a ``CloseGuard`` installed for the whole process; each violation is written to
  stderr at once as one ``fdcheck: violation: ...`` line followed by its stack
  (``start_router(..., launcher=launcher())`` runs a router so). Every ``ResourceWarning`` is
  one too: a file, socket or transport its owner never closed, closed by the garbage collector
  at some later time, in whichever thread collects (uvloop's transports, twice). A thread of
  the launcher's own collects garbage every ``COLLECT_S``, as any thread of the process may,
  so such leftovers are found within a run.

Closes made inside C code (a file object's, libuv's) do not pass through ``os.close`` and are
not seen: ``tests/test_descriptors.py`` counts those with strace.
"""

from __future__ import annotations

import errno
import gc
import os
import runpy
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

VIOLATION = "fdcheck: violation"
COLLECT_S = 0.5  # the launcher's garbage collection in a thread of its own
_EPOLL_LINK = "anon_inode:[eventpoll]"


def watched() -> set[int]:
    """Descriptors registered in any epoll instance of this process."""
    found: set[int] = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") != _EPOLL_LINK:
                continue
            with open(f"/proc/self/fdinfo/{name}") as info:
                lines = info.read().splitlines()
        except OSError:  # closed meanwhile (another thread, or listdir's own descriptor)
            continue
        found.update(int(line.split()[1]) for line in lines if line.startswith("tfd:"))
    return found


def open_descriptors() -> set[int]:
    """The descriptors open in this process now (less the one that listed them)."""
    return {fd for fd in map(int, os.listdir("/proc/self/fd")) if _is_open(fd)}


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


_real_close: Callable[[int], None] = os.close


class CloseGuard:
    """Checks every ``os.close`` while installed (see the module docstring)."""

    def __init__(self, report: Callable[[str], None] | None = None) -> None:
        self.violations: list[str] = []
        self.closes = 0  # checked closes, a sign the guard saw the code under test
        self._report = report
        self._lock = threading.Lock()

    def close(self, fd: int) -> None:
        problem = None
        try:
            os.fstat(fd)
        except OSError as exc:
            if exc.errno == errno.EBADF:
                problem = f"os.close({fd}): not open (closed twice?)"
        else:
            try:
                if fd in watched():
                    problem = f"os.close({fd}): an event loop still watches it"
            except OSError as exc:  # never the caller's failure
                problem = (f"os.close({fd}): could not list the watched descriptors ({exc}): "
                           f"the listing's own descriptor closed underneath it?")
        if problem is not None:
            text = f"{problem}\n{''.join(traceback.format_stack(limit=12)[:-1])}"
            with self._lock:
                self.violations.append(text)
            if self._report is not None:
                self._report(text)
        with self._lock:
            self.closes += 1
        _real_close(fd)

    def install(self) -> None:
        os.close = self.close

    def uninstall(self) -> None:
        os.close = _real_close


def launcher() -> list[str]:
    """``start_router``'s ``launcher``: this interpreter running this file, so the router runs
    with a ``CloseGuard`` reporting to its log."""
    return [sys.executable, str(Path(__file__).resolve())]


def _report_to_stderr(text: str) -> None:
    sys.stderr.write(f"{VIOLATION}: {text}\n")
    sys.stderr.flush()


def _collect_forever(interval: float) -> None:
    """Collect garbage in this thread every ``interval`` s, as any thread of the process
    may: a descriptor left to the collector is then closed here, away from its loop."""
    while True:
        time.sleep(interval)
        gc.collect()


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "-m":
        raise SystemExit("usage: fdcheck.py -m module [args...]")
    CloseGuard(_report_to_stderr).install()
    show = warnings.showwarning

    def unclosed(message: Warning | str, category: type[Warning], *rest: Any) -> None:
        if issubclass(category, ResourceWarning):  # an owner that never closed it
            _report_to_stderr(f"left to the garbage collector: {message}")
        else:
            show(message, category, *rest)

    warnings.showwarning = unclosed
    warnings.simplefilter("always", ResourceWarning)
    threading.Thread(target=_collect_forever, args=(COLLECT_S,), name="fdcheck-gc",
                     daemon=True).start()
    sys.path[0] = os.getcwd()  # as ``python -m``: the working directory, not tests/
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
