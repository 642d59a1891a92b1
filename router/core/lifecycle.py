"""A model's lifecycle as one pure transition function: ``(state, event) -> (state, effects)``.

``ModelState`` is everything that decides what a model does next: its ``status`` (llama.cpp's
values plus the router's ``stopping``) and the router's extras as fields (draining, a pending
stop, removal, restart after a stop, the failure count and crash loop). ``transition`` is the
only way to a new state. It performs nothing: it returns the effects for the supervisor to
carry out (stop the children, start a load, publish an event, ...). No I/O, no clocks, no
asyncio, so every status x event pair is unit-tested (``tests/test_lifecycle.py``).

Every pair is one of three kinds: a transition (``TABLE``), explicitly ignored (``IGNORED``:
an event that may race with a status change, such as the last request finishing after a crash
unloaded the model), or impossible, which raises ``InvalidTransition`` (a bug in the router,
never a client error).

=========== ==================== ==================================================
from        event                to (effects)
=========== ==================== ==================================================
unloaded    Download             downloading (an hf-repo model not in the cache)
downloading DownloadProgress     downloading (bytes so far, published)
downloading Downloaded           unloaded (the file is there; the load goes on)
downloading DownloadFailed       unloaded (failure counted unless cancelled)
unloaded    Queued               unloaded (its load waits for admission, published)
unloaded    Admitted             loading (the planner made room: spawn)
loading     LoadProgress         loading (the children's load progress, published)
loading     Ready                loaded (every replica healthy)
loading     SpawnFailed          unloaded (exit, timeout; cancelled: not a failure)
loaded      Stop                 stopping (stop the children: eviction, TTL, shutdown)
any         Unload               POST /models/unload: cancels a download or load (its
                                 waiters get the reason), stops a loaded model (loaded:
                                 stopping; its requests in flight end with a 503), and
                                 drops a restart a reconfiguration had planned
loaded      Idle                 stopping if a stop waits for the last request
loaded      Drain                loaded, draining for another model's load: no new
                                 requests; stopping once idle (at once if idle)
loaded      Undrain              loaded, serving again: nobody waits for that load now
loaded      Retire               loaded, draining, stop when idle (stopping if idle)
loaded      ReplicaExited        loaded (replace it) or, the last one, unloaded
loaded      ReplicaFailed        loaded (a replacement did not start; counted)
loaded      ReplicaStarted       loaded (a replacement serves, published)
loaded      ReplicaUnresponsive  loaded (kill it: its exit is then a ReplicaExited)
stopping    Stopped              unloaded (then forget a removed model, or load again)
any         Retire               cancels a download or load; a removed model is
                                 forgotten once nothing runs
any         Reset                clears the failure count and crash loop
any         LoadWanted           POST /models/load (explicit): refused unless unloaded
                                 (``already running``); a request (on demand): refused
                                 in a crash loop; else starts the load task
any         LoadEnded            the load task ended (loaded, failed or cancelled)
any         ChildStarted/Gone    a child of a load or replacement started / is gone
any         NobodyWaits          the last waiting request left: cancels a load requests
                                 started that does not spawn or download yet
any         Closing              shutdown: cancels a download or load; loads refused
unloaded    Listed / Forgotten   added at run time / dropped (published)
=========== ==================== ==================================================

Commands are events too: an explicit load or unload that cannot happen now is refused by
the transition (``Refuse``), so the preconditions live with the states they read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from ..events import MODEL_REMOVED

STABLE_RUN_S = 60.0  # a child that ran this long before crashing resets the failure count


class Status(StrEnum):
    """A model's lifecycle state. Clients see ``public`` (``/models`` ``status.value``, the
    ``status`` of ``/models/sse`` events): only llama.cpp's values, so a stopping model shows
    ``loaded`` (its process still holds memory, as in llama.cpp) with ``stopping: true``."""

    UNLOADED = "unloaded"
    DOWNLOADING = "downloading"
    LOADING = "loading"
    LOADED = "loaded"
    STOPPING = "stopping"

    @property
    def holds_process(self) -> bool:
        return self not in (Status.UNLOADED, Status.DOWNLOADING)

    @property
    def public(self) -> str:
        return "loaded" if self is Status.STOPPING else self.value


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a run of a model ended badly: its message, exit code and last log lines; ``at``
    wall-clock time (for people), ``clock_at`` the core's clock (``clock``), which the crash
    backoff counts from."""

    message: str
    exit_code: int | None
    last_lines: tuple[str, ...] = ()
    clock_at: float = 0.0
    at: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class ModelState:
    status: Status = Status.UNLOADED
    draining: bool = False  # loaded, taking no new requests until it stops
    drained_for: str | None = None  # the model whose load the drain makes room for
    stop_when_idle: str | None = None  # a reason: stop once in-flight requests finish
    removed: bool = False  # gone from the configuration; forgotten once nothing runs
    restart_after_stop: bool = False  # reconfigured while running: load the new one after
    failed: bool = False  # the last run ended in a failure (shown while unloaded)
    failures_in_row: int = 0
    crash_loop: bool = False  # failed crash_loop_limit times in a row: no automatic restart
    failure: Failure | None = None  # the last failure counted, kept for messages and backoff
    # While downloading: bytes so far per file, {file: {"done": n, "total": n}}.
    download: Mapping[str, Any] | None = None
    # Serving replicas the router killed (``liveness``), out of service until their exit is
    # reported: (replica, why), the failure their exit is reported with.
    killed: tuple[tuple[Any, str], ...] = ()
    # While loading: llama.cpp's {stages, current, value} of the least advanced child.
    progress: Mapping[str, Any] | None = None
    # Its children, by phase. ``starting``: started for a load or a crashed replica's
    # replacement, not serving yet (whoever started them stops them if the start fails).
    # ``replicas``: serving (``runtime.Replica``, in start order); a kill or crash takes one
    # out. ``stopping``: the replicas a stop (``StopChildren``) is ending. Only events change
    # them.
    starting: tuple[Any, ...] = ()
    replicas: tuple[Any, ...] = ()
    stopping: tuple[Any, ...] = ()
    info: Mapping[str, Any] | None = None  # the child's own /v1/models entry, while loaded
    loaded_at: float | None = None  # clock time it became loaded
    # Its one load task (``Loader.load``) exists: queued, waiting for an old child, spawning.
    load_pending: bool = False
    load_on_demand: bool = False  # that load was started by requests, not an explicit load
    closing: bool = False  # the router shuts down: loads are cancelled, none starts


