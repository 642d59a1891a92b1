"""Every file of the state directory is opened as a regular file, never through a symbolic
link and never waiting (``router/warm/statestore.py``'s ``open_regular``; SQLite's
``usage.sqlite3`` checked before it is opened, ``router/teams/usage.py``'s ``check_file``):
a FIFO planted as ``owners.key`` froze the event loop at the first keyed request, one as
``digests.json`` hung the router's start (and SIGTERM did not end it), and a symlinked
``usage.sqlite3`` was followed out of ``--state-dir``. Each is now refused at once, with a
line that says what it is."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from support import free_port, start_router

from router.config.presets import ModelPreset
from router.teams.usage import FILE_NAME, UnsafeFile, Usage, UsageStore
from router.warm.conversations import SECRET_NAME, Conversations
from router.warm.digests import CACHE_NAME, Digests
from router.warm.statestore import NotRegularFile, StateStore, claim_root, open_regular
from router.warm.swaps import WarmSwaps

PROMPT_S = 5.0  # what "at once" must beat here (a FIFO's open used to wait forever)


def promptly(work: Callable[[], Any], fifos: list[Path]) -> Any:
    """``work()`` run in a thread, which must end within ``PROMPT_S``; a thread stuck in
    the open of one of ``fifos`` is let go (a writer opens each) so that none outlives the
    test."""
    result: list[Any] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(PROMPT_S)
    stuck = thread.is_alive()
    for fifo in fifos:  # a reader blocked in open() goes on once a writer opens it
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    thread.join(PROMPT_S)
    assert not stuck, f"still waiting after {PROMPT_S} s (blocked on a FIFO)"
    if failed:
        raise failed[0]
    return result[0]


# --------------------------------------------------------------------- the one helper

def test_only_a_regular_file_is_opened(tmp_path: Path) -> None:
    regular = tmp_path / "regular"
    regular.write_bytes(b"x")
    os.close(open_regular(regular))
    (tmp_path / "link").symlink_to(regular)
    with pytest.raises(NotRegularFile, match="link is a symbolic link"):
        open_regular(tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(NotRegularFile, match=r"fifo is not a regular file \(a FIFO\)"):
        promptly(lambda: open_regular(tmp_path / "fifo"), [tmp_path / "fifo"])
    (tmp_path / "dir").mkdir()
    with pytest.raises(NotRegularFile, match=r"not a regular file \(a directory\)"):
        open_regular(tmp_path / "dir")
    with pytest.raises(FileNotFoundError):
        open_regular(tmp_path / "missing")
    fd = open_regular(tmp_path / "made", os.O_RDWR | os.O_CREAT)
    os.close(fd)
    assert (tmp_path / "made").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("plant", ["fifo", "symlink"])
def test_a_lock_that_is_not_a_regular_file_is_refused(tmp_path: Path, plant: str) -> None:
    root = tmp_path / "state"
    root.mkdir()
    if plant == "fifo":
        os.mkfifo(root / ".lock")
    else:
        (root / ".lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(NotRegularFile, match=r"\.lock is"):
        promptly(lambda: claim_root(root), [root / ".lock"])
    assert not (tmp_path / "elsewhere").exists()


# --------------------------------------------------------------------- owners.key

def conversations(root: Path) -> Conversations:
    return Conversations(WarmSwaps(StateStore(root, 1 << 20), "test",
                                   cast(httpx.AsyncClient, None)))


@pytest.mark.parametrize("plant", ["fifo", "symlink"])
def test_a_fifo_or_link_as_owners_key_never_freezes_a_keyed_request(
        tmp_path: Path, plant: str, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "state"
    found = conversations(root)
    secret = root / SECRET_NAME
    outside = tmp_path / "outside"
    outside.write_bytes(b"k" * 32)  # a secret someone else chose
    if plant == "fifo":
        os.mkfifo(secret)
    else:
        secret.symlink_to(outside)
    preset = ModelPreset(id="m", args={})
    owner = promptly(lambda: found.owner_of(b"sk-alice", preset), [secret])
    assert owner is not None and len(owner) == 32
    assert "cannot read the owners' secret" in caplog.text and "making another" in caplog.text
    assert secret.is_file() and not secret.is_symlink()  # replaced by a secret of its own
    assert secret.read_bytes() != outside.read_bytes()
    assert conversations(root).owner_of(b"sk-alice", preset) == owner  # and kept


# --------------------------------------------------------------------- digests.json

def test_a_fifo_as_digests_json_is_ignored_at_once_and_replaced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / CACHE_NAME
    os.mkfifo(cache)
    digests = promptly(lambda: Digests(cache), [cache])
    assert f"ignoring {cache}: {cache} is not a regular file (a FIFO)" in caplog.text
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    assert digests.digest_now(model) is not None
    assert cache.is_file()  # written over the FIFO: a regular file again
    assert Digests(cache).known(model) is not None


@pytest.mark.process
def test_a_router_with_a_fifo_as_digests_json_starts_and_sigterm_ends_it(
        tmp_path: Path) -> None:
    """A FIFO as ``digests.json`` (and as ``owners.key``) hung the start in an ``open`` that
    SIGTERM did not end; the router now starts, says why it ignores the file, and stops."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.mkfifo(state / CACHE_NAME)
    os.mkfifo(state / SECRET_NAME)
    started = time.monotonic()
    with start_router(tmp_path, "--state-dir", str(state)) as router:
        start_s = time.monotonic() - started
        assert httpx.get(router.url + "/health", timeout=5).status_code == 200
        router.proc.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        assert router.proc.wait(timeout=30) is not None
        stop_s = time.monotonic() - stopping
        log = router.log()
    assert f"{state / CACHE_NAME} is not a regular file (a FIFO)" in log, log
    assert start_s < 30 and stop_s < 15, (start_s, stop_s)


