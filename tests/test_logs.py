"""The router's own log: the ring behind ``/logs``, its followers, and the handler feeding it."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from router import logs
from router.logs import KeyValueFormatter, LogRing, RingHandler


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
    try:
        logs.configure("warning")
        assert root.level == logging.WARNING
        assert len(root.handlers) == 1
        assert isinstance(root.handlers[0].formatter, KeyValueFormatter)
        assert logging.getLogger("httpx").level == logging.WARNING
        assert logging.getLogger("httpcore").level == logging.WARNING
    finally:
        root.handlers[:], level, levels = saved
        root.setLevel(level)
        for quiet, old in zip(quieted, levels, strict=True):
            quiet.setLevel(old)
