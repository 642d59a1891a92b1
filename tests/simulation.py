"""Deterministic simulation of the whole scheduling core, with its invariants.

The real ``Supervisor`` (with its admission queue, planner, loader, executor, lifecycle,
leases, liveness probes and idle reaper) runs in-process on a virtual-time event loop
(``simloop``) against fake children (``FakeChild``, started by ``FakeSpawner``). A seeded
random driver plays a schedule on it: requests for several models with random lengths, wait
budgets and clients that leave; explicit loads and unloads; children that crash, freeze
(stop answering their health checks and their requests), start slowly, fail to start or never
become healthy; ``--models-max`` 1 to 3, replicas, memory budgets, reconfigurations. Requests
make the same call as the proxy's (``Supervisor.acquire`` with its ``wait.Ends``: the client's
disconnect and the shutdown).

Whenever the loop is quiescent (everything ran as far as it can at this instant, right before
virtual time moves on), and on every lifecycle event, the invariants are checked:

* capacity: never more models holding a process than ``--models-max``, nor more estimated
  memory than the budget;
* a model with requests in flight is never evicted (stopped other than by an explicit unload
  or the shutdown);
* residency (a preset's ``pin`` and ``min-resident``, drawn for some models): a pinned model is
  never evicted, drained or stopped by its idle TTL, nor a model within its minimum residency;
  when the pins fill ``--models-max`` or the budget, requests for the other models are
  refused at once (no wedge: every request ends, served or refused); a request's keep_alive
  (drawn for one in ten) with no idle TTL is never stopped by its idle TTL, and its ``0`` is
  an explicit unload, which neither holds back;
* no wedge: whenever a request waits, something runs, loads or stops on its behalf (see
  ``_check_progress``), and the head of the admission queue has a drain under way once it has
  waited the fairness bound;
* every drain ends: a draining model with nothing in flight is stopping, and a drain made for
  a swap is lifted when nobody waits for that swap any more;
* ``in_flight`` and ``waiting`` equal the requests that really hold a replica or wait, and
  the requests holding a slot (``slotqueue``: each request is one of three teams, in one of
  the three priority classes) equal those holding a lease;
* a slot never idles while a request waits for one that it may take (the slot queue is
  work-conserving), and the classes below the interactive one never hold the slots a
  preset's ``interactive-slots`` keep for it;
* the teams' quotas hold (``max-concurrent``, tokens a minute: each request is first admitted
  by them, 429 over one), and their order is fair: VTC's bound between backlogged flows of a
  class, and no starvation inside a class (``simteams``; ``traffic="teams"`` plays floods
  that build the queues);
* what the rest of the router reads of each model (its published snapshot) is its record as
  it is now;
* each model's published status sequence is a path through the lifecycle, and no event is one
  the lifecycle refuses (``InvalidTransition``);
* every request is answered within its wait budget plus a bound, and at the end no model is
  left draining or waited for, and no fake child is left running.

A third of the schedules (``saves="hang"``) run with warm swaps on a stalled disk: every slot
save hangs (a child that never answers ``action=save``) and every commit too; the real bounds
end each wait (``WarmSwaps.write``'s, ``restore``'s, the router's stop's), and the invariants
above must hold all the same.

``run_schedule(seed)`` returns the violations found (empty: none); the seed alone reproduces the
run exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import random
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any, cast

import httpx
from simloop import Stalled, VirtualTimeLoop
from simteams import CHARGED, GENERATED, PROMPT_TOKENS, USED, TeamsBook, turn_of

from router import clock
from router.children.backend import Backend
from router.children.process import ChildExited, ChildTimeout
from router.config.presets import ModelPreset
from router.config.settings import Settings
from router.config.sources import Catalogue
from router.core.lifecycle import (
    ChildStarted,
    Drain,
    Event,
    InvalidTransition,
    Refuse,
    Status,
    Stop,
)
from router.core.runtime import Estimated, ModelRuntime
from router.core.spawner import Spawner
from router.core.supervisor import Supervisor
from router.core.wait import Ends
from router.core.wiring import wire
from router.edge.metering import charged
from router.errors import ClientGone, RouterError
from router.events import EventBus
from router.http.shutdown import Shutdown
from router.http.tail import ResponseTail, Timings
from router.llama.flags import FlagTable
from router.serving.affinity import Prefix
from router.serving.leases import Lease
from router.teams.fairshare import Turn
from router.teams.quotas import OverQuota
from router.warm.conversations import DISPLACE_BOUND_S
from router.warm.digests import Digests
from router.warm.slotbook import Conversation
from router.warm.statestore import PendingSave, SavedState, StateStore
from router.warm.swaps import WarmSwaps, Written

MODEL_IDS = ("a", "b", "c", "d")
MEMORY_UNIT = 1000  # bytes one model is estimated to need, in configurations with a budget
ANSWER_SLACK_S = 0.5  # a refused request is answered within its budget plus this
SETTLE_S = 120.0  # after the last request, everything must be quiet within this
SHUTDOWN_GRACE_S = 5.0  # the shutdown grace of ``build``'s settings

# Public statuses a model's events may go through (``lifecycle``): the next status allowed.
NEXT_STATUS = {
    "unloaded": {"unloaded", "downloading", "loading"},
    "downloading": {"unloaded"},
    "loading": {"loaded", "unloaded"},
    "loaded": {"loaded", "unloaded"},
}


@functools.cache
def base_settings() -> Settings:
    """Validated once (reading the environment is most of a schedule's cost otherwise); each
    schedule copies it with its own values, which are valid by construction."""
    return Settings(cpu_sharing=False)


@dataclass(frozen=True)
class Config:
    """One simulated router: its settings and the behaviour of its children."""

    models: tuple[str, ...]
    models_max: int
    memory_budget: int | None  # bytes; each model needs MEMORY_UNIT x its size
    sizes: dict[str, int]
    replicas: dict[str, int]
    fairness: float
    wait_budget: float
    stop_timeout: float
    load_timeout: float
    liveness: bool
    ttl: float  # --idle-timeout (0: never)
    pinned: frozenset[str] = frozenset()  # models whose preset says ``pin = true``
    min_resident: Mapping[str, float] = field(default_factory=dict)  # ``min-resident``

    @classmethod
    def draw(cls, rng: random.Random) -> Config:
        models = MODEL_IDS[:rng.randint(2, 4)]
        memory = rng.random() < 0.3
        return cls(
            models=models,
            models_max=rng.choice((1, 1, 2, 2, 3)) if not memory else 0,
            memory_budget=MEMORY_UNIT * rng.randint(2, 3) if memory else None,
            sizes={m: rng.choice((1, 1, 2)) if memory else 1 for m in models},
            replicas={m: (2 if rng.random() < 0.2 else 1) for m in models},
            fairness=rng.choice((1.0, 3.0, 10.0)),
            wait_budget=rng.choice((5.0, 20.0, 60.0)),
            stop_timeout=rng.choice((0.5, 2.0, 10.0)),
            load_timeout=rng.choice((5.0, 30.0)),
            liveness=rng.random() < 0.5,
            ttl=rng.choice((0.0, 0.0, 8.0)),
        )

    def with_residency(self, rng: random.Random) -> Config:
        """This configuration with residency keys drawn by ``rng`` (its own generator: the
        seed's other draws stay what they were): a pinned model in a quarter of them, a
        ``min-resident`` on some models in a third."""
        pinned = frozenset({rng.choice(self.models)}) if rng.random() < 0.25 else frozenset()
        resident = {m: rng.choice((1.0, 4.0, 15.0)) for m in self.models
                    if rng.random() < 0.5} if rng.random() < 1 / 3 else {}
        return replace(self, pinned=pinned, min_resident=resident)


@dataclass
class Request:
    id: int
    model: str
    at: float
    duration: float
    budget: float | None  # the client's x-wait-budget, if it sent one
    leave_after: float | None  # the client disconnects after this long, if at all
    started: float = 0.0
    leased_at: float | None = None
    ended: float | None = None
    outcome: str = "pending"  # ok, left, <status> <error type>, crashed, unloaded
    lease: Lease | None = None
    keep_alive: float | None = None  # its body's keep_alive, read (``edge.keepalive``)


# ----------------------------------------------------------------------------- fake children

class FakePool:
    """What the proxy would use to reach the child: here only its abort."""

    def __init__(self, child: FakeChild) -> None:
        self._child = child
        self.open_connections = 0

    def abort_all(self, error: RouterError | None = None) -> None:
        self._child.break_requests("crashed" if error is None
                                   else f"{error.status} {type(error).__name__}")

    async def aclose(self) -> None:
        pass


class FakeChild:
    """A llama-server child in virtual time: it starts, serves, stops, crashes or freezes as
    the simulation says. Requests it serves wait on ``broken`` (it exited or its connections
    were aborted) or their own length."""

    pid: int | None = None
    cpu = None
    ready_info: dict[str, Any] | None = None
    progress: dict[str, Any] | None = None

    def __init__(self, sim: Simulation, model_id: str) -> None:
        sim.children.append(self)
        self.sim = sim
        self.model_id = model_id
        self.port = 0
        self.base_url = "http://fake"
        self.started_at: float | None = clock.now()
        self.frozen = False
        self.serving = 0  # requests it is answering
        self.connections = FakePool(self)
        loop = asyncio.get_running_loop()
        self._exit: asyncio.Future[int] = loop.create_future()
        self.broken: asyncio.Future[str] = loop.create_future()

    def __repr__(self) -> str:
        return f"<FakeChild {self.model_id} rc={self.returncode}>"

    @property
    def returncode(self) -> int | None:
        return self._exit.result() if self._exit.done() else None

    def exit(self, code: int) -> None:
        if not self._exit.done():
            self._exit.set_result(code)
        self.break_requests("crashed")

    def break_requests(self, why: str) -> None:
        if not self.broken.done():
            self.broken.set_result(why)

    async def wait_exit(self) -> int:
        return await asyncio.shield(self._exit)

    async def stop(self, timeout: float) -> int | None:
        """SIGTERM: an idle child exits at once; one still answering requests (or frozen)
        exits only once they are over, else is killed after ``timeout``."""
        if self._exit.done():
            return self._exit.result()
        if self.serving and not self.broken.done():
            self.sim.violate(f"a child of {self.model_id} was stopped under {self.serving} "
                             "requests in flight that nobody ended")
        if (self.serving and not self.broken.done()) or self.frozen:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.broken), timeout)
            if self.frozen or not self.broken.done():
                self.exit(-9)
                return -9
        await asyncio.sleep(0.05)
        self.exit(0)
        return self._exit.result()

    def kill_now(self) -> None:
        self.exit(-9)

    async def close_pool(self) -> None:
        pass

    async def probe(self, timeout: float) -> str | None:
        if self.frozen:
            await asyncio.sleep(timeout)
            return f"no answer within {timeout:g} s"
        return None

    def pause(self) -> bool:
        return False

    def resume(self) -> None:
        pass


class HangingSaves(WarmSwaps):
    """Warm swaps on a stalled disk: the children never answer a save, and the commit of what
    they wrote never ends. Only the real bounds end the waits: ``SAVE_BOUND_S`` the stop's,
    ``RESTORE_BOUND_S`` the next load's (it waits for its model's commits through the real
    ``Commits``), ``COMMIT_BOUND_S`` the router's own stop. Nothing is restored; no file is
    touched."""

    def __init__(self) -> None:
        super().__init__(StateStore(Path(tempfile.mkdtemp(prefix="sim-states-")), 1 << 30),
                         "sim", cast(httpx.AsyncClient, None), digests=Digests())
        self.hung = 0  # saves started (each one cut by the bound, or by a cancel)
        self.stalled = 0  # commits started (none ever ends)

    def fingerprint_of(self, preset: ModelPreset) -> str | None:
        return "0" * 64

    async def _save_child(self, preset: ModelPreset, found: str, index: int, child: Backend,
                          keys: list[int] | None, pending: list[PendingSave],
                          written: list[Written]) -> None:
        self.hung += 1
        await asyncio.Event().wait()

    async def write_slot(self, preset: ModelPreset, found: str | None, child: Backend,
                         slot: int, number: int, conversation: Conversation
                         ) -> Written | None:
        self.hung += 1  # a displacement save: only the request's own bound ends it
        await asyncio.Event().wait()
        return None

    async def keep(self, preset: ModelPreset, written: Sequence[Written]) -> int:
        self.stalled += 1
        await asyncio.Event().wait()
        return 0

    async def restorable(self, preset: ModelPreset) -> list[SavedState]:
        await self.settle(preset.id)  # the commits of its last stop, as the real one waits
        return []

    def forget(self, model_id: str) -> None:
        pass


class FakeSpawner(Spawner):
    """Starts ``FakeChild``ren: each start takes a random time and may fail or hang."""

    def __init__(self, sim: Simulation) -> None:
        super().__init__(Path("/nonexistent/llama-server"), FlagTable([]),
                         cast(httpx.AsyncClient, None), sim.events, router_port=0, cores=[],
                         gpus=[], models=lambda: ())
        self.sim = sim

    def cpu_shares(self, runtime: ModelRuntime, count: int) -> list[Any]:
        return [None] * count

    async def model_info(self, child: Any) -> dict[str, Any] | None:
        return None

    async def spawn_ready(self, runtime: ModelRuntime, children: list[Any], timeout: float,
                          started: float, cpu: Any, reports: Any) -> None:
        rng = self.sim.rng
        child = FakeChild(self.sim, runtime.id)
        children.append(child)
        reports.report(runtime, ChildStarted(child))
        left = timeout - (clock.now() - started)
        roll = rng.random()
        delay = rng.choice((0.1, 0.3, 1.0, 3.0))
        if roll < self.sim.spawn_failure:
            await asyncio.sleep(min(delay, left))
            child.exit(1)
            raise ChildExited("llama-server exited with code 1 while loading", [], 1)
        if roll < self.sim.spawn_failure + self.sim.spawn_hang or delay > left:
            await asyncio.sleep(left)
            raise ChildTimeout(f"llama-server did not become healthy within {timeout:g} s", [])
        await asyncio.sleep(delay)


# ----------------------------------------------------------------------------- the simulation

class SimEvents(EventBus):
    """Records every published event synchronously (the order of publication)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[float, str, str, dict[str, Any]]] = []

    def publish(self, model: str, event: str, data: dict[str, Any] | None = None) -> None:
        self.log.append((clock.now(), model, event, dict(data or {})))
        super().publish(model, event, data)


