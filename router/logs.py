"""The router's own log: one line per event on stderr, with structured ``key=value`` fields."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

FIELDS = ("event", "model", "pid", "port", "exit_code", "duration")
FOLLOW_QUEUE_SIZE = 1000


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
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = [f"{name}={getattr(record, name)}" for name in FIELDS
                  if getattr(record, name, None) is not None]
        return f"{base} {' '.join(extras)}" if extras else base


FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter(FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
