"""The router's own log: the ring behind ``/logs``, its followers, and the handler feeding it."""

from __future__ import annotations

import asyncio
import io
import logging
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from router import logs
from router.logs import BackgroundStreamHandler, KeyValueFormatter, LogRing, RingHandler


def record(message: str, *args: object, **fields: object) -> logging.LogRecord:
    made = logging.LogRecord("router.test", logging.INFO, __file__, 1, message, args, None)
    for name, value in fields.items():
        setattr(made, name, value)
    return made


def test_ring_keeps_the_last_lines_and_tails_them() -> None:
    ring = LogRing(3)
    for n in range(5):
        ring.append(f"line {n}")
    assert ring.tail(2) == ["line 3", "line 4"]
    assert ring.tail(10) == ["line 2", "line 3", "line 4"]
    assert ring.tail(0) == []


async def test_a_follower_that_falls_behind_loses_its_oldest_lines(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "FOLLOW_QUEUE_SIZE", 2)
    ring = LogRing(10)
    with ring.follow() as queue:
        for n in range(4):
            ring.append(f"line {n}")  # never blocks, however slow the follower
        assert [queue.get_nowait(), queue.get_nowait()] == ["line 2", "line 3"]
        assert queue.empty()
    ring.append("after")  # a follower that left gets nothing more
    assert queue.empty()
    assert ring.tail(10)[-1] == "after"


async def test_handler_appends_on_the_loop_and_from_other_threads() -> None:
    ring = LogRing(10)
    handler = RingHandler(ring, asyncio.get_running_loop())
    handler.setFormatter(KeyValueFormatter("%(message)s"))
    handler.emit(record("on the loop"))
    assert ring.tail(1) == ["on the loop"]  # at once

    worker = threading.Thread(target=handler.emit, args=(record("from a thread"),))
    worker.start()
    worker.join()
    assert ring.tail(1) == ["on the loop"]  # handed to the loop, not appended by the thread
    for _ in range(100):
        await asyncio.sleep(0)
        if len(ring.tail(2)) == 2:
            break
    assert ring.tail(2) == ["on the loop", "from a thread"]


def test_handler_never_raises(capsys: pytest.CaptureFixture[str]) -> None:
    ring = LogRing(10)
    loop = asyncio.new_event_loop()
    handler = RingHandler(ring, loop)
    handler.emit(record("%d apples", "not a number"))  # a bad format: reported, not raised
    assert "--- Logging error ---" in capsys.readouterr().err
    loop.close()
    handler.emit(record("after the loop closed"))  # at shutdown: dropped quietly
    assert ring.tail(10) == []


def test_key_value_formatter_appends_the_structured_fields() -> None:
    formatter = KeyValueFormatter("%(levelname)s %(message)s")
    assert formatter.format(record("plain")) == "INFO plain"
    line = formatter.format(record("loaded %s", "m", event="loaded", model="m", pid=42,
                                   port=None, other="ignored"))
    assert line == "INFO loaded m event=loaded model=m pid=42"


def test_configure_sets_the_level_and_quiets_http_clients() -> None:
    root = logging.getLogger()
    quieted = [logging.getLogger(name) for name in ("httpx", "httpcore")]
    saved = root.handlers[:], root.level, [q.level for q in quieted]
    background = logs._background
    try:
        logs.configure("warning")
        assert root.level == logging.WARNING
        assert len(root.handlers) == 1
        first = root.handlers[0]
        assert isinstance(first, BackgroundStreamHandler)
        assert isinstance(first.formatter, KeyValueFormatter)
        assert logging.getLogger("httpx").level == logging.WARNING
        assert logging.getLogger("httpcore").level == logging.WARNING
        assert logs._background is first
        logs.configure("info")  # again: the first handler's thread is stopped
        assert root.handlers[0] is not first and not first.running
        root.handlers[0].close()
    finally:
        logs._background = background
        root.handlers[:], level, levels = saved
        root.setLevel(level)
        for quiet, old in zip(quieted, levels, strict=True):
            quiet.setLevel(old)


