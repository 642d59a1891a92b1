"""What each team used, per model: requests, prompt and generated tokens, time queued in the
router, refusals; kept in SQLite in the state directory so that it survives restarts.

``Usage`` is the ledger: ``served`` adds a request that reached a model (the tokens its client
was told in ``usage``: the child's own count), ``refused`` one that a quota or the wait ended.
It keeps every total in memory (one row per team and model, a handful) and ``flush`` writes
the rows changed since to ``usage.sqlite3`` (``UsageStore``), off the event loop, every few
seconds and when the router stops. Without a state directory it lives in memory only.

The writer survives what it is given: a row SQLite cannot hold (a count past its 64-bit
integers, which only a bug or a hostile upstream could make: ``tail`` clamps the counts it
reads) is skipped and logged once, the other rows written; a write that fails is logged and
tried again with the next. ``usage.sqlite3`` (and its journal files) must be regular files,
not symbolic links: anything else there is refused (``UnsafeFile``) before SQLite opens it,
which would follow a link out of the state directory or wait on a FIFO.

For the fairness figures (``/metrics``), it also keeps each team's weighted service over the
last ``WINDOW_S`` seconds, and when its requests last waited: ``jain`` is Jain's index over the
teams that waited in that window (1: equal shares; 1/n: one team took all). Reading them
changes nothing; what left the window is dropped as the next request is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import errno
import io
import logging
import math
import os
import sqlite3
import stat
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .. import clock
from .fairshare import GENERATED_WEIGHT

log = logging.getLogger("router.usage")

WINDOW_S = 60.0
FLUSH_S = 5.0
FILE_NAME = "usage.sqlite3"


@dataclass
class Row:
    name: str
    model: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_seconds: float = 0.0
    refusals: int = 0


COLUMNS = tuple(f.name for f in fields(Row))


def jain(values: Iterable[float]) -> float | None:
    """Jain's fairness index of ``values`` (None for none, or all zero)."""
    values = list(values)
    square = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * square) if square else None


class UnsafeFile(OSError):
    """``usage.sqlite3`` (or one of its journal files) is a symbolic link or not a regular
    file: refused, never opened through."""

    def __str__(self) -> str:
        return f"{self.filename} is {self.strerror}: refused (remove it)"


# The files SQLite opens for a database: each must be a regular file, never a link.
_SQLITE_SUFFIXES = ("", "-journal", "-wal", "-shm")
_INSERT = (f"INSERT OR REPLACE INTO usage ({', '.join(COLUMNS)}) VALUES "
           f"({', '.join('?' * len(COLUMNS))})")


def check_file(path: Path) -> None:
    """Refuse (``UnsafeFile``) a ``path`` that is a symbolic link or anything but a regular
    file (one that is missing is fine: SQLite makes it), and the same of its journal files,
    without following a link or opening a FIFO. ``statestore.open_regular`` is the check of
    the state directory's other files; SQLite opens this one itself."""
    for name in (f"{path}{suffix}" for suffix in _SQLITE_SUFFIXES):
        try:
            mode = os.lstat(name).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            raise UnsafeFile(errno.ELOOP, "a symbolic link (never followed)", name)
        if not stat.S_ISREG(mode):
            raise UnsafeFile(errno.EINVAL, "not a regular file", name)


def _count(value: object) -> int:
    """A count read back from the file: a non-negative integer, else 0 (a file edited by
    hand must not break the ledger)."""
    return value if type(value) is int and value >= 0 else 0


def _seconds(value: object) -> float:
    """Seconds read back from the file: a finite number, at least 0, else 0."""
    number = float(value) if type(value) in (int, float) else 0.0  # type: ignore[arg-type]
    return number if math.isfinite(number) and number >= 0 else 0.0


