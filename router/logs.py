"""The router's own log: one line per event on stderr, with structured ``key=value`` fields.

At the default level every line a child prints is logged too (``relay``), and llama-server
prints several as it starts each request: those are formatted and written on a thread
(``BackgroundStreamHandler``), so the event loop that relays the request's first token only
hands each line over. The router's own events are written at once, after any child line
handed over before them.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

FIELDS = ("event", "model", "pid", "port", "exit_code", "duration")
FOLLOW_QUEUE_SIZE = 1000
# The writer thread waits this long after a relayed line arrives before it writes, so that a
# burst (a child's lines around a request) is formatted and written at once, after the burst.
BATCH_DELAY_S = 0.005
# Relayed lines waiting for the writer at most; beyond that (stderr blocked) new ones are
# dropped and counted, rather than blocking the event loop or growing without bound.
MAX_PENDING = 100_000


class LogRing:
    """The last ``maxlen`` lines of a log, with their times, and live followers.

    ``append`` must be called on the event loop's thread. A follower that falls behind loses
    its oldest lines; the ring itself never blocks.
    """

    def __init__(self, maxlen: int) -> None:
        self.lines: deque[tuple[float, str]] = deque(maxlen=maxlen)
        self._followers: set[asyncio.Queue[str]] = set()

    def append(self, line: str) -> None:
        self.lines.append((time.time(), line))
        for queue in self._followers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(line)

    def tail(self, n: int) -> list[str]:
        return [line for _, line in list(self.lines)[-n:]] if n > 0 else []

    @contextmanager
    def follow(self) -> Iterator[asyncio.Queue[str]]:
        queue: asyncio.Queue[str] = asyncio.Queue(FOLLOW_QUEUE_SIZE)
        self._followers.add(queue)
        try:
            yield queue
        finally:
            self._followers.discard(queue)


class RingHandler(logging.Handler):
    """Copies the router's own formatted log lines into a LogRing (for ``GET /logs``)."""

    def __init__(self, ring: LogRing, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.ring = ring
        self.loop = loop

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # a logging handler must never raise
            self.handleError(record)
            return
        if self.loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.ring.append(line)
        else:
            self.loop.call_soon_threadsafe(self.ring.append, line)


class KeyValueFormatter(logging.Formatter):
    def __init__(self, fmt: str | None = None) -> None:
        super().__init__(fmt)
        self._second = -1
        self._second_text = ""

    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = [f"{name}={getattr(record, name)}" for name in FIELDS
                  if getattr(record, name, None) is not None]
        return f"{base} {' '.join(extras)}" if extras else base

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        """``logging``'s default time format, with the date and time of the second cached
        (most lines come in bursts within one second)."""
        if datefmt:
            return super().formatTime(record, datefmt)
        return f"{self._second_of(record.created)},{int(record.msecs):03d}"

    def _second_of(self, created: float) -> str:
        """The date and time of ``created``'s second, cached."""
        second = int(created)
        if second != self._second:
            self._second_text = time.strftime(self.default_time_format,
                                              self.converter(second))
            self._second = second
        return self._second_text


    def format_line(self, name: str, level: int, message: str, created: float) -> str:
        """What ``format`` writes for a record of ``message`` (no arguments, no fields) from
        logger ``name`` at ``level``, stamped ``created``, with ``FORMAT``; without making the
        record (most of the cost of a relayed line: ``BackgroundStreamHandler``)."""
        msecs = int((created - int(created)) * 1000)
        return (f"{self._second_of(created)},{msecs:03d} {logging.getLevelName(level)} "
                f"{name}: {message}")


FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# A relayed line: (logger name, level, message, time.time() when it was handed over).
_Relayed = tuple[str, int, str, float]


class BackgroundStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A ``StreamHandler`` that also takes lines to write later, on its own thread.

    ``emit`` (every record logged the usual way: the router's own events) writes at once, as
    a ``StreamHandler`` does, after the relayed lines still pending, so the log keeps its
    order. ``relay`` only queues a line (no ``LogRecord``, no formatting); the writer thread
    waits ``BATCH_DELAY_S`` for the rest of the burst, then formats and writes it all with
    one ``write``. Relayed lines reach this handler only, not the logger's other handlers.
    ``flush()`` (called by ``logging.shutdown`` at exit) writes what is pending.
    """

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__(stream if stream is not None else sys.stderr)
        self.dropped = 0
        self._pending: deque[_Relayed] = deque()
        # Taking pending lines and writing them, in order; reentrant: a signal handler that
        # logs may interrupt a write on the same thread.
        self._io = threading.RLock()
        self._wake = threading.Event()  # lines are pending
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def relay(self, name: str, level: int, message: str) -> None:
        """Write ``message`` as is (no %-formatting) as logger ``name``'s at ``level``, soon,
        from the writer thread. Never blocks."""
        if len(self._pending) >= MAX_PENDING:
            self.dropped += 1
            return
        self._pending.append((name, level, message, time.time()))
        if not self._wake.is_set():
            self._wake.set()

    def emit(self, record: logging.LogRecord) -> None:
        self._write_pending(record)

    def flush(self) -> None:
        self._write_pending()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(2.0)
        self.flush()
        super().close()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait()
            time.sleep(BATCH_DELAY_S)  # let the rest of the burst arrive
            self._wake.clear()
            self._write_pending()

    def _write_pending(self, after: logging.LogRecord | None = None) -> None:
        """Format and write the pending relayed lines, then ``after``; one ``write``."""
        with self._io:
            records: list[logging.LogRecord] = []
            lines: list[str] = []
            formatter = self.formatter
            if isinstance(formatter, KeyValueFormatter) and formatter._fmt == FORMAT:
                # The usual case: each relayed line written without making its record.
                while self._pending:
                    lines.append(formatter.format_line(*self._pending.popleft()))
            while self._pending:
                records.append(_record(*self._pending.popleft()))
            dropped, self.dropped = self.dropped, 0
            if dropped:
                records.append(_record("router.logs", logging.WARNING,
                                       f"{dropped} child output lines dropped: stderr did not "
                                       "keep up", time.time()))
            if after is not None:
                records.append(after)
            for record in records:
                try:
                    lines.append(self.format(record))
                except Exception:  # a logging handler must never raise
                    self.handleError(record)
            if not lines:
                return
            try:
                self.stream.write("\n".join(lines) + "\n")
                self.stream.flush()
            except Exception:
                self.handleError(records[-1] if records else _record(
                    "router.logs", logging.ERROR, "writing the log failed", time.time()))


def _record(name: str, level: int, message: str, created: float) -> logging.LogRecord:
    """A record of ``message`` (no arguments, no caller lookup) stamped ``created``."""
    record = logging.LogRecord(name, level, __file__, 0, message, (), None)
    record.relativeCreated -= (record.created - created) * 1000.0
    record.created = created
    record.msecs = int((created - int(created)) * 1000) + 0.0
    return record


_background: BackgroundStreamHandler | None = None  # the one ``configure`` installed


def relay(logger: logging.Logger, level: int, message: str) -> None:
    """Log a line that arrived on the event loop (a child's output) as cheaply as can be:
    to the background handler's thread when ``configure`` installed one (then to it alone),
    else through ``logger`` at once. The caller checks ``logger.isEnabledFor(level)`` first."""
    handler = _background
    if handler is not None and handler.running:
        handler.relay(logger.name, level, message)
    else:
        logger.handle(_record(logger.name, level, message, time.time()))


def configure(level: str = "info") -> None:
    global _background
    handler = BackgroundStreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(FORMAT))
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, BackgroundStreamHandler):
            old.close()
    root.handlers[:] = [handler]
    _background = handler
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
