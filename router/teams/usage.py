"""What each team used, per model: requests, prompt and generated tokens, time queued in the
router, refusals; kept in SQLite in the state directory so that it survives restarts.

``Usage`` is the ledger: ``served`` adds a request that reached a model (the tokens its client
was told in ``usage``: the child's own count), ``refused`` one that a quota or the wait ended.
It keeps every total in memory (one row per team and model, a handful) and ``flush`` writes
the rows changed since to ``usage.sqlite3`` (``UsageStore``), off the event loop, every few
seconds and when the router stops. Without a state directory it lives in memory only.

For the fairness figures (``/metrics``), it also keeps each team's weighted service over the
last ``WINDOW_S`` seconds, and when its requests last waited: ``jain`` is Jain's index over the
teams that waited in that window (1: equal shares; 1/n: one team took all).
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import logging
import sqlite3
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


class UsageStore:
    """The rows in SQLite (``usage.sqlite3``): read once at start, written by ``save``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=10)
        db.execute("CREATE TABLE IF NOT EXISTS usage (name TEXT NOT NULL, model TEXT NOT NULL,"
                   " requests INTEGER, prompt_tokens INTEGER, completion_tokens INTEGER,"
                   " queue_seconds REAL, refusals INTEGER, PRIMARY KEY (name, model))")
        return db

    def load(self) -> list[Row]:
        with contextlib.closing(self._connect()) as db:
            return [Row(*values) for values in db.execute(
                f"SELECT {', '.join(COLUMNS)} FROM usage")]

    def save(self, rows: list[Row]) -> None:
        with contextlib.closing(self._connect()) as db, db:
            db.executemany(f"INSERT OR REPLACE INTO usage ({', '.join(COLUMNS)}) VALUES "
                           f"({', '.join('?' * len(COLUMNS))})",
                           [tuple(asdict(row).values()) for row in rows])


class Usage:
    def __init__(self, store: UsageStore | None = None,
                 now: Callable[[], float] = clock.now) -> None:
        self.store = store
        self._now = now
        self._rows: dict[tuple[str, str], Row] = {}
        self._dirty: set[tuple[str, str]] = set()
        self._served: deque[tuple[float, str, float]] = deque()  # (when, name, service)
        self._waited: dict[str, float] = {}  # name: when one of its requests last waited
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
        """Each team's weighted service over the last ``WINDOW_S`` seconds."""
        self._forget_old(self._now())
        service: dict[str, float] = {}
        for _, name, amount in self._served:
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
            await asyncio.to_thread(self.store.save, rows)
        except (OSError, sqlite3.Error) as exc:
            self._unwritten(rows, exc)

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
            self.store.save(rows)
        except (OSError, sqlite3.Error) as exc:
            self._unwritten(rows, exc)

    def _changed(self) -> list[Row]:
        """The rows changed since the last write, copied (a thread may write them), and
        marked written."""
        rows = [Row(**asdict(self._rows[key])) for key in self._dirty]
        self._dirty = set()
        return rows

    def _unwritten(self, rows: list[Row], exc: BaseException) -> None:
        """``rows`` could not be written: they are written with the next ones."""
        self._dirty.update((row.name, row.model) for row in rows)
        assert self.store is not None
        log.warning("could not write the usage to %s: %s", self.store.path, exc)