# ----------------------------------------------------------------------------- events

@dataclass(frozen=True, slots=True)
class Download:
    """An hf-repo model not in the cache starts downloading."""


@dataclass(frozen=True, slots=True)
class DownloadProgress:
    """Bytes downloaded so far, per file: ``{file: {"done": n, "total": n}}``."""

    progress: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Downloaded:
    """Its files are in the cache; the load goes on."""


@dataclass(frozen=True, slots=True)
class DownloadFailed:
    cancelled: bool = False  # an unload or reconfiguration stopped it: not a failure
    error: str = "cancelled"
    failure: Failure | None = None  # what it is counted as (not cancelled)


@dataclass(frozen=True, slots=True)
class Queued:
    """Its load joined the admission queue at ``position`` (0: planning now)."""

    position: int
    expected_wait_s: float | None


@dataclass(frozen=True, slots=True)
class Admitted:
    """The planner made room: spawn the children."""


@dataclass(frozen=True, slots=True)
class LoadProgress:
    """The children being started report how far their load got (``spawner``)."""

    progress: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Ready:
    """Every replica is healthy: the started children serve as ``replicas``. ``data`` goes
    into the ``loaded`` event (duration, info)."""

    replicas: tuple[Any, ...] = ()
    loaded_at: float | None = None
    info: Mapping[str, Any] | None = None
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SpawnFailed:
    """The load ended without serving: a child exited, timed out, or the load was cancelled."""

    exit_code: int | None = None
    cancelled: bool = False
    failure: Failure | None = None  # what it is counted as (not cancelled)


@dataclass(frozen=True, slots=True)
class Stop:
    reason: str  # unloaded, evicted, idle, shutdown


@dataclass(frozen=True, slots=True)
class Unload:
    """An unload: cancels a download or load, stops a loaded model. ``explicit``
    (``POST /models/unload``, dashboard, CLI) is refused when nothing runs or loads (``not
    running``); a cache model's deletion unloads it whatever it does."""

    explicit: bool = True


@dataclass(frozen=True, slots=True)
class Stopped:
    clean: bool  # every child exited with code 0 when asked


@dataclass(frozen=True, slots=True)
class Idle:
    """The model's last in-flight request finished."""


