"""Start a child process that dies with the router, without forking the router.

A llama-server child must not outlive a router killed with SIGKILL: it is started with
``PR_SET_PDEATHSIG = SIGKILL``. That setting has to be made in the child between fork and
exec. Made by a Python ``preexec_fn`` it costs a full fork of the router, and under uvloop
(libuv forks for every spawn) the event loop is blocked about 10 ms per spawn on a ~55 MB
router on 2 busy cores. So on Linux the child is started through util-linux's
``setpriv --pdeathsig KILL -- argv...`` (it sets the signal and execs; the pid stays the
same) with ``subprocess.Popen``, which uses ``vfork`` when there is no ``preexec_fn``:
the loop is blocked about half a millisecond, and the child starts sooner. The pipes are
then handed to the loop, and its exit is watched on a pidfd.

Where ``setpriv`` (util-linux 2.33 or later: ``--pdeathsig``) or pidfds (Linux 5.3) are
missing, ``asyncio.create_subprocess_exec`` with a ``preexec_fn`` does the same job, slower.
Either way there is a window, from the fork to the setting (about a millisecond with
``setpriv``, a fraction with a ``preexec_fn``), in which a router killed leaves the child
orphaned; a child that then becomes ready still exits, on the end of its stdin.

``spawn`` returns either way an object with what ``process.ChildProcess`` uses of an
``asyncio.subprocess.Process``: ``pid``, ``returncode``, ``stdin`` (``write``, ``close``,
``is_closing``), ``stdout``, ``stderr`` (``StreamReader``) and ``wait()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Protocol

PR_SET_PDEATHSIG = 1
STREAM_LIMIT = 1 << 16  # as asyncio.subprocess's readers
PROBE_TIMEOUT_S = 5.0


class PipeWriter(Protocol):
    def write(self, data: bytes) -> None: ...
    def close(self) -> None: ...
    def is_closing(self) -> bool: ...


class Spawned(Protocol):
    """A started child, as ``asyncio.subprocess.Process`` offers it."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def stdin(self) -> PipeWriter | None: ...
    @property
    def stdout(self) -> asyncio.StreamReader | None: ...
    @property
    def stderr(self) -> asyncio.StreamReader | None: ...
    async def wait(self) -> int: ...


@functools.cache
def death_wrapper() -> tuple[str, ...] | None:
    """The argv prefix that sets ``PR_SET_PDEATHSIG = SIGKILL`` and execs the rest, or None
    where there is none to use (then ``spawn`` forks with a ``preexec_fn``). Probed once;
    ``server.prepare`` asks at startup, so no spawn pays for the probe."""
    if not sys.platform.startswith("linux") or not hasattr(os, "pidfd_open"):
        return None
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    try:  # an older setpriv refuses the option before it reaches --version
        probe = subprocess.run([setpriv, "--pdeathsig", "KILL", "--version"],
                               capture_output=True, timeout=PROBE_TIMEOUT_S, check=False)
        os.close(os.pidfd_open(os.getpid()))  # pidfds work here (Linux 5.3)
    except (OSError, subprocess.SubprocessError):
        return None
    return (setpriv, "--pdeathsig", "KILL", "--") if probe.returncode == 0 else None


async def spawn(argv: Sequence[str], env: dict[str, str]) -> Spawned:
    """Start ``argv`` in a new session, with stdin, stdout and stderr piped to the router,
    set to be SIGKILLed when the router dies. Raises ``OSError`` when it cannot start (with
    the wrapper, a binary that cannot be executed is reported by its exit: 126 or 127)."""
    wrapper = death_wrapper()
    if wrapper is None:
        return await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True,
            preexec_fn=_die_with_parent)
    # Blocks only until the wrapper is exec'd (vfork): well under asyncio's own spawn.
    popen = subprocess.Popen(  # noqa: ASYNC220
        [*wrapper, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=env, start_new_session=True)
    child = _PopenChild(popen)
    try:
        await child.connect()
    except BaseException:
        child.abandon()
        raise
    return child


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class _PopenChild:
    """A ``subprocess.Popen`` child whose pipes and exit the running loop watches."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdin: asyncio.WriteTransport | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._transports: list[asyncio.BaseTransport] = []
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        self._pidfd = os.pidfd_open(popen.pid)
        self._loop.add_reader(self._pidfd, self._on_exit)

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def connect(self) -> None:
        popen, loop = self._popen, self._loop
        assert popen.stdin is not None and popen.stdout is not None and popen.stderr is not None
        self.stdin, _ = await loop.connect_write_pipe(asyncio.Protocol, popen.stdin)
        self._transports.append(self.stdin)
        self.stdout = await self._reader(popen.stdout)
        self.stderr = await self._reader(popen.stderr)

    async def _reader(self, pipe: object) -> asyncio.StreamReader:
        reader = asyncio.StreamReader(limit=STREAM_LIMIT, loop=self._loop)
        transport, _ = await self._loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe)
        self._transports.append(transport)
        return reader

    def _on_exit(self) -> None:
        if self._popen.poll() is None:  # woken without an exit: not possible with a pidfd
            return
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        if not self._exited.done():
            self._exited.set_result(self._popen.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def abandon(self) -> None:
        """Connecting the pipes failed: kill and reap the child now."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self._popen.wait()
        self._on_exit()
        for transport in self._transports:  # each closes its pipe
            transport.close()
        for pipe in (self._popen.stdin, self._popen.stdout, self._popen.stderr)[
                len(self._transports):]:  # the pipes not handed to the loop
            if pipe is not None:
                pipe.close()