@dataclass
class Simulation:
    seed: int
    horizon: float = 60.0  # virtual seconds of traffic
    actions: int = 40
    spawn_failure: float = 0.05
    spawn_hang: float = 0.02
    config: Config | None = None  # default: drawn from the seed
    script: list[tuple[float, str, dict[str, Any]]] | None = None  # default: drawn
    rng: random.Random = field(init=False)
    violations: list[str] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)
    children: list[FakeChild] = field(default_factory=list)
    events: SimEvents = field(default_factory=SimEvents)
    trace: list[str] = field(default_factory=list)
    saves: str | None = None  # "hang": warm swaps whose saves hang; "none"; default: drawn
    traffic: str = "mixed"  # "teams": a flood of requests from the three teams (``flood``)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        if self.saves is None:  # its own generator: the other draws of a seed stay the same
            self.saves = "hang" if random.Random(self.seed * 7919 + 2).random() < 1 / 3 \
                else "none"
        self.warm = HangingSaves() if self.saves == "hang" else None
        # A quarter of the schedules shut down while their traffic still runs (its own
        # generator: the other draws of a seed stay what they were).
        self.shutdown_live = (self.script is None
                              and random.Random(self.seed * 7919 + 1).random() < 0.25)
        if self.config is None:
            self.config = Config.draw(self.rng).with_residency(
                random.Random(self.seed * 7919 + 3))
        # A request in ten carries a keep_alive: unload once idle, a second, or no idle TTL
        # (its own generator: the other draws of a seed stay what they were).
        self._kept = random.Random(self.seed * 7919 + 4)
        self._status: dict[str, str] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._drains: dict[str, float] = {}  # model -> since when it drains
        self._seen: set[str] = set()
        self.teams = TeamsBook()  # the requests' teams: quotas, and the order's invariants

    # -- building ------------------------------------------------------------------------

    @property
    def cfg(self) -> Config:
        assert self.config is not None
        return self.config

    def build(self) -> Supervisor:
        c = self.cfg
        settings = base_settings().model_copy(update=dict(
            models_max=c.models_max, fairness=c.fairness, wait_budget=c.wait_budget,
            stop_timeout=c.stop_timeout, load_timeout=c.load_timeout,
            memory_budget=str(c.memory_budget) if c.memory_budget is not None else "off",
            liveness_interval=2.0 if c.liveness else 0.0, liveness_timeout=1.0,
            liveness_misses=2, idle_timeout=c.ttl, cpu_sharing=False, max_queue=1000,
            crash_loop_limit=4, shutdown_grace=5.0))
        # The teams' flood gives each model one or two slots a child (queues build at once),
        # and with two, one of them kept for the interactive class half the time.
        slots = self.rng.choice((1, 2)) if self.traffic == "teams" else 0
        kept = self.rng.choice((0, 1)) if slots == 2 else 0
        presets = {m: ModelPreset(m, MappingProxyType(
            {"model": f"/sim/{m}.gguf", **({"parallel": str(slots)} if slots else {})}),
            replicas=c.replicas[m], interactive_slots=kept, pin=m in c.pinned,
            min_resident=c.min_resident.get(m, 0.0)) for m in c.models}
        sup = Supervisor(wire(settings, Catalogue(presets), FlagTable([]), Path("/nonexistent"),
                              cast(httpx.AsyncClient, None), self.events, cores=[],
                              spawner=FakeSpawner(self), warm=self.warm))
        for runtime in sup.models.values():  # what the GGUF header would say
            sup.executor.apply(runtime, Estimated(  # no header to read: a fake file
                MEMORY_UNIT * c.sizes[runtime.id] * c.replicas[runtime.id]))
        self._watch(sup)
        return sup

    def _watch(self, sup: Supervisor) -> None:
        """Check every lifecycle event (and command) as it is applied."""
        command = sup.executor.command

        def checked_command(runtime: ModelRuntime, event: Event) -> Refuse | None:
            if (isinstance(event, Stop) and event.reason not in ("unloaded", "shutdown")
                    and runtime.in_flight > 0):
                self.violate(f"{runtime.id} stopped ({event.reason}) with "
                             f"{runtime.in_flight} requests in flight")
            self._check_residency(runtime, event)
            try:
                return command(runtime, event)
            except InvalidTransition as exc:
                self.violate(f"invalid transition: {exc}")
                raise
        sup.executor.command = checked_command  # type: ignore[method-assign]
        self.sup = sup

    def _check_residency(self, runtime: ModelRuntime, event: Event) -> None:
        """A pinned model is never evicted, drained or stopped by its idle TTL; a model within
        its ``min-resident`` is not yet."""
        if isinstance(event, Stop) and event.reason in ("evicted", "idle"):
            what = f"stopped ({event.reason})"
        elif isinstance(event, Drain):
            what = f"drained for {event.waiting_for}"
        else:
            return
        preset, loaded_at = runtime.preset, runtime.loaded_at
        if isinstance(event, Stop) and event.reason == "idle" and runtime.keep_alive == math.inf:
            self.violate(f"{runtime.id} stopped by its idle TTL though a request's keep_alive "
                         "asked for none")
        if preset.pin:
            self.violate(f"pinned model {runtime.id} {what}")
        elif loaded_at is not None and clock.now() < loaded_at + preset.min_resident:
            self.violate(f"{runtime.id} within its min-resident {what}: loaded "
                         f"{clock.now() - loaded_at:.3f} s ago, min-resident "
                         f"{preset.min_resident:g} s")

    def violate(self, what: str) -> None:
        """Record a violation once (a broken state is seen again at every later check)."""
        key = what.split(" (")[0].split(":")[0]
        if key not in self._seen:
            self._seen.add(key)
            self.violations.append(f"t={clock.now():.3f}: {what}")

    def log(self, what: str) -> None:
        self.trace.append(f"t={clock.now():.3f} {what}")

    # -- the schedule --------------------------------------------------------------------

    def plan(self) -> list[tuple[float, Callable[[], Any]]]:
        if self.script is not None:
            return [(at, self._scripted(n, at, kind, args))
                    for n, (at, kind, args) in enumerate(self.script)]
        if self.traffic == "teams":
            return self.flood()
        rng, c = self.rng, self.cfg
        steps: list[tuple[float, Callable[[], Any]]] = []
        for n in range(self.actions):
            at = rng.uniform(0, self.horizon)
            model = rng.choice(c.models)
            kind = rng.random()
            if kind < 0.7:
                request = Request(
                    n, model, at, duration=rng.choice((0.05, 0.5, 2.0, 8.0, 30.0)),
                    budget=rng.choice((None, None, 2.0, 10.0)),
                    leave_after=rng.choice((None, None, None, 0.5, 5.0)))
                if self._kept.random() < 0.1:
                    request.keep_alive = self._kept.choice((0.0, 1.0, math.inf))
                steps.append((at, lambda r=request: self.request(r)))  # type: ignore[misc]
            elif kind < 0.78:
                steps.append((at, lambda m=model: self.load(m)))  # type: ignore[misc]
            elif kind < 0.86:
                steps.append((at, lambda m=model: self.unload(m)))  # type: ignore[misc]
            elif kind < 0.90:
                steps.append((at, lambda m=model: self.crash(m)))  # type: ignore[misc]
            elif kind < 0.95:
                steps.append((at, lambda m=model: self.reconfigure(m)))  # type: ignore[misc]
            else:
                steps.append((at, lambda m=model: self.freeze(m)))  # type: ignore[misc]
        steps.sort(key=lambda s: s[0])
        return steps

    def flood(self) -> list[tuple[float, Callable[[], Any]]]:
        """The teams' schedule: ``actions`` x 5 requests of the three teams (``simteams``)
        on one or two models of one or two slots a child (``build``), queues building in
        front of their slots, with a crash, an unload or a reconfiguration now and then."""
        rng, c = self.rng, self.cfg
        models = c.models[:rng.choice((1, 2))]
        steps: list[tuple[float, Callable[[], Any]]] = []
        for n in range(self.actions * 5):
            at = rng.uniform(0, self.horizon)
            model = rng.choice(models)
            kind = rng.random()
            if kind < 0.97:
                request = Request(n, model, at, duration=rng.choice((0.2, 0.5, 1.0, 2.0)),
                                  budget=None, leave_after=rng.choice((None,) * 9 + (1.0,)))
                steps.append((at, lambda r=request: self.request(r)))  # type: ignore[misc]
            else:
                act = rng.choice((self.crash, self.unload, self.reconfigure))
                steps.append((at, lambda a=act, m=model: a(m)))  # type: ignore[misc]
        steps.sort(key=lambda s: s[0])
        return steps

    def _scripted(self, n: int, at: float, kind: str, args: dict[str, Any]
                  ) -> Callable[[], Any]:
        if kind == "request":
            request = Request(n, args["model"], at, duration=args.get("duration", 0.05),
                              budget=args.get("budget"), leave_after=args.get("leave_after"))
            return lambda: self.request(request)
        action: Callable[[str], Any] = getattr(self, kind)
        return lambda: action(args["model"])

    async def run(self) -> list[str]:
        sup = self.build()
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        loop.on_quiescent = self.check_quiescent
        sup.start()
        try:
            for at, step in self.plan():
                await asyncio.sleep(max(0.0, at - clock.now()))
                result = step()
                if asyncio.iscoroutine(result):
                    self._spawn(result)
            if self.shutdown_live:
                await self._close_live()
            else:
                await self._settle()
        finally:
            loop.on_quiescent = None
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await sup.close()
            alive = [c for c in self.children if c.returncode is None]
            if alive:
                self.violate(f"children left running after shutdown: {alive}")
        return self.violations

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _close_live(self) -> None:
        """Shut down with the traffic still running: every request ends (served, or refused
        with the shutdown's 503), no load starts any more, and no child outlives the close."""
        self.log("shutdown with requests in flight or waiting")
        grace_end = clock.now() + SHUTDOWN_GRACE_S  # as ``server.py``: requests may finish
        while self._tasks and clock.now() < grace_end:
            await asyncio.wait(set(self._tasks), timeout=grace_end - clock.now())
        for child in self.children:  # the grace is over: ``Shutdown.end`` ends every relay
            if child.serving:
                child.break_requests("shutdown")
        await self.sup.close()
        deadline = clock.now() + SETTLE_S
        while self._tasks and clock.now() < deadline:
            await asyncio.wait(set(self._tasks), timeout=deadline - clock.now())
        pending = [r for r in self.requests if r.ended is None]
        if pending:
            self.violate(f"requests never answered after shutdown: "
                         f"{[(r.id, r.model) for r in pending]}")
        alive = [c for c in self.children if c.returncode is None]
        if alive:
            self.violate(f"children running after shutdown: {alive}")

    async def _settle(self) -> None:
        """Every request ends within its bound; then nothing is left draining or waited for."""
        deadline = clock.now() + SETTLE_S
        while self._tasks and clock.now() < deadline:
            await asyncio.wait(set(self._tasks), timeout=deadline - clock.now())
        while clock.now() < deadline and any(
                m.status in (Status.LOADING, Status.STOPPING) for m in self.sup.models.values()):
            await self.sup.changes.wait(1.0)
        pending = [r for r in self.requests if r.ended is None]
        if pending:
            self.violate(f"requests never answered: {[(r.id, r.model) for r in pending]}")
        for runtime in self.sup.models.values():
            if runtime.draining and not runtime.removed:
                self.violate(f"{runtime.id} left draining after the traffic stopped "
                             f"({runtime!r})")
            if runtime.waiting:
                self.violate(f"{runtime.id} has {runtime.waiting} waiting after the traffic "
                             "stopped")

    # -- actions -------------------------------------------------------------------------

    async def request(self, r: Request) -> None:
        """One request: admitted by its team's quotas (429 over one, never waiting), then
        served (``_serve``); its place and tokens settled as it ends."""
        self.requests.append(r)
        r.started = clock.now()
        turn = turn_of(r.id)
        try:
            hold = self.teams.admit(r.id, USED)
        except OverQuota:
            return self._end(r, "429 OverQuota")
        try:
            await self._serve(r, turn)
        finally:
            self.teams.gone(r.id)
            served = r.leased_at is not None
            # Charged as the edge's meter charges (``metering.charged``); every third child's
            # answer counts nothing (a client that chose its fields, ``/embedding``): then its
            # reservation, the prompt's estimate and its limit.
            counted = r.id % 3 != 0
            charge = sum(charged(PROMPT_TOKENS if counted else None,
                                 GENERATED if counted else None, PROMPT_TOKENS, GENERATED, 1))
            self.teams.settle(r.id, hold, USED if served else 0.0, charge if served else 0.0)

    async def _serve(self, r: Request, turn: Turn) -> None:
        sup = self.sup
        budget = r.budget
        shutdown = Shutdown(5.0)
        leave_at = None if r.leave_after is None else r.started + r.leave_after

        async def receive() -> dict[str, Any]:
            if leave_at is None:
                await asyncio.Event().wait()
            else:
                await asyncio.sleep(max(0.0, leave_at - clock.now()))
            return {"type": "http.disconnect"}

        async def gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        try:
            runtime = sup.resolve(r.model)
            self.teams.waits(r.id, r.model)
            if r.keep_alive is not None:  # as the edge applies it, before the lease
                sup.keep_alive(sup.find(r.model), r.keep_alive)
            lease = await sup.acquire(sup.find(r.model), budget=budget,
                                      ends=Ends(gone, shutdown.over, shutdown.error),
                                      turn=turn)
        except ClientGone:
            return self._end(r, "left")
        except RouterError as exc:
            own = runtime.preset.wait_budget or sup.settings.wait_budget
            bound = min(budget or 1e9, own) + ANSWER_SLACK_S
            if clock.now() - r.started > bound:
                self.violate(f"request {r.id} for {r.model} answered {exc.status} after "
                             f"{clock.now() - r.started:.2f} s, past its budget ({bound:g} s)")
            return self._end(r, f"{exc.status} {type(exc).__name__}")
        r.leased_at = clock.now()
        capacity = runtime.slots * runtime.preset.replicas
        for broken in self.teams.leased(r.id, r.model, capacity):
            self.violate(broken)
        r.lease = lease
        child = cast(FakeChild, lease.child)
        child.serving += 1
        try:
            await self._place(r, lease)
            done = asyncio.ensure_future(asyncio.sleep(r.duration))
            waits: set[asyncio.Future[Any]] = {child.broken}
            if not child.frozen:
                waits.add(done)
            if leave_at is not None:
                waits.add(asyncio.ensure_future(asyncio.sleep(max(0.0, leave_at - clock.now()))))
            finished, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                if w is not child.broken:
                    w.cancel()
            if child.broken in finished:
                self._end(r, child.broken.result())
            elif done in finished:
                self._end(r, "ok")
            else:
                self._end(r, "left")
        finally:
            child.serving -= 1
            r.lease = None
            # What the child's last chunk says: its slot now holds a conversation worth saving.
            lease.learn(cast(ResponseTail, SimpleNamespace(
                timings=Timings(PROMPT_TOKENS, 50.0, 0, GENERATED))))
            lease.spent(CHARGED)
            lease.release()

    async def _place(self, r: Request, lease: Lease) -> None:
        """The request's slot, as the proxy places a completion: one of four conversations,
        a turn further each time (drawn from its number: the seed's draws stay the same).
        With every displacement save hanging, only the request's own bound ends its wait."""
        conversation, turn = r.id % 4, r.id // 4 % 3
        keys = tuple(conversation * 1000 + k for k in range(1, turn + 2))
        started = clock.now()
        await self.sup.place(lease, Prefix(keys, tuple(range(1, len(keys) + 1))), b"")
        if clock.now() - started > DISPLACE_BOUND_S + ANSWER_SLACK_S:
            self.violate(f"request {r.id} for {r.model} waited {clock.now() - started:.2f} s "
                         f"for its slot, past the displacement bound ({DISPLACE_BOUND_S:g} s)")

    def _end(self, r: Request, outcome: str) -> None:
        r.ended = clock.now()
        r.outcome = outcome
        self.log(f"request {r.id} {r.model}: {outcome}")

    async def load(self, model: str) -> None:
        self.log(f"load {model}")
        with contextlib.suppress(RouterError):
            await self.sup.load(self.sup.find(model))

    async def unload(self, model: str) -> None:
        self.log(f"unload {model}")
        with contextlib.suppress(RouterError):
            await self.sup.unload(self.sup.find(model))

    def crash(self, model: str) -> None:
        runtime = self.sup.models.get(model)
        if runtime is not None and runtime.replicas:
            child = cast(FakeChild, self.rng.choice(runtime.replicas).child)
            self.log(f"crash {model}")
            child.exit(1)

    def reconfigure(self, model: str) -> None:
        """A reload that changes the model's llama-server arguments: it restarts once idle."""
        sup = self.sup
        presets = dict(sup.catalogue.models)
        old = presets[model]
        context = str(self.rng.choice((1024, 2048, 4096)))
        presets[model] = ModelPreset(model, MappingProxyType({**old.args, "ctx-size": context}),
                                     replicas=old.replicas, pin=old.pin,
                                     min_resident=old.min_resident)
        self.log(f"reconfigure {model} ctx-size {context}")
        sup.reconfigure(Catalogue(presets))
        runtime = sup.models[model]
        sup.executor.apply(runtime, Estimated(MEMORY_UNIT * self.cfg.sizes[model] * old.replicas))

    def freeze(self, model: str) -> None:
        runtime = self.sup.models.get(model)
        if runtime is not None and runtime.replicas and self.cfg.liveness:
            child = cast(FakeChild, self.rng.choice(runtime.replicas).child)
            self.log(f"freeze {model}")
            child.frozen = True

    # -- invariants ------------------------------------------------------------------------

    def check_quiescent(self, now: float) -> None:
        sup = self.sup
        c = self.cfg
        models = list(sup.models.values())
        holding = [m for m in models if m.status.holds_process]
        # A stopping child serves nothing more: the model slots are the others' (no GPUs
        # here, whose stopping children would hold theirs); its memory counts below.
        slots = [m for m in holding if m.status is not Status.STOPPING]
        if c.models_max > 0 and len(slots) > c.models_max:
            self.violate(f"{len(slots)} models load or serve, --models-max {c.models_max}: "
                         f"{slots}")
        if c.memory_budget is not None:
            used = sum(m.estimate for m in holding)
            if used > c.memory_budget:
                self.violate(f"{used} bytes held, budget {c.memory_budget}: {holding}")
        live = [r for r in self.requests if r.ended is None]
        for m in models:
            leased = sum(1 for r in live if r.lease is not None and r.model == m.id)
            waiting = sum(1 for r in live if r.lease is None and r.model == m.id)
            if m.in_flight != leased or sum(x.in_flight for x in m.replicas) > m.in_flight:
                self.violate(f"{m.id}: in_flight {m.in_flight}, requests holding it {leased}")
            if m.waiting != waiting:
                self.violate(f"{m.id}: waiting {m.waiting}, requests waiting {waiting}")
            if sup.wait.slots.running(m.id) != leased:
                self.violate(f"{m.id}: {sup.wait.slots.running(m.id)} requests hold a slot, "
                             f"{leased} a lease")
            self._check_kept(m, live)
            self._check_status_path(m)
            self._check_published(m)
            self._check_phases(m)
            self._check_drain(m, now)
            if waiting:
                self._check_progress(m, now)
        self._check_head(now)
        backlogged = {m.id: (m.slots * m.preset.replicas, sup.wait.slots.backlogged(m.id))
                      for m in models}
        for broken in self.teams.violations(now, backlogged):
            self.violate(broken)

    def _check_status_path(self, m: ModelRuntime) -> None:
        pass  # checked over the event log at the end (``check_events``)

    def _check_published(self, m: ModelRuntime) -> None:
        """What the rest of the router reads of the model is its record as it is now: every
        change was published (``ModelSet.publish``)."""
        published = self.sup.model_set.published.get(m.id)
        if self.sup.models.get(m.id) is not m:
            return  # a removed model's record, being forgotten
        if published is None or (published.preset, published.state, published.waiting,
                                 published.estimate, published.load) != (
                m.preset, m.state, m.waiting, m.estimate, m.load):
            self.violate(f"{m.id}: published {published!r} is not its record {m!r}")

    def _check_phases(self, m: ModelRuntime) -> None:
        """The state's children and load task agree with what really runs."""
        state = m.state
        phases = ([r.child for r in state.replicas], list(state.starting),
                  [r.child for r in state.stopping])
        children = [c for phase in phases for c in phase]
        if len({id(c) for c in children}) != len(children):
            self.violate(f"{m.id}: a child in two phases: {phases}")
        if state.replicas and m.status is not Status.LOADED:
            self.violate(f"{m.id}: serving replicas while {m.status.value}")
        if state.stopping and m.status is not Status.STOPPING:
            self.violate(f"{m.id}: children stopping while {m.status.value}")
        task = m.load_task
        running = task is not None and not task.done()
        if state.load_pending != running:
            self.violate(f"{m.id}: load_pending {state.load_pending}, load task running "
                         f"{running}")

    def _check_drain(self, m: ModelRuntime, now: float) -> None:
        if not (m.draining and m.status is Status.LOADED):
            self._drains.pop(m.id, None)
            return
        self._drains.setdefault(m.id, now)
        if m.in_flight == 0:
            self.violate(f"{m.id} drains with nothing in flight and is not stopping ({m!r})")
        elif not m.state.stop_when_idle and not self.sup.admission.queue:
            self.violate(f"{m.id} still drains for a swap nobody waits for ({m!r})")

    def _check_progress(self, m: ModelRuntime, now: float) -> None:
        """Something runs, loads or stops on behalf of the requests waiting for ``m``."""
        if m.status in (Status.LOADING, Status.STOPPING, Status.DOWNLOADING):
            return
        if m.status is Status.LOADED:
            if m.draining and m.in_flight > 0:
                return  # it stops when its requests are done; then its waiters load it
            slots = self.sup.wait.slots
            if slots.waiting(m.id) and m.replicas:
                if self._slot_idles(m):
                    self.violate(f"a slot of {m.id} idles while {slots.waiting(m.id)} "
                                 f"requests wait for one: {m!r}")
                return  # every slot the requests waiting may take runs one of them
            if not m.replicas and m.replace_task is not None and not m.replace_task.done():
                return  # its crashed replica is being replaced
            self.violate(f"requests wait for {m.id}, loaded and nothing will change: {m!r}")
            return
        task = m.load_task
        if task is None or task.done():
            self.violate(f"requests wait for {m.id} but no load is under way: {m!r}")
            return
        if m.queued_since is None:
            return  # sitting out a crash backoff, or about to queue
        # Queued for admission: the head of the queue must be getting somewhere.
        others = list(self.sup.models.values())
        if any(o.status in (Status.LOADING, Status.STOPPING) for o in others):
            return  # capacity is on its way
        if any(o.status is Status.LOADED and o.in_flight > 0 and not o.preset.pin
               for o in others):
            return  # a busy model: the fairness bound drains it (``_check_head``)
        if any(self._resident(o, now) for o in others):
            return  # admission plans again when that model's min-resident ends
        self.violate(f"requests wait for {m.id} in the admission queue and nothing runs, "
                     f"loads or stops: {others}")

    def _check_kept(self, m: ModelRuntime, live: list[Request]) -> None:
        """The other classes never hold the slots kept for the interactive one."""
        kept = m.preset.interactive_slots
        others = sum(1 for r in live if r.lease is not None and r.model == m.id
                     and turn_of(r.id).rank != 0)
        if kept and others > (m.slots - kept) * max(len(m.replicas), m.preset.replicas):
            self.violate(f"{m.id}: {others} requests below the interactive class hold slots, "
                         f"{kept} of each replica's {m.slots} are kept for it")

    def _slot_idles(self, m: ModelRuntime) -> bool:
        """Whether a slot of ``m`` is free that its highest waiting request may take: any
        free one for the interactive class, else one the ``interactive-slots`` leave the
        other classes (counted from the simulated requests, not the slot queue's books)."""
        live = [r for r in self.requests if r.ended is None and r.model == m.id]
        leased = [turn_of(r.id).rank for r in live if r.lease is not None]
        waiting = [turn_of(r.id).rank for r in live if r.lease is None]
        replicas = len(m.replicas)
        if not waiting or len(leased) >= m.slots * replicas:
            return False
        kept = m.preset.interactive_slots
        others = sum(1 for rank in leased if rank != 0)
        return min(waiting) == 0 or others < (m.slots - kept) * replicas

    def _check_head(self, now: float) -> None:
        queue = self.sup.admission.queue
        if not queue or queue[0].queued_since is None:
            return
        head = queue[0]
        waited = now - head.queued_since
        if waited <= self.cfg.fairness + 0.1:
            return
        models = list(self.sup.models.values())
        if any(o.status in (Status.LOADING, Status.STOPPING) or o.draining for o in models):
            return
        busy = [o for o in models if o.status is Status.LOADED and o.in_flight > 0
                and not o.preset.pin and not self._resident(o, now)]
        if busy:
            self.violate(f"{head.id} waited {waited:.2f} s at the head of the queue, past the "
                         f"fairness bound, and nothing drains: {models}")

    @staticmethod
    def _resident(m: ModelRuntime, now: float) -> bool:
        """Loaded and within its ``min-resident`` (plus a loop turn: admission plans again
        just after it ends)."""
        loaded_at, resident = m.loaded_at, m.preset.min_resident
        return (resident > 0 and m.status is Status.LOADED and loaded_at is not None
                and now - loaded_at < resident + 0.1)

    def check_events(self) -> None:
        """Each model's published statuses follow the lifecycle."""
        last: dict[str, str] = {}
        for at, model, kind, data in self.events.log:
            status = data.get("status")
            if kind not in ("status_change", "model_status", "stopping") or status is None:
                continue
            before = last.get(model, "unloaded")
            if status not in NEXT_STATUS.get(before, set()):
                self.violations.append(f"t={at:.3f}: {model} went {before} -> {status} "
                                       f"({kind} {data})")
            last[model] = status