class UsageStore:
    """The rows in SQLite (``usage.sqlite3``): read once at start, written by ``save``; the
    file is checked (``check_file``) before every connection."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _connect(self) -> sqlite3.Connection:
        check_file(self.path)
        db = sqlite3.connect(self.path, timeout=10)
        db.execute("CREATE TABLE IF NOT EXISTS usage (name TEXT NOT NULL, model TEXT NOT NULL,"
                   " requests INTEGER, prompt_tokens INTEGER, completion_tokens INTEGER,"
                   " queue_seconds REAL, refusals INTEGER, PRIMARY KEY (name, model))")
        return db

    def load(self) -> list[Row]:
        with contextlib.closing(self._connect()) as db:
            return [Row(str(name), str(model), _count(requests), _count(prompt),
                        _count(completion), _seconds(queued), _count(refusals))
                    for name, model, requests, prompt, completion, queued, refusals
                    in db.execute(f"SELECT {', '.join(COLUMNS)} FROM usage")]

    def save(self, rows: list[Row]) -> list[tuple[Row, str]]:
        """Write ``rows`` in one transaction; those SQLite cannot hold (a number past its
        64-bit integers) are skipped, and returned with why."""
        skipped = []
        with contextlib.closing(self._connect()) as db, db:
            for row in rows:
                try:
                    db.execute(_INSERT, tuple(asdict(row).values()))
                except (OverflowError, ValueError, TypeError, sqlite3.InterfaceError,
                        sqlite3.ProgrammingError) as exc:
                    skipped.append((row, f"{type(exc).__name__}: {exc}"))
        return skipped


class Usage:
    def __init__(self, store: UsageStore | None = None,
                 now: Callable[[], float] = clock.now) -> None:
        self.store = store
        self._now = now
        self._rows: dict[tuple[str, str], Row] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._served: deque[tuple[float, str, float]] = deque()  # (when, name, service)
        self._waited: dict[str, float] = {}  # name: when one of its requests last waited
        self._bad: set[tuple[str, str]] = set()  # rows the file cannot hold, said once each
        self._said = ""  # the last write's problem, said once while it lasts
        if store is not None:
            for row in store.load():
                self._rows[(row.name, row.model)] = row

    def _row(self, name: str, model: str) -> Row:
        key = (name, model)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = Row(name, model)
        self._dirty.add(key)
        return row

    def served(self, name: str, model: str, prompt: int, completion: int,
               queued_s: float) -> None:
        """A request of team ``name`` reached ``model``: its tokens, its time queued here."""
        row = self._row(name, model)
        row.requests += 1
        row.prompt_tokens += prompt
        row.completion_tokens += completion
        row.queue_seconds += queued_s
        now = self._now()
        self._served.append((now, name, prompt + GENERATED_WEIGHT * completion))
        if queued_s > 0:
            self._waited[name] = now
        self._forget_old(now)

    def refused(self, name: str, model: str) -> None:
        self._row(name, model).refusals += 1

    def rows(self) -> list[Row]:
        return sorted(self._rows.values(), key=lambda r: (r.name, r.model))

    def csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(COLUMNS)
        for row in self.rows():
            writer.writerow(asdict(row).values())
        return out.getvalue()

    def recent_service(self) -> dict[str, float]:
        """Each team's weighted service over the last ``WINDOW_S`` seconds (read only: what
        left the window is dropped when the next request is served)."""
        now = self._now()
        service: dict[str, float] = {}
        for when, name, amount in self._served:
            if now - when <= WINDOW_S:
                service[name] = service.get(name, 0.0) + amount
        return service

    def jain(self) -> float | None:
        """Jain's index over the recent service of the teams that waited lately."""
        service = self.recent_service()
        now = self._now()
        waited = [n for n, at in self._waited.items() if now - at <= WINDOW_S]
        return jain(service.get(n, 0.0) for n in waited) if len(waited) > 1 else None

    def _forget_old(self, now: float) -> None:
        served = self._served
        while served and now - served[0][0] > WINDOW_S:
            served.popleft()
        for name in [n for n, at in self._waited.items() if now - at > WINDOW_S]:
            del self._waited[name]

    async def flush(self) -> None:
        """Write the rows changed since the last write (in a thread)."""
        if self.store is None or not self._dirty:
            return
        rows = self._changed()
        try:
            skipped = await asyncio.to_thread(self.store.save, rows)
        except Exception as exc:  # whatever it was, the writer carries on
            self._unwritten(rows, exc)
        else:
            self._said = ""
            self._skipped(skipped)

    async def run(self) -> None:
        """Flush every ``FLUSH_S`` until cancelled, then write what is left at once."""
        try:
            while True:
                await asyncio.sleep(FLUSH_S)
                await self.flush()
        finally:
            self.save_now()

    def save_now(self) -> None:
        """Write the rows changed since the last write, here and now (the router stops)."""
        if self.store is None or not self._dirty:
            return
        rows = self._changed()
        try:
            skipped = self.store.save(rows)
        except Exception as exc:  # the router stops anyway: said, not raised
            self._unwritten(rows, exc)
        else:
            self._said = ""
            self._skipped(skipped)

    def _changed(self) -> list[Row]:
        """The rows changed since the last write, copied (a thread may write them), and
        marked written."""
        rows = [Row(**asdict(self._rows[key])) for key in self._dirty]
        self._dirty = set()
        return rows

    def _unwritten(self, rows: list[Row], exc: BaseException) -> None:
        """``rows`` could not be written: they are written with the next ones (a problem is
        said once while it lasts)."""
        self._dirty.update((row.name, row.model) for row in rows)
        assert self.store is not None
        problem = f"{type(exc).__name__}: {exc}"
        if problem != self._said:
            self._said = problem
            log.warning("could not write the usage to %s (%s); it is tried again with the "
                        "next write", self.store.path, problem,
                        extra={"event": "usage_unwritten"})

    def _skipped(self, skipped: list[tuple[Row, str]]) -> None:
        """Rows the file cannot hold: left out of it (each said once), the rest written."""
        for row, why in skipped:
            key = (row.name, row.model)
            if key not in self._bad:
                self._bad.add(key)
                log.warning("usage of %r on model %r cannot be written (%s): left out of "
                            "%s, the other rows written", row.name, row.model, why,
                            FILE_NAME, extra={"event": "usage_row_skipped"})