@dataclass(frozen=True, slots=True)
class Drain:
    """Make room for another model's load: take no new requests, stop once the requests in
    flight are done (``idle``: none are, stop now). Requests arriving meanwhile wait for the
    model's next load, in the admission queue's order."""

    waiting_for: str  # the model that needs its room
    idle: bool = False


@dataclass(frozen=True, slots=True)
class Undrain:
    """The load a drain made room for is no longer waited for (its requests left, or it was
    admitted anyway): serve again. A drain for a reconfiguration is not lifted."""


@dataclass(frozen=True, slots=True)
class Retire:
    """The configuration changed: the model is removed, or must restart with a new preset."""

    reason: str  # removed, reconfigured
    removed: bool
    idle: bool  # no request in flight


@dataclass(frozen=True, slots=True)
class ReplicaExited:
    """A serving child exited on its own (a crash), or a killed one exited: ``replica`` is
    out of service; the model stays loaded while another replica serves."""

    replica: Any
    exit_code: int | None
    ran_for: float  # seconds it ran
    failure: Failure | None = None


@dataclass(frozen=True, slots=True)
class ReplicaFailed:
    """A child started to replace a crashed replica did not become healthy."""

    failure: Failure | None = None


@dataclass(frozen=True, slots=True)
class ReplicaStarted:
    """A child replacing a crashed replica serves, as ``replica``."""

    replica: Any


@dataclass(frozen=True, slots=True)
class ReplicaUnresponsive:
    """A serving replica stopped answering its health checks (``liveness``)."""

    replica: Any
    why: str


@dataclass(frozen=True, slots=True)
class Reset:
    """A new preset: forget the failure count and the crash loop."""


@dataclass(frozen=True, slots=True)
class LoadWanted:
    """Someone wants the model loaded: ``POST /models/load`` (``explicit``: refused unless the
    model is unloaded; forgets the failure count and crash loop), a request for it
    (``on_demand``), or the router itself (startup, a new preset); the last two are refused
    in a crash loop. Starts the model's one load task unless one is pending."""

    explicit: bool = False
    on_demand: bool = False  # a request waits for it: cancelled once none does


@dataclass(frozen=True, slots=True)
class LoadEnded:
    """The model's load task ended: loaded, failed, or cancelled."""


@dataclass(frozen=True, slots=True)
class ChildStarted:
    """A child of a load or of a replica's replacement is being started (not serving yet)."""

    child: Any


@dataclass(frozen=True, slots=True)
class ChildGone:
    """A child that never served is stopped, or never got a process."""

    child: Any


@dataclass(frozen=True, slots=True)
class NobodyWaits:
    """The last request waiting for the model left. A load those requests started is
    cancelled unless it already spawns (or downloads): it would only evict someone for
    nothing."""


@dataclass(frozen=True, slots=True)
class Closing:
    """The router shuts down: cancel a download or load; no load starts any more."""


@dataclass(frozen=True, slots=True)
class Listed:
    """The model was added at run time (``POST /models``): published as unloaded."""


@dataclass(frozen=True, slots=True)
class Forgotten:
    """The model was dropped from the router (removed, deleted): published as removed."""


Event = (Download | DownloadProgress | Downloaded | DownloadFailed | Queued | Admitted
         | LoadProgress | Ready | SpawnFailed | ReplicaStarted | ReplicaUnresponsive | Stop
         | Stopped | Idle | Drain | Undrain | Retire | ReplicaExited | ReplicaFailed | Reset
         | Unload | LoadWanted | LoadEnded | ChildStarted | ChildGone | Listed | Forgotten
         | NobodyWaits | Closing)
EVENT_TYPES: tuple[type, ...] = Event.__args__


# ----------------------------------------------------------------------------- effects

@dataclass(frozen=True, slots=True)
class Publish:
    """Publish ``kind`` with ``data`` on the model's event stream (``/models/sse``)."""

    kind: str
    data: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class StopChildren:
    """Stop these replicas (no longer in the state: the stop owns them)."""

    reason: str
    replicas: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class StartLoad:
    """Start the model's load task (``on_demand``: for requests, cancelled once none waits)."""

    on_demand: bool = False


ALREADY_RUNNING = "already running"
NOT_RUNNING = "not running"
CRASH_LOOP = "crash loop"
CLOSING = "closing"  # the router shuts down: no load starts


@dataclass(frozen=True, slots=True)
class Refuse:
    """The command cannot happen now (``reason``: one of the constants above); nothing
    changed. The caller answers its client with it."""

    reason: str