def run_schedule(seed: int, **options: Any) -> Simulation:
    """Play the schedule of ``seed``; the simulation, with its ``violations``."""
    sim = Simulation(seed, **options)
    loop = VirtualTimeLoop()
    try:
        try:
            loop.run_until_complete(sim.run())
        except Stalled as exc:
            sim.violations.append(f"stalled: {exc}")
        sim.check_events()
    finally:
        loop.close()
    return sim


def describe(sim: Simulation, trace_lines: int = 40) -> str:
    c = sim.cfg
    head = (f"seed {sim.seed}: models {c.models}, --models-max {c.models_max}, memory budget "
            f"{c.memory_budget} (sizes {c.sizes}), replicas {c.replicas}, fairness "
            f"{c.fairness:g} s, wait budget {c.wait_budget:g} s, stop timeout "
            f"{c.stop_timeout:g} s, liveness {c.liveness}, ttl {c.ttl:g}"
            + (f", pinned {sorted(c.pinned)}" if c.pinned else "")
            + (f", min-resident {dict(c.min_resident)}" if c.min_resident else "")
            + (", shut down with traffic running" if sim.shutdown_live else "")
            + (", every slot save hangs" if sim.saves == "hang" else ""))
    return "\n".join([head, *sim.violations[:10], "trace (last lines):",
                      *sim.trace[-trace_lines:]])


def main() -> None:
    """``python tests/simulation.py --schedules N [--seed S]``: the long mode (``make
    simulate``); prints the throughput and every failing seed with what it broke."""
    import argparse
    import logging
    import time

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--schedules", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(1 << 30),
                        help="first seed (default: random, printed)")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)
    print(f"schedules {args.schedules} from seed {args.seed}", flush=True)
    started = time.perf_counter()
    failed = 0
    for seed in range(args.seed, args.seed + args.schedules):
        sim = run_schedule(seed)
        if sim.violations:
            failed += 1
            print(describe(sim, trace_lines=20), flush=True)
    elapsed = time.perf_counter() - started
    print(f"{args.schedules} schedules in {elapsed:.1f} s "
          f"({args.schedules / elapsed:.0f}/s): {failed} failed")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
