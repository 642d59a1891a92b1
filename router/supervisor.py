"""Carries out model lifecycles: load on demand, evict, stop, notice crashes.

Concurrency model (one asyncio loop, no threads):

* Only this module changes a model's ``status``; every change publishes one event.
* ``acquire`` is the hot path: for a loaded model it bumps ``in_flight`` and returns without
  awaiting anything, so no eviction can slip in between "is loaded" and "is in use".
* Each model has at most one load task; every request for that model awaits it (shielded, so
  a waiter that gives up never cancels a load others share).
* A load first asks the pure planner (``scheduler.plan_admission``) for room, stops the idle
  victims it names, and waits for capacity changes until admitted. Admission and the switch
  to ``loading`` happen in the same loop step, so two loads cannot both take the last slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .errors import LoadFailed, ModelNotFound, ModelNotLoaded, WaitBudgetExceeded
from .events import EventBus
from .flags import FlagTable
from .logs import LogRing
from .presets import ModelPreset
from .process import ChildError, ChildExited, ChildProcess, free_port
from .scheduler import ModelSnapshot, Status, plan_admission
from .settings import Settings
from .sources import Catalogue

log = logging.getLogger("router.supervisor")

PORT_RETRIES = 3
FAILURE_LOG_LINES = 20


@dataclass
class Failure:
    """Why the last run of a model ended badly."""

    message: str
    exit_code: int | None
    last_lines: list[str]
    at: float = field(default_factory=time.time)


@dataclass
class ModelRuntime:
    """Mutable run state of one model. Written only by the Supervisor."""

    preset: ModelPreset
    logs: LogRing
    status: Status = Status.UNLOADED
    child: ChildProcess | None = None
    in_flight: int = 0
    last_used: float = 0.0
    load_task: asyncio.Task[ChildProcess] | None = None
    failure: Failure | None = None
    info: dict[str, Any] | None = None
    loaded_at: float | None = None
    waiting: int = 0  # requests waiting for this model to become loaded

    def __repr__(self) -> str:
        child = self.child
        return (f"<Model {self.preset.id} {self.status.value} pid={child and child.pid} "
                f"port={child and child.port} in_flight={self.in_flight}>")

    def snapshot(self) -> ModelSnapshot:
        return ModelSnapshot(self.preset.id, self.status, self.in_flight, self.last_used)


class Lease:
    """A request's hold on a loaded child; ``release()`` exactly once when the response ends."""

    __slots__ = ("_released", "_supervisor", "child", "runtime")

    def __init__(self, supervisor: Supervisor, runtime: ModelRuntime, child: ChildProcess):
        self._supervisor = supervisor
        self.runtime = runtime
        self.child = child
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._supervisor._release(self.runtime)