UNLOADED = "unloaded"  # the reason of an explicit unload: its stop, its cancelled load
RECONFIGURED = "reconfigured"
UNWANTED = "no request waits for it"  # why a load started by requests is cancelled
SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True)
class CancelLoad:
    """Cancel the load under way, if any. Requests waiting for it get the reason: after an
    unload they end with a 503 saying so; after a reconfiguration they start over with the
    new preset (a removed model: 404)."""

    reason: str


@dataclass(frozen=True, slots=True)
class CancelDownload:
    pass


@dataclass(frozen=True, slots=True)
class CancelReplacement:
    """Stop starting a child that replaces a crashed replica."""


@dataclass(frozen=True, slots=True)
class ReplaceReplicas:
    """Start children until the model has its replica count again."""


@dataclass(frozen=True, slots=True)
class KillReplica:
    """Kill the replica's child, already out of service (``why``: the crash report its exit
    watcher gives)."""

    replica: Any
    why: str


@dataclass(frozen=True, slots=True)
class Forget:
    """Drop a removed model from the router."""


@dataclass(frozen=True, slots=True)
class FailureCounted:
    """A failure was counted: the backoff before the next start runs from now."""

    crash_loop: bool  # this failure started a crash loop


Effect = (Publish | StopChildren | StartLoad | CancelLoad | CancelDownload | CancelReplacement
          | ReplaceReplicas | KillReplica | Forget | FailureCounted | Refuse)


class InvalidTransition(RuntimeError):
    """An event that cannot happen in the model's current status: a bug in the router."""

    def __init__(self, model: str, status: Status, event: Event) -> None:
        super().__init__(
            f"model '{model}': {type(event).__name__} cannot happen while {status.value}")
        self.status = status
        self.event = event


Result = tuple[ModelState, tuple[Effect, ...]]


# ----------------------------------------------------------------------------- the table

def transition(model: str, state: ModelState, event: Event, *,
               crash_loop_limit: int) -> Result:
    """The state after ``event`` and what to do about it; raises InvalidTransition if the
    event cannot happen now. ``crash_loop_limit``: failures in a row that stop restarts."""
    rule = TABLE.get((state.status, type(event)))
    if rule is not None:
        return rule(state, event, crash_loop_limit)
    if (state.status, type(event)) in IGNORED:
        return state, ()
    raise InvalidTransition(model, state.status, event)


def _status_change(old: ModelState, new: ModelState, **extra: Any) -> Publish:
    """``status_change`` with llama.cpp's status value; entering ``unloaded`` says whether a
    process ran and, after a failure, its exit code."""
    data: dict[str, Any] = {"status": new.status.public, **extra}
    if new.status is Status.UNLOADED:
        data["was_running"] = old.status.holds_process
        if new.failed:
            data["failed"] = True
            data.setdefault("exit_code", None)
    return Publish("status_change", MappingProxyType(data))


def _count_failure(state: ModelState, limit: int, failure: Failure | None,
                   ran_for: float | None = None) -> tuple[ModelState, FailureCounted]:
    failures = 0 if ran_for is not None and ran_for >= STABLE_RUN_S else state.failures_in_row
    failures += 1
    crash_loop = failures >= limit
    return (replace(state, failed=True, failures_in_row=failures,
                    crash_loop=state.crash_loop or crash_loop,
                    failure=failure or state.failure),
            FailureCounted(crash_loop and not state.crash_loop))


def _after_run(state: ModelState) -> tuple[ModelState, tuple[Effect, ...]]:
    """Once nothing runs: a removed model is forgotten, a reconfigured one loads again
    (unless in a crash loop: then only an explicit load starts it)."""
    if state.removed:
        return state, (Forget(),)
    if state.restart_after_stop:
        state = replace(state, restart_after_stop=False)
        return (state, ()) if state.crash_loop else _start_load(state, on_demand=False)
    return state, ()


def _start_load(s: ModelState, *, on_demand: bool) -> Result:
    """Start the model's one load task, or make the pending one explicit (not on demand: it
    goes on when no request waits for it any more). Nothing once the router closes."""
    if s.closing:
        return s, ()
    if s.load_pending:
        return (s if on_demand or not s.load_on_demand
                else replace(s, load_on_demand=False)), ()
    return replace(s, load_pending=True, load_on_demand=on_demand), (StartLoad(on_demand),)


