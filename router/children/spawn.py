"""Start a child process that dies with the router, without forking the router.

A llama-server child must not outlive a router killed with SIGKILL: it is started with
``PR_SET_PDEATHSIG = SIGKILL``. That setting has to be made in the child between fork and
exec. Made by a Python ``preexec_fn`` it costs a full fork of the router, and under uvloop
(libuv forks for every spawn) the event loop is blocked about 10 ms per spawn on a ~55 MB
router on 2 busy cores. So on Linux the child is started through util-linux's
``setpriv --pdeathsig KILL -- argv...`` (it sets the signal and execs; the pid stays the
same) with ``subprocess.Popen``, which uses ``vfork`` when there is no ``preexec_fn``:
the loop is blocked about half a millisecond, and the child starts sooner. Its pipes'
descriptors and a pidfd are then watched by the loop (``add_reader``), each owned by one
object that takes it out of the loop and closes it once (``_PopenChild``).

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
from collections.abc import Iterable, Sequence
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
    return _PopenChild.start([*wrapper, *argv], env)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class _PopenChild:
    """A ``subprocess.Popen`` child whose output and exit the running loop watches.

    Every descriptor has one owner that closes it once, on the loop's thread:

    * the child's ends of its three pipes: ``start``, as soon as ``Popen`` returns (or fails);
    * stdin's write end: ``stdin`` (``_PipeWriter``, never registered in the loop), closed by
      its user or at the child's exit, whichever comes first;
    * stdout's and stderr's read ends: each its ``_PipeReader``, registered in the loop while
      it reads and closed by itself at the end of the output (``remove_reader``, then
      ``os.close``), or by ``abandon``;
    * the pidfd: this object, registered in the loop until the exit is seen, then taken out
      of it and closed (``_release_pidfd``).

    No descriptor reaches the loop as a transport made from a Python file object. uvloop
    closes such a transport's descriptor itself and then closes the file object too: a second
    ``close`` of a number that may have been reused meanwhile. And uvloop keeps a pipe
    transport open after the end of its output (``StreamReaderProtocol`` asks it to), so
    nobody closed those: the garbage collector did, in whichever thread collected, twice
    again (file object, then transport), while the loop ran on without the GIL and reused
    numbers: other owners' descriptors were closed, the loop's among them
    (``tests/test_descriptors.py``, ``tests/test_churn_real.py``).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, popen: subprocess.Popen[bytes],
                 stdin: int, stdout: int, stderr: int) -> None:
        """Takes ``popen``'s pipe ends (parent side) and owns them from here on."""
        self._loop = loop
        self._popen = popen
        self.pid = popen.pid
        self.stdin = _PipeWriter(stdin)
        self._stdout = _PipeReader(loop, stdout)
        self._stderr = _PipeReader(loop, stderr)
        self.stdout: asyncio.StreamReader = self._stdout.stream
        self.stderr: asyncio.StreamReader = self._stderr.stream
        self._exited: asyncio.Future[int] = loop.create_future()
        self._pidfd = -1
        self._pidfd_watched = False

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str]) -> _PopenChild:
        loop = asyncio.get_running_loop()
        ends: list[int] = []
        try:
            for _ in range(3):
                ends.extend(os.pipe())  # not inherited (PEP 446): the child gets dup2 copies
        except BaseException:
            _close_all(ends)
            raise
        stdin_r, stdin_w, stdout_r, stdout_w, stderr_r, stderr_w = ends
        try:
            # Blocks only until the wrapper is exec'd (vfork): well under asyncio's own spawn.
            popen = subprocess.Popen(
                argv, stdin=stdin_r, stdout=stdout_w, stderr=stderr_w, env=env,
                start_new_session=True)
        except BaseException:
            _close_all((stdin_w, stdout_r, stderr_r))
            raise
        finally:
            _close_all((stdin_r, stdout_w, stderr_w))  # the child holds its own copies
        child = cls(loop, popen, stdin_w, stdout_r, stderr_r)
        try:
            child._watch()
        except BaseException:
            child.abandon()
            raise
        return child

    def _watch(self) -> None:
        for fd in (self.stdin.fd, self._stdout.fd, self._stderr.fd):
            os.set_blocking(fd, False)
        self._pidfd = os.pidfd_open(self.pid)
        self._loop.add_reader(self._pidfd, self._on_exit)
        self._pidfd_watched = True
        self._stdout.resume_reading()
        self._stderr.resume_reading()

    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    def _on_exit(self) -> None:
        if self._popen.poll() is None:  # woken without an exit: not possible with a pidfd
            return
        self._release_pidfd()
        self.stdin.close()  # nothing can read it any more
        if not self._exited.done():
            self._exited.set_result(self._popen.returncode)

    def _release_pidfd(self) -> None:
        """Out of the loop first, then closed; once, whoever calls it first."""
        fd, self._pidfd = self._pidfd, -1
        if fd < 0:
            return
        if self._pidfd_watched:
            self._pidfd_watched = False
            self._loop.remove_reader(fd)
        os.close(fd)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def abandon(self) -> None:
        """Watching the child failed: kill and reap it now, and close what it had."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self._popen.wait()
        self._on_exit()
        self._stdout.close()
        self._stderr.close()


def _close_all(fds: Iterable[int]) -> None:
    """Close descriptors that no loop has seen; every one, even if one fails."""
    errors: list[OSError] = []
    for fd in fds:
        try:
            os.close(fd)
        except OSError as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


class _PipeWriter:
    """The write end of a child's stdin pipe, as much of a transport as the router uses.

    Never registered in the loop: the router writes llama.cpp's short exit command and then
    closes, and an empty pipe (64 KiB) takes that at once, so ``write`` is one non-blocking
    ``os.write``. Bytes that do not fit, or that a child that is gone cannot read, are lost, as
    a transport loses them to a closed pipe. Owns ``fd``: ``close`` closes it once; a
    later ``write`` or ``close`` does nothing."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, data: bytes) -> None:
        if self.fd < 0:
            return
        with contextlib.suppress(BlockingIOError, BrokenPipeError):
            os.write(self.fd, data)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def is_closing(self) -> bool:
        return self.fd < 0


