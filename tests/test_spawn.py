"""Starting children (``router.children.spawn``): pipes, exit codes, and death with the router, both
through ``setpriv`` (the fast path) and with a ``preexec_fn`` (where setpriv is missing)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from support import alive, wait_until

from router.children import spawn
from router.children.process import ChildProcess
from router.logs import LogRing

pytestmark = pytest.mark.process

SCRIPT = "echo out; echo err >&2; read line; echo \"got $line\"; exit 3"


@pytest.fixture(params=["setpriv", "preexec_fn"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "setpriv":
        assert spawn.death_wrapper() is not None, "this machine has no setpriv --pdeathsig"
    else:
        monkeypatch.setattr(spawn, "death_wrapper", lambda: None)
    yield request.param


def test_the_machine_has_the_fast_path() -> None:
    # The test machines (Debian, util-linux) have it; without it every spawn forks the router.
    assert spawn.death_wrapper() == ("/usr/bin/setpriv", "--pdeathsig", "KILL", "--")


def test_pipes_and_exit_code(path: str) -> None:
    async def run() -> tuple[bytes, bytes, int, int | None]:
        child = await spawn.spawn(["/bin/sh", "-c", SCRIPT], dict(os.environ))
        assert child.stdin is not None and child.stdout is not None
        assert child.stderr is not None
        assert await child.stdout.readline() == b"out\n"
        assert await child.stderr.readline() == b"err\n"
        child.stdin.write(b"hello\n")
        child.stdin.close()
        assert child.stdin.is_closing()
        code = await child.wait()
        rest = await child.stdout.read()
        return rest, await child.stderr.read(), code, child.returncode

    rest, err, code, returncode = asyncio.run(run())
    assert rest == b"got hello\n" and err == b""
    assert code == returncode == 3


def test_own_session_and_environment(path: str) -> None:
    async def run() -> tuple[bytes, int]:
        child = await spawn.spawn(["/bin/sh", "-c", "echo $$ $(ps -o sid= -p $$) $MARK"],
                                  {"PATH": os.environ["PATH"], "MARK": "m-1"})
        assert child.stdout is not None
        out = await child.stdout.read()
        await child.wait()
        return out, child.pid

    out, pid = asyncio.run(run())
    own, session, mark = out.split()
    assert int(own) == int(session) == pid  # the wrapper exec'd: same pid, its own session
    assert mark == b"m-1"


def test_exit_by_signal_is_a_negative_code(path: str) -> None:
    async def run() -> int:
        child = await spawn.spawn(["/bin/sleep", "30"], dict(os.environ))
        os.killpg(child.pid, signal.SIGKILL)
        return await child.wait()

    assert asyncio.run(run()) == -signal.SIGKILL


def test_a_binary_that_cannot_run(tmp_path: Path, path: str) -> None:
    missing = str(tmp_path / "no-such-llama-server")

    async def run() -> int:
        child = await spawn.spawn([missing], dict(os.environ))
        assert child.stderr is not None
        assert missing.encode() in await child.stderr.read()
        return await child.wait()

    if path == "setpriv":  # the wrapper reports it by its exit, as a shell does
        assert asyncio.run(run()) == 127
    else:
        with pytest.raises(FileNotFoundError):
            asyncio.run(run())


HOLDER = """
import asyncio, os, sys
from router.children import spawn
if sys.argv[1] == "preexec_fn":
    spawn.death_wrapper = lambda: None
async def main():
    child = await spawn.spawn(["/bin/sleep", "60"], dict(os.environ))
    print(child.pid, flush=True)
    await asyncio.sleep(60)
asyncio.run(main())
"""


def test_a_child_dies_with_a_sigkilled_parent(path: str) -> None:
    # sleep never reads its stdin, so only the parent-death signal can end it.
    with subprocess.Popen([sys.executable, "-c", HOLDER, path], stdout=subprocess.PIPE,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
                          ) as holder:
        try:
            assert holder.stdout is not None
            pid = int(holder.stdout.readline())
            # Until the wrapper (or the forked router) has set the signal, about a
            # millisecond, an orphan is not killed: the window the module docstring states.
            assert wait_until(lambda: psutil.Process(pid).name() == "sleep", timeout=5.0)
            holder.kill()
            holder.wait()
            assert wait_until(lambda: not alive(pid), timeout=5.0)
        finally:
            holder.kill()


@pytest.mark.process
async def test_a_cancel_while_a_childs_last_output_drains_is_not_swallowed() -> None:
    """``ChildProcess.wait_exit`` gives the output readers up to a second after the exit; a
    cancel in that second ends the wait with ``CancelledError`` (it was swallowed, and the
    cancelled caller went on as if the wait had ended)."""
    async with httpx.AsyncClient() as client:
        # The shell exits at once; its background sleep keeps the output pipes open, so the
        # readers are still reading when the exit is seen.
        child = ChildProcess("drain", ["sh", "-c", "sleep 30 & exit 0"], 0, LogRing(10), client)
        await child.start()
        try:
            waiting = asyncio.ensure_future(child.wait_exit())
            async with asyncio.timeout(10):
                while child.returncode is None:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)  # the exit, seen on the pidfd
            await asyncio.sleep(0.05)  # into the second the readers get
            assert not waiting.done()
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                async with asyncio.timeout(5):
                    await waiting
        finally:
            assert child.pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)  # the sleep, in the child's group
            # The sleep's death ends the pipes: the readers read to their end, which closes
            # them. Left reading when this test's loop closes, the pipes would stay open for
            # good (test_sse.py's HEAD test once failed on the warnings the garbage collector
            # then raised).
            async with asyncio.timeout(10):
                await asyncio.gather(*child._readers)