def _to_unloaded(state: ModelState, **changes: Any) -> ModelState:
    return replace(state, status=Status.UNLOADED, draining=False, drained_for=None,
                   stop_when_idle=None, progress=None, replicas=(), stopping=(), info=None,
                   loaded_at=None, download=None, killed=(),
                   **changes)


def _without(children: tuple[Any, ...], gone: Any) -> tuple[Any, ...]:
    return tuple(c for c in children if c is not gone)


def _download(s: ModelState, e: Download, limit: int) -> Result:
    new = replace(s, status=Status.DOWNLOADING)
    return new, (_status_change(s, new),)


def _download_progress(s: ModelState, e: DownloadProgress, limit: int) -> Result:
    return replace(s, download=e.progress), (
        Publish("download_progress", MappingProxyType({"progress": e.progress})),)


def _downloaded(s: ModelState, e: Downloaded, limit: int) -> Result:
    new = _to_unloaded(s)
    return new, (Publish("download_finished", MappingProxyType({})), _status_change(s, new))


def _queued(s: ModelState, e: Queued, limit: int) -> Result:
    return s, (Publish("queued", MappingProxyType({"position": e.position,
                                                   "expected_wait_s": e.expected_wait_s})),)


def _download_failed(s: ModelState, e: DownloadFailed, limit: int) -> Result:
    new = _to_unloaded(s)
    effects: list[Effect] = [Publish("download_failed", MappingProxyType({"error": e.error}))]
    if e.cancelled:
        effects.append(_status_change(s, new, reason="cancelled"))
    else:
        new, counted = _count_failure(new, limit, e.failure)
        effects += [counted, _status_change(s, new)]
    new, after = _after_run(new)
    return new, (*effects, *after)


def _admitted(s: ModelState, e: Admitted, limit: int) -> Result:
    new = replace(s, status=Status.LOADING)
    return new, (Publish("model_status", MappingProxyType({"status": new.status.public})),)


def _load_progress(s: ModelState, e: LoadProgress, limit: int) -> Result:
    if e.progress == s.progress:
        return s, ()
    new = replace(s, progress=MappingProxyType(dict(e.progress)))
    return new, (Publish("status_change", MappingProxyType({"status": s.status.public,
                                                            "progress": dict(e.progress)})),)


def _ready(s: ModelState, e: Ready, limit: int) -> Result:
    serving = {id(r.child) for r in e.replicas}
    new = replace(s, status=Status.LOADED, failed=False, progress=None, replicas=e.replicas,
                  starting=tuple(c for c in s.starting if id(c) not in serving),
                  info=e.info, loaded_at=e.loaded_at)
    return new, (_status_change(s, new, **e.data),)


def _spawn_failed(s: ModelState, e: SpawnFailed, limit: int) -> Result:
    new = _to_unloaded(s)
    effects: list[Effect] = []
    if e.cancelled:
        new = replace(new, failed=False)
        effects.append(_status_change(s, new, reason="cancelled"))
    else:
        new, counted = _count_failure(new, limit, e.failure)
        effects += [counted, _status_change(s, new, exit_code=e.exit_code)]
    new, after = _after_run(new)
    return new, (*effects, *after)


def _stopping(s: ModelState, reason: str) -> Result:
    new = replace(s, status=Status.STOPPING, replicas=(), stopping=s.replicas)
    return new, (Publish("stopping", MappingProxyType({"status": new.status.public,
                                                       "reason": reason})),
                 CancelReplacement(), StopChildren(reason, s.replicas))


def _stop(s: ModelState, e: Stop, limit: int) -> Result:
    return _stopping(s, e.reason)


def _idle(s: ModelState, e: Idle, limit: int) -> Result:
    return (s, ()) if s.stop_when_idle is None else _stopping(s, s.stop_when_idle)


DRAINED = "evicted"  # the reason a drained model stops with


def _drain(s: ModelState, e: Drain, limit: int) -> Result:
    if s.draining:
        return s, ()
    new = replace(s, draining=True, drained_for=e.waiting_for, stop_when_idle=DRAINED)
    if e.idle:
        return _stopping(new, DRAINED)
    return new, (Publish("status_change", MappingProxyType({"status": new.status.public,
                                                            "draining": True})),)