class _PipeReader(asyncio.ReadTransport):
    """The read end of a child's output pipe, read by the loop into ``stream``.

    Owns ``fd``: registered in the loop while reading (``stream`` pauses it while more than
    twice ``STREAM_LIMIT`` is unread), and closed once by ``close``: at the end of the output
    (then ``stream`` sees its EOF, after the close), on a read error (``stream`` raises it),
    or by the child's owner. ``close`` takes the descriptor out of the loop before closing it:
    the loop never watches a closed number."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        super().__init__()
        self._loop = loop
        self.fd = fd
        self._reading = False
        self.stream = asyncio.StreamReader(limit=STREAM_LIMIT, loop=loop)
        self.stream.set_transport(self)  # its flow control pauses and resumes this reader

    def _on_readable(self) -> None:
        if self.fd < 0:
            return
        try:
            data = os.read(self.fd, STREAM_LIMIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._end()
            self.stream.set_exception(exc)
            return
        if data:
            self.stream.feed_data(data)
        else:
            self.close()

    def is_reading(self) -> bool:
        return self._reading

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self.fd)

    def resume_reading(self) -> None:
        if not self._reading and self.fd >= 0:
            self._loop.add_reader(self.fd, self._on_readable)
            self._reading = True

    def is_closing(self) -> bool:
        return self.fd < 0

    def close(self) -> None:
        if self._end():
            self.stream.feed_eof()

    def _end(self) -> bool:
        """Out of the loop, then closed; False if it already was."""
        if self.fd < 0:
            return False
        self.pause_reading()
        fd, self.fd = self.fd, -1
        os.close(fd)
        return True
