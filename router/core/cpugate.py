"""Turns on the CPU: models whose children share cores compute one at a time, in short turns.

Why: every CPU model's children span the machine's cores (``cpus``), so a model alone runs
at full speed. Two such models generating at once would put twice as many threads as cores
on them, and ggml's threads spin-wait at every barrier: each stalls the other (measured on 2
cores: 25 to 35 times as long as one after the other). Gang scheduling removes that: while
more than one of them has requests in flight, they take turns of ``TURN_S``; the model whose
turn it is runs, the others are paused with SIGSTOP (every thread at once, so no thread spins
waiting for a stopped sibling) and continued with SIGCONT when their turn comes. Two models at
once then finish in about the time of one after the other, and each streams tokens throughout.

Members are the models with a *wide* child (more than one thread): single-threaded children
never spin at a barrier, so they simply share cores with whoever runs.

Contract: a child is paused only while its model has requests in flight and another member
does too; the gate continues every child it paused as soon as that stops being true, when it
closes, and ``Backend.stop`` continues a child before it waits for it to exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from .. import clock
from ..children.backend import Backend

log = logging.getLogger("router.cpugate")

TURN_S = 0.05  # long enough that switching costs nothing measurable, short for streams

Members = Callable[[], dict[str, list[Backend]]]


def next_turn(active: Sequence[str], current: str | None) -> str:
    """Round robin: the model after ``current`` in ``active`` (the first when ``current`` is
    not active). ``active`` is not empty."""
    if current in active:
        return active[(active.index(current) + 1) % len(active)]
    return active[0]


class CpuGate:
    """Gives members their turns. ``busy(model)`` and ``idle(model)`` when a model's in-flight
    count goes from 0 to more and back (the hot path: a set insert or discard; the gate wakes
    only when that can change a turn: a second model busy, or a model idle while turns are on
    or a child is paused); ``notify()`` for any other change."""

    def __init__(self, members: Members, turn_s: float = TURN_S) -> None:
        self._members = members
        self.turn_s = turn_s
        self._wake = asyncio.Event()
        self._paused: set[Backend] = set()
        self._current: str | None = None
        self._turn_ends = 0.0
        self.turns = 0  # turns given while models took turns (``/metrics``)
        self._task: asyncio.Task[None] | None = None
        self._busy: set[str] = set()  # models with requests in flight (``busy``, ``idle``)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="cpu-gate")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._resume_all()

    def notify(self) -> None:
        self._wake.set()

    def busy(self, model: str) -> None:
        """``model`` has requests in flight now. With no other model busy there is nothing to
        take turns with: nothing to wake for (one model serving pays nothing per request)."""
        self._busy.add(model)
        if len(self._busy) >= 2:
            self._wake.set()

    def idle(self, model: str) -> None:
        """``model``'s last request in flight ended: turns may end, a paused child may go on."""
        self._busy.discard(model)
        if self._current is not None or self._paused:
            self._wake.set()

    @property
    def paused(self) -> frozenset[Backend]:
        return frozenset(self._paused)

    def is_paused(self, child: Backend) -> bool:
        return child in self._paused

    async def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                try:
                    wait = self._step(self._members(), clock.now())
                except Exception:  # a bug here must not leave children paused or stop turns
                    log.exception("CPU turns failed; every child continues")
                    self._resume_all()
                    wait = None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()
        finally:
            self._resume_all()

    def _step(self, active: dict[str, list[Backend]], now: float) -> float | None:
        """Pause and continue children for this moment; how long until the next turn
        (None: until something changes)."""
        if len(active) < 2:
            self._current = None
            self._resume_all()
            return None
        if self._current not in active or now >= self._turn_ends:
            self._current = next_turn(list(active), self._current)
            self._turn_ends = now + self.turn_s
            self.turns += 1
        running = set(active[self._current])
        for model, children in active.items():
            if model != self._current:
                for child in children:
                    if child not in running and child not in self._paused and child.pause():
                        self._paused.add(child)
        for child in list(self._paused):
            if child in running or not any(child in c for c in active.values()):
                child.resume()
                self._paused.discard(child)
        return max(self._turn_ends - now, 0.0)

    def _resume_all(self) -> None:
        for child in self._paused:
            child.resume()
        self._paused.clear()