def _undrain(s: ModelState, e: Undrain, limit: int) -> Result:
    if s.drained_for is None or s.stop_when_idle != DRAINED:
        return s, ()  # not drained for a swap, or retiring: the stop stands
    new = replace(s, draining=False, drained_for=None, stop_when_idle=None)
    return new, (Publish("status_change", MappingProxyType({"status": new.status.public,
                                                            "draining": False})),)


def _stopped(s: ModelState, e: Stopped, limit: int) -> Result:
    # llama.cpp's router reports the exit code of a stop (0: the child exited as asked); a
    # child that had to be killed is not a failure of the model, so no code then.
    new = _to_unloaded(s, failed=False)
    publish = _status_change(s, new, **({"exit_code": 0} if e.clean else {}))
    new, after = _after_run(new)
    return new, (publish, *after)


def _replica_exited(s: ModelState, e: ReplicaExited, limit: int) -> Result:
    new, counted = _count_failure(
        replace(s, replicas=_without(s.replicas, e.replica),
                killed=tuple(k for k in s.killed if k[0] is not e.replica)),
        limit, e.failure, e.ran_for)
    if new.replicas:
        replace_them = () if new.draining or new.crash_loop else (ReplaceReplicas(),)
        return new, (counted, *replace_them)
    new = _to_unloaded(new)
    publish = _status_change(s, new, exit_code=e.exit_code)
    new, after = _after_run(new)
    return new, (counted, CancelReplacement(), publish, *after)


def _replica_started(s: ModelState, e: ReplicaStarted, limit: int) -> Result:
    new = replace(s, replicas=(*s.replicas, e.replica),
                  starting=_without(s.starting, e.replica.child))
    return new, (Publish("replica_restarted", MappingProxyType({
        "pid": e.replica.child.pid, "replicas": len(new.replicas)})),)


def _replica_unresponsive(s: ModelState, e: ReplicaUnresponsive, limit: int) -> Result:
    if not any(r is e.replica for r in s.replicas):
        return s, ()  # already out of service (killed, or its crash came first)
    new = replace(s, replicas=_without(s.replicas, e.replica),
                  killed=(*s.killed, (e.replica, e.why)))
    return new, (Publish("unresponsive", MappingProxyType({"pid": e.replica.child.pid,
                                                           "reason": e.why})),
                 KillReplica(e.replica, e.why))


def _replica_failed(s: ModelState, e: ReplicaFailed, limit: int) -> Result:
    new, counted = _count_failure(s, limit, e.failure)
    return new, (counted,) if new.crash_loop else (counted, ReplaceReplicas())


def _retire(s: ModelState, e: Retire, limit: int) -> Result:
    removed = s.removed or e.removed
    status = s.status
    if status is Status.LOADED:
        new = replace(s, removed=removed, draining=True, drained_for=None,
                      stop_when_idle=e.reason, restart_after_stop=not removed)
        return _stopping(new, e.reason) if e.idle else (new, ())
    if status is Status.UNLOADED:
        new = replace(s, removed=removed)
        return new, (CancelLoad(e.reason), Forget()) if removed else ()
    if status is Status.STOPPING:  # the stop goes on; a removed model is forgotten after it
        return replace(s, removed=removed), ()
    # downloading or loading: start over with the new preset, or not at all
    new = replace(s, removed=removed, restart_after_stop=not removed)
    cancel = (CancelDownload(), CancelLoad(e.reason)) if status is Status.DOWNLOADING \
        else (CancelLoad(e.reason),)
    return new, cancel


def _unload(s: ModelState, e: Unload, limit: int) -> Result:
    if e.explicit and s.status in (Status.UNLOADED, Status.STOPPING) and not s.load_pending:
        return s, (Refuse(NOT_RUNNING),)
    new = replace(s, restart_after_stop=False)
    cancel = CancelLoad(UNLOADED)
    if s.status is Status.LOADED:
        stopping, effects = _stopping(new, UNLOADED)
        return stopping, (cancel, *effects)  # also a load waiting for the old child to stop
    if s.status is Status.DOWNLOADING:
        return new, (CancelDownload(), cancel)
    return new, (cancel,)  # loading, queued, or stopping (a load may wait for the stop)


def _reset(s: ModelState, e: Reset, limit: int) -> Result:
    return replace(s, failures_in_row=0, crash_loop=False), ()