def written(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


@pytest.fixture
def background(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[BackgroundStreamHandler,
                                                                  io.StringIO]]:
    """A background handler installed as ``configure`` installs it, on a StringIO."""
    stream = io.StringIO()
    handler = BackgroundStreamHandler(stream)
    handler.setFormatter(KeyValueFormatter("%(levelname)s %(name)s: %(message)s"))
    monkeypatch.setattr(logs, "_background", handler)
    try:
        yield handler, stream
    finally:
        handler.close()


CHILD = logging.getLogger("router.test.child")


async def test_relayed_lines_are_written_later_and_before_any_later_record(
        background: tuple[BackgroundStreamHandler, io.StringIO]) -> None:
    handler, stream = background
    handed = time.time()
    logs.relay(CHILD, logging.INFO, "[m] 50% done %s")  # used as is: no %-formatting
    logs.relay(CHILD, logging.WARNING, "[m] second")
    assert written(stream) == []  # only queued
    handler.handle(record("router event %s", "after", event="x"))  # written at once...
    assert written(stream) == ["INFO router.test.child: [m] 50% done %s",  # ...after them
                               "WARNING router.test.child: [m] second",
                               "INFO router.test: router event after event=x"]
    logs.relay(CHILD, logging.INFO, "[m] on its own")
    for _ in range(200):  # the writer thread writes it after the batching delay
        if len(written(stream)) == 4:
            break
        await asyncio.sleep(0.005)
    assert written(stream)[-1] == "INFO router.test.child: [m] on its own"
    formatter = KeyValueFormatter("%(created)f")
    with_time = logs._record(CHILD.name, logging.INFO, "x", handed)
    assert formatter.format(with_time) == f"{handed:f}"  # stamped when handed over


def test_background_handler_writes_records_at_once_and_tracebacks(
        background: tuple[BackgroundStreamHandler, io.StringIO]) -> None:
    handler, stream = background
    handler.handle(record("plain"))
    assert written(stream) == ["INFO router.test: plain"]
    try:
        raise ValueError("boom")
    except ValueError:
        failed = record("failed")
        failed.exc_info = sys.exc_info()
    handler.handle(failed)
    text = stream.getvalue()
    assert "INFO router.test: failed\nTraceback" in text and "ValueError: boom" in text


def test_close_and_flush_write_what_is_pending(
        background: tuple[BackgroundStreamHandler, io.StringIO]) -> None:
    handler, stream = background
    logs.relay(CHILD, logging.INFO, "one")
    handler.flush()
    assert written(stream) == ["INFO router.test.child: one"]
    for n in range(50):
        logs.relay(CHILD, logging.INFO, f"line {n}")
    handler.close()
    assert written(stream)[1:] == [f"INFO router.test.child: line {n}" for n in range(50)]
    assert not handler.running
    logs.relay(CHILD, logging.ERROR, "after close")  # no thread: through the logger at once


def test_relay_without_a_background_handler_logs_through_the_logger(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "_background", None)
    collect = Collect()
    CHILD.addHandler(collect)
    try:
        logs.relay(CHILD, logging.WARNING, "[m] 100% line")
        assert [r.getMessage() for r in collect.records] == ["[m] 100% line"]
    finally:
        CHILD.removeHandler(collect)


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class BlockedStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.unblocked = threading.Event()
        self.writing = threading.Event()

    def write(self, text: str) -> int:
        self.writing.set()
        self.unblocked.wait(10)
        return super().write(text)


def test_relay_never_blocks_and_drops_lines_when_stderr_is_stuck(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "MAX_PENDING", 3)
    stream = BlockedStream()
    handler = BackgroundStreamHandler(stream)
    handler.setFormatter(KeyValueFormatter("%(message)s"))
    monkeypatch.setattr(logs, "_background", handler)
    try:
        logs.relay(CHILD, logging.INFO, "first")  # the writer takes it and blocks writing
        assert stream.writing.wait(5)
        began = time.monotonic()
        for n in range(5):
            logs.relay(CHILD, logging.INFO, f"queued {n}")
        assert time.monotonic() - began < 0.5  # never waited for the stuck stream
        assert handler.dropped == 2
        stream.unblocked.set()
        handler.flush()
        lines = written(stream)
        assert lines[:4] == ["first", "queued 0", "queued 1", "queued 2"]
        assert lines[4] == "2 child output lines dropped: stderr did not keep up"
    finally:
        stream.unblocked.set()
        handler.close()


def test_time_format_is_loggings_default() -> None:
    formatter = KeyValueFormatter("%(asctime)s")
    plain = logging.Formatter("%(asctime)s")
    for created in (1_700_000_000.123, 1_700_000_000.999, 1_700_000_001.004):
        made = record("x")
        made.created, made.msecs = created, int((created - int(created)) * 1000) + 0.0
        assert formatter.format(made) == plain.format(made)


def test_a_relayed_line_is_written_as_its_record_would_be() -> None:
    """The writer thread formats relayed lines without making records: byte for byte what
    formatting the record gives, across seconds, levels and odd messages."""
    fast, slow = KeyValueFormatter(logs.FORMAT), KeyValueFormatter(logs.FORMAT)
    for created in (1_700_000_000.0, 1_700_000_000.0009, 1_700_000_000.999, 1_700_000_001.5):
        for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, 5):
            for message in ("slot launch_slot_: id 0 | task 3", "100% done %s %(x)d", "é\tx"):
                assert fast.format_line("router.child", level, message, created) == \
                    slow.format(logs._record("router.child", level, message, created))


def test_relayed_lines_through_the_writer_keep_their_text_and_order() -> None:
    stream = io.StringIO()
    handler = BackgroundStreamHandler(stream)
    handler.setFormatter(KeyValueFormatter(logs.FORMAT))
    try:
        for i in range(50):
            handler.relay("router.child", logging.INFO, f"line {i}")
        handler.emit(record("after them"))
    finally:
        handler.close()
    lines = stream.getvalue().splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == [f"line {i}" for i in range(50)] + [
        "after them"]
    assert all(" INFO router.child: " in line for line in lines[:50])