class Supervisor:
    def __init__(self, settings: Settings, catalogue: Catalogue, table: FlagTable,
                 binary: Path, client: httpx.AsyncClient, events: EventBus) -> None:
        self.settings = settings
        self.catalogue = catalogue
        self.table = table
        self.binary = binary
        self.events = events
        self._client = client
        self.models: dict[str, ModelRuntime] = {
            mid: ModelRuntime(preset, LogRing(settings.log_lines))
            for mid, preset in catalogue.models.items()}
        self._capacity_changed = asyncio.Event()
        self._closing = False

    # ----------------------------------------------------------------- lookups

    def resolve(self, name: str) -> ModelRuntime:
        model_id = self.catalogue.resolve(name)
        if model_id is None:
            raise ModelNotFound(name, self.catalogue.close_matches(name))
        return self.models[model_id]

    def child_argv(self, preset: ModelPreset, port: int) -> list[str]:
        argv = [str(self.binary), "--host", "127.0.0.1", "--port", str(port),
                "--alias", preset.id, "--metrics"]
        for key, value in preset.args.items():
            if key == "hf-repo" and "model" in preset.args:
                continue
            option = self.table.by_canonical(key)
            if option is None:  # unreachable: presets are validated against the same table
                raise LoadFailed(f"model '{preset.id}': unknown llama-server option {key!r}")
            argv += option.render(value)
        return argv

    # ----------------------------------------------------------------- hot path

    async def acquire(self, name: str, *, autoload: bool = True,
                      budget: float | None = None) -> Lease:
        """Wait until the model is loaded (loading it if allowed) and hold it for one request."""
        runtime = self.resolve(name)
        deadline = time.monotonic() + (budget if budget is not None
                                       else self.settings.wait_budget)
        while True:
            if runtime.status is Status.LOADED and runtime.child is not None:
                runtime.in_flight += 1
                runtime.last_used = time.monotonic()
                return Lease(self, runtime, runtime.child)
            if not autoload and runtime.status is not Status.LOADING:
                raise ModelNotLoaded(runtime.preset.id)
            task = self._ensure_load_task(runtime)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._budget_exceeded(runtime, budget)
            runtime.waiting += 1
            try:
                await asyncio.wait_for(asyncio.shield(task), remaining)
            except TimeoutError:
                raise self._budget_exceeded(runtime, budget) from None
            finally:
                runtime.waiting -= 1

    def _budget_exceeded(self, runtime: ModelRuntime, budget: float | None) -> WaitBudgetExceeded:
        seconds = budget if budget is not None else self.settings.wait_budget
        return WaitBudgetExceeded(
            f"model '{runtime.preset.id}' was not ready within the wait budget of {seconds:g} s "
            f"(status: {runtime.status.value})", headers={"Retry-After": "5"})

    def _release(self, runtime: ModelRuntime) -> None:
        runtime.in_flight -= 1
        runtime.last_used = time.monotonic()
        if runtime.in_flight == 0:
            self._notify_capacity()

    # ----------------------------------------------------------------- loading

    def _ensure_load_task(self, runtime: ModelRuntime) -> asyncio.Task[ChildProcess]:
        if runtime.load_task is None or runtime.load_task.done():
            if runtime.preset.model_path is None:
                raise LoadFailed(
                    f"model '{runtime.preset.id}' is not downloaded (hf-repo = "
                    f"{runtime.preset.hf_repo}); download it first")
            runtime.load_task = asyncio.create_task(self._load(runtime),
                                                    name=f"load:{runtime.preset.id}")
            runtime.load_task.add_done_callback(_consume_exception)
        return runtime.load_task

    async def load(self, name: str) -> ModelRuntime:
        """Start loading a model and return at once (``POST /models/load``)."""
        runtime = self.resolve(name)
        if runtime.status is Status.UNLOADED:
            self._ensure_load_task(runtime)
        return runtime

    async def _load(self, runtime: ModelRuntime) -> ChildProcess:
        preset = runtime.preset
        await self._admit(runtime)
        runtime.failure = None
        self._set_status(runtime, Status.LOADING)
        started = time.monotonic()
        timeout = preset.load_timeout or self.settings.load_timeout
        child: ChildProcess | None = None
        try:
            for attempt in range(PORT_RETRIES):
                port = free_port()
                child = ChildProcess(preset.id, self.child_argv(preset, port), port,
                                     runtime.logs, self._client)
                runtime.child = child
                await child.start()
                try:
                    await child.wait_ready(timeout - (time.monotonic() - started), timeout)
                    break
                except ChildExited as exc:
                    if not exc.port_in_use or attempt == PORT_RETRIES - 1:
                        raise
                    log.warning("port %d was taken; retrying", child.port,
                                extra={"model": preset.id})
        except (ChildError, OSError, asyncio.CancelledError) as exc:
            if child is not None:
                await asyncio.shield(child.stop(0))
            runtime.child = None
            if isinstance(exc, asyncio.CancelledError):
                self._set_status(runtime, Status.UNLOADED)
                raise
            runtime.failure = _failure_from(exc)
            self._set_status(runtime, Status.UNLOADED)
            log.error("load failed: %s", runtime.failure.message,
                      extra={"event": "load_failed", "model": preset.id})
            raise LoadFailed(_load_failed_message(preset.id, runtime.failure)) from exc
        assert child is not None
        runtime.info = await self._fetch_info(child)
        runtime.loaded_at = time.time()
        runtime.last_used = time.monotonic()
        duration = round(time.monotonic() - started, 4)
        self._set_status(runtime, Status.LOADED, duration=duration)
        log.info("loaded", extra={"event": "loaded", "model": preset.id, "pid": child.pid,
                                  "port": child.port, "duration": duration})
        watcher = asyncio.create_task(self._watch_exit(runtime, child), name=f"exit:{preset.id}")
        watcher.add_done_callback(_consume_exception)
        return child

    async def _admit(self, runtime: ModelRuntime) -> None:
        """Wait until the planner admits this model, evicting idle models it names."""
        while True:
            self._capacity_changed.clear()
            plan = plan_admission([m.snapshot() for m in self.models.values()],
                                  runtime.preset.id, self.settings.models_max)
            if plan.admit:
                return
            for victim in plan.evict:
                log.info("evicting least recently used", extra={"event": "evict",
                                                                "model": victim})
                self._begin_stop(self.models[victim], "evicted")
            await self._capacity_changed.wait()

    async def _fetch_info(self, child: ChildProcess) -> dict[str, Any] | None:
        try:
            response = await self._client.get(child.base_url + "/v1/models", timeout=5.0)
            data = response.json().get("data") or []
            return dict(data[0]) if data else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

    # ----------------------------------------------------------------- stopping

    async def unload(self, name: str) -> ModelRuntime:
        runtime = self.resolve(name)
        if runtime.status is Status.LOADING and runtime.load_task is not None:
            runtime.load_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await runtime.load_task
        elif runtime.status is Status.LOADED:
            await self._stop(runtime, "unloaded")
        return runtime

    def _begin_stop(self, runtime: ModelRuntime, reason: str) -> asyncio.Task[None] | None:
        """Mark a loaded model stopping now (so planners see it) and stop it in a task."""
        child = runtime.child
        if child is None or runtime.status is not Status.LOADED:
            return None
        self._set_status(runtime, Status.STOPPING, reason=reason)
        task = asyncio.create_task(self._finish_stop(runtime, child),
                                   name=f"stop:{runtime.preset.id}")
        task.add_done_callback(_consume_exception)
        return task

    async def _stop(self, runtime: ModelRuntime, reason: str) -> None:
        task = self._begin_stop(runtime, reason)
        if task is not None:
            await task

    async def _finish_stop(self, runtime: ModelRuntime, child: ChildProcess) -> None:
        timeout = runtime.preset.stop_timeout
        await child.stop(self.settings.stop_timeout if timeout is None else timeout)
        if runtime.child is child:
            runtime.child = None
            runtime.info = None
            self._set_status(runtime, Status.UNLOADED)

    async def _watch_exit(self, runtime: ModelRuntime, child: ChildProcess) -> None:
        code = await child.wait_exit()
        if runtime.child is not child or runtime.status is not Status.LOADED:
            return  # an intended stop; _stop records it
        runtime.child = None
        runtime.info = None
        runtime.failure = Failure(f"llama-server exited unexpectedly with code {code}", code,
                                  runtime.logs.tail(FAILURE_LOG_LINES))
        log.error("child exited unexpectedly with code %s", code,
                  extra={"event": "crashed", "model": runtime.preset.id, "pid": child.pid,
                         "exit_code": code})
        await child.stop(0)  # reap the group
        self._set_status(runtime, Status.UNLOADED)

    async def close(self) -> None:
        """Stop every child (loading ones are killed); used at shutdown."""
        self._closing = True
        for runtime in self.models.values():
            if runtime.load_task is not None and not runtime.load_task.done():
                runtime.load_task.cancel()
        loads = [r.load_task for r in self.models.values() if r.load_task is not None]
        await asyncio.gather(*loads, return_exceptions=True)
        await asyncio.gather(*(self._stop(r, "shutdown") for r in self.models.values()),
                             return_exceptions=True)

    def kill_all_now(self) -> None:
        for runtime in self.models.values():
            if runtime.child is not None:
                runtime.child.kill_now()

    # ----------------------------------------------------------------- state

    def _set_status(self, runtime: ModelRuntime, status: Status, **extra: Any) -> None:
        previous, runtime.status = runtime.status, status
        data: dict[str, Any] = {"status": status.value, **extra}
        if status is Status.UNLOADED:
            data["was_running"] = previous.holds_process
            if runtime.failure is not None:
                data["failed"] = True
                data["exit_code"] = runtime.failure.exit_code
        self.events.publish(runtime.preset.id, "status_change", data)
        if status in (Status.UNLOADED, Status.LOADED):
            self._notify_capacity()

    def _notify_capacity(self) -> None:
        self._capacity_changed.set()

    async def load_startup_models(self) -> None:
        startup = [r for r in self.models.values() if r.preset.load_on_startup]
        tasks = [self._ensure_load_task(r) for r in startup]
        await asyncio.gather(*tasks)


def _failure_from(exc: BaseException) -> Failure:
    if isinstance(exc, ChildExited):
        return Failure(str(exc), exc.exit_code, exc.last_lines)
    if isinstance(exc, ChildError):
        return Failure(str(exc), None, exc.last_lines)
    return Failure(f"could not start llama-server: {exc}", None, [])


def _load_failed_message(model_id: str, failure: Failure) -> str:
    last = next((line for line in reversed(failure.last_lines) if line.strip()), "")
    detail = f"; last log line: {last}" if last else ""
    return f"model '{model_id}' failed to load: {failure.message}{detail}"


def _consume_exception(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