def _load_wanted(s: ModelState, e: LoadWanted, limit: int) -> Result:
    if s.closing:
        return s, (Refuse(CLOSING),)
    if e.explicit:
        if s.status is not Status.UNLOADED:
            return s, (Refuse(ALREADY_RUNNING),)
        s = replace(s, failures_in_row=0, crash_loop=False)
    elif s.crash_loop and not s.load_pending:
        return s, (Refuse(CRASH_LOOP),)
    return _start_load(s, on_demand=e.on_demand)


def _nobody_waits(s: ModelState, e: NobodyWaits, limit: int) -> Result:
    if (s.load_pending and s.load_on_demand
            and s.status in (Status.UNLOADED, Status.LOADED, Status.STOPPING)):
        return s, (CancelLoad(UNWANTED),)
    return s, ()


def _closing(s: ModelState, e: Closing, limit: int) -> Result:
    return replace(s, closing=True, restart_after_stop=False), (CancelDownload(),
                                                                CancelLoad(SHUTDOWN))


def _load_ended(s: ModelState, e: LoadEnded, limit: int) -> Result:
    return replace(s, load_pending=False, load_on_demand=False), ()


def _child_started(s: ModelState, e: ChildStarted, limit: int) -> Result:
    return replace(s, starting=(*s.starting, e.child)), ()


def _child_gone(s: ModelState, e: ChildGone, limit: int) -> Result:
    return replace(s, starting=_without(s.starting, e.child)), ()


def _listed(s: ModelState, e: Listed, limit: int) -> Result:
    return s, (Publish("model_status", MappingProxyType({"status": s.status.public})),)


def _forgotten(s: ModelState, e: Forgotten, limit: int) -> Result:
    return s, (Publish(MODEL_REMOVED, MappingProxyType({})),)


U, D, L, OK, S = (Status.UNLOADED, Status.DOWNLOADING, Status.LOADING, Status.LOADED,
                  Status.STOPPING)

TABLE: dict[tuple[Status, type], Callable[[ModelState, Any, int], Result]] = {
    (U, Download): _download,
    (D, DownloadProgress): _download_progress,
    (D, Downloaded): _downloaded,
    (U, Queued): _queued,
    (D, DownloadFailed): _download_failed,
    (U, Admitted): _admitted,
    (L, LoadProgress): _load_progress,
    (L, Ready): _ready,
    (L, SpawnFailed): _spawn_failed,
    (OK, Stop): _stop,
    (OK, Idle): _idle,
    (OK, Drain): _drain,
    (OK, Undrain): _undrain,
    (OK, ReplicaExited): _replica_exited,
    (OK, ReplicaFailed): _replica_failed,
    (OK, ReplicaStarted): _replica_started,
    (OK, ReplicaUnresponsive): _replica_unresponsive,
    (S, Stopped): _stopped,
    **{(status, Retire): _retire for status in Status},
    **{(status, Unload): _unload for status in Status},
    **{(status, Reset): _reset for status in Status},
    **{(status, LoadWanted): _load_wanted for status in Status},
    **{(status, LoadEnded): _load_ended for status in Status},
    **{(status, NobodyWaits): _nobody_waits for status in Status},
    **{(status, Closing): _closing for status in Status},
    **{(status, ChildStarted): _child_started for status in Status},
    **{(status, ChildGone): _child_gone for status in Status},
    (U, Listed): _listed,
    (U, Forgotten): _forgotten,
}

# Events that may arrive after the status they were meant for has passed: they change nothing.
IGNORED: frozenset[tuple[Status, type]] = frozenset({
    (U, Stop), (D, Stop), (L, Stop), (S, Stop),  # already stopped or stopping; loads cancel
    (U, Idle), (D, Idle), (L, Idle), (S, Idle),  # the last request of a stopped model ended
    (U, Undrain), (D, Undrain), (L, Undrain), (S, Undrain),  # the drain ended with a stop
    (U, LoadProgress), (D, LoadProgress), (OK, LoadProgress), (S, LoadProgress),  # late report
    (U, DownloadProgress), (L, DownloadProgress), (OK, DownloadProgress),  # after the end
    (S, DownloadProgress),
    (D, Queued), (L, Queued), (OK, Queued), (S, Queued),  # moved on before it was told
    # A replica that changed after its model stopped: the stop ended its run.
    (U, ReplicaStarted), (D, ReplicaStarted), (L, ReplicaStarted), (S, ReplicaStarted),
    (U, ReplicaUnresponsive), (D, ReplicaUnresponsive), (L, ReplicaUnresponsive),
    (S, ReplicaUnresponsive),
})