# --------------------------------------------------------------------- usage.sqlite3

@pytest.mark.parametrize("plant", ["symlink", "fifo", "journal symlink"])
def test_a_usage_file_that_is_not_a_regular_file_is_refused(tmp_path: Path,
                                                            plant: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    outside = tmp_path / "outside.sqlite3"
    path = state / FILE_NAME
    if plant == "symlink":
        path.symlink_to(outside)
    elif plant == "fifo":
        os.mkfifo(path)
    else:
        Path(f"{path}-journal").symlink_to(tmp_path / "outside-journal")
    with pytest.raises(UnsafeFile, match="refused"):
        promptly(lambda: Usage(UsageStore(path)), [path])
    assert not outside.exists() and not (tmp_path / "outside-journal").exists()


def test_a_usage_file_made_a_link_later_is_not_written_through(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / FILE_NAME
    usage = Usage(UsageStore(path))
    usage.served("team", "m", 1, 1, 0.0)
    usage.save_now()
    path.rename(tmp_path / "moved")
    outside = tmp_path / "outside.sqlite3"
    path.symlink_to(outside)
    usage.served("team", "m", 1, 1, 0.0)
    usage.save_now()
    usage.save_now()
    assert not outside.exists()
    assert caplog.text.count("could not write the usage") == 1  # said once while it lasts
    assert "is a symbolic link (never followed): refused" in caplog.text


@pytest.mark.process
def test_a_router_with_a_symlinked_usage_file_refuses_to_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    outside = tmp_path / "outside.sqlite3"
    (state / FILE_NAME).symlink_to(outside)
    argv = [sys.executable, "-m", "router.cli", "serve", "--port", str(free_port("127.0.0.1")),
            "--state-dir", str(state)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"{state / FILE_NAME} is a symbolic link (never followed): refused" in \
        done.stdout + done.stderr, done.stdout + done.stderr
    assert not outside.exists()

