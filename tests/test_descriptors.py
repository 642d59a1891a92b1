"""Descriptor ownership of a child's pipes and pidfd (``router.children.spawn``,
``router.children.process``) on both event loops the router runs on (uvloop when serving,
asyncio's in most tests): every descriptor is closed once, by its one owner, and never while a
loop still watches it.

Why it matters: a descriptor closed twice closes whatever reused its number in between
(another thread's ``/proc`` read, a client's socket), and one closed while a loop watches it
leaves libuv a watcher on a number that the next pipe, socket or pidfd gets: then ``EEXIST``
("could not start llama-server: [Errno 17] File exists"), connections reset under their
requests, or libuv's abort. uvloop closes a pipe transport's descriptor itself and then also
closes the Python file object it was given: the child pipes handed to the loop as
``Popen``'s file objects were closed twice at every child's end (``close(N) = -1 EBADF`` under
strace; a spawn cancelled while its pipes connected raised ``EBADF`` instead of the cancel).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import uvloop
from fdcheck import CloseGuard, open_descriptors

from router.children import spawn
from router.children.process import ChildProcess
from router.logs import LogRing

pytestmark = pytest.mark.process

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}
SCRIPT = "echo out; echo err >&2; read line; echo \"got $line\"; exit 3"
ROOT = Path(__file__).parents[1]


@pytest.fixture(params=sorted(LOOPS))
def runner(request: pytest.FixtureRequest) -> Iterator[asyncio.Runner]:
    with asyncio.Runner(loop_factory=LOOPS[request.param]) as run:
        yield run


@pytest.fixture
def guard() -> Iterator[CloseGuard]:
    closes = CloseGuard()
    closes.install()
    try:
        yield closes
    finally:
        closes.uninstall()


def sleepers() -> list[psutil.Process]:
    """This process's children still running ``sleep`` (a spawn's child left behind)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # it ended meanwhile
            if child.status() != psutil.STATUS_ZOMBIE and child.name() == "sleep":
                found.append(child)
    return found


async def to_the_end(child: spawn.Spawned) -> tuple[bytes, bytes, int]:
    assert child.stdout is not None and child.stderr is not None
    out, err = await child.stdout.read(), await child.stderr.read()
    return out, err, await child.wait()


def test_a_child_that_exits_has_closed_each_of_its_descriptors_once(
        runner: asyncio.Runner, guard: CloseGuard) -> None:
    async def main() -> tuple[set[int], set[int], tuple[bytes, bytes, int]]:
        before = open_descriptors()
        child = await spawn.spawn(["/bin/sh", "-c", SCRIPT], dict(os.environ))
        assert child.stdin is not None
        child.stdin.write(b"hello\n")
        ended = await to_the_end(child)
        return before, open_descriptors(), ended

    before, after, ended = runner.run(main())
    assert ended == (b"out\ngot hello\n", b"err\n", 3)
    # Its pipes and pidfd are closed once the exit and both ends of output are seen.
    assert after == before
    assert guard.violations == []


def test_stdin_closed_by_its_user_is_not_closed_again_at_the_exit(
        runner: asyncio.Runner, guard: CloseGuard) -> None:
    async def main() -> tuple[set[int], set[int], tuple[bytes, bytes, int]]:
        before = open_descriptors()
        child = await spawn.spawn(["/bin/sh", "-c", "read line; echo \"$line\""],
                                  dict(os.environ))
        assert child.stdin is not None
        child.stdin.write(b"bye\n")
        child.stdin.close()
        child.stdin.close()  # idempotent, as a transport's
        assert child.stdin.is_closing()
        ended = await to_the_end(child)
        child.stdin.close()
        return before, open_descriptors(), ended

    before, after, ended = runner.run(main())
    assert ended == (b"bye\n", b"", 0)
    assert after == before
    assert guard.violations == []


def test_output_past_the_readers_limit_pauses_it_and_arrives_whole(
        runner: asyncio.Runner, guard: CloseGuard) -> None:
    """A child writing more than its reader holds (twice ``STREAM_LIMIT``) before anyone
    reads: the reader leaves the loop until it is read from, and every byte arrives."""
    size = 16 * spawn.STREAM_LIMIT

    async def main() -> tuple[set[int], set[int], tuple[bytes, bytes, int]]:
        before = open_descriptors()
        child = await spawn.spawn(["/bin/sh", "-c", f"yes | head -c {size}"], dict(os.environ))
        assert child.stdout is not None
        async with asyncio.timeout(10):  # until it has paused: what it holds is no event
            while len(child.stdout._buffer) <= 2 * spawn.STREAM_LIMIT:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        ended = await to_the_end(child)
        return before, open_descriptors(), ended

    before, after, (out, err, code) = runner.run(main())
    assert (len(out), set(out), err, code) == (size, set(b"y\n"), b"", 0)
    assert after == before
    assert guard.violations == []


def test_a_spawn_cancelled_at_any_step_leaves_no_child_and_closes_each_descriptor_once(
        runner: asyncio.Runner, guard: CloseGuard) -> None:
    async def main() -> tuple[set[int], list[set[int]], list[str]]:
        before = open_descriptors()
        after, outcomes = [], []
        for steps in range(6):
            task = asyncio.ensure_future(spawn.spawn(["/bin/sleep", "30"], dict(os.environ)))
            for _ in range(steps):
                await asyncio.sleep(0)  # one loop step each: the cancel lands at step `steps`
            task.cancel()
            try:
                child = await task
            except asyncio.CancelledError:
                outcomes.append("cancelled")
            else:  # it had started before the cancel came: the caller's to stop
                outcomes.append("started")
                os.killpg(child.pid, signal.SIGKILL)
                await to_the_end(child)
            after.append(open_descriptors())
        return before, after, outcomes

    before, after, outcomes = runner.run(main())
    assert after == [before] * len(outcomes), outcomes
    assert sleepers() == []
    assert guard.violations == []


async def test_a_stopped_child_has_closed_each_of_its_descriptors_once(
        guard: CloseGuard) -> None:
    """``ChildProcess.stop``: the exit command on stdin, stdin closed, SIGTERM, the reap."""
    async with httpx.AsyncClient() as client:
        before = open_descriptors()
        child = ChildProcess("fd", ["/bin/sh", "-c", "read line; sleep 30"], 0,
                             LogRing(10), client)
        await child.start()
        assert await child.stop(5.0) == -signal.SIGTERM
        assert open_descriptors() == before
    assert guard.violations == []


CHURN = """
import asyncio, gc, os, signal, threading
import uvloop
from router.children import spawn

async def main():
    env = dict(os.environ)
    for _ in range(3):  # each child to its end: exit, output read, reaped
        child = await spawn.spawn(["/bin/sh", "-c", "echo out; echo err >&2"], env)
        await child.stdout.read(), await child.stderr.read(), await child.wait()
    del child
    # What the garbage collector finds of them, collected in another thread (as the
    # router's log writer or a worker thread may), while the loop runs.
    collector = threading.Thread(target=gc.collect)
    collector.start()
    await asyncio.to_thread(collector.join)
    for steps in range(6):  # a spawn cancelled at each step of its start
        task = asyncio.ensure_future(spawn.spawn(["/bin/sleep", "30"], env))
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        try:
            child = await task
        except asyncio.CancelledError:
            continue
        os.killpg(child.pid, signal.SIGKILL)
        await child.stdout.read(), await child.stderr.read(), await child.wait()
    print("done", flush=True)

uvloop.run(main())
"""


def test_no_descriptor_is_closed_twice_under_uvloop_not_even_inside_c(tmp_path: Path) -> None:
    """The closes that ``CloseGuard`` cannot see (libuv's, a file object's), counted by the
    kernel: under strace, no ``close`` of spawning and ending children fails with EBADF."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed: the closes made in C cannot be counted")
    trace = tmp_path / "close.trace"
    done = subprocess.run(
        [strace, "-f", "-qq", "-e", "trace=close", "-e", "status=failed", "-o", str(trace),
         sys.executable, "-c", CHURN], capture_output=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    failed = trace.read_text().splitlines()
    assert [line for line in failed if "EBADF" in line] == []
    assert done.returncode == 0 and done.stdout == b"done\n", done.stderr.decode()[-3000:]
