"""One peer router: what this router knows of it, as one state with one owner.

A peer's state is one frozen value, ``PeerState``: its ``phase`` (``unknown``: not reached
yet; ``up``; ``down``; ``self``: it is this router; ``closed``: removed), why it is not used
(``reason``), what it knows of it (its instance id, node name and label, its models: a
snapshot of its listing, with what each entry says of its node read once, ``Listing.facts``;
the problem of its event stream, its health checks missed in a row) and which of its tasks
run. ``transition(state, event, config)`` is the only way to a new state. It performs nothing:
it returns the effects (publish an event, log, begin or end one of its tasks, abort the calls
in flight), so every phase x event pair is unit-tested (``tests/test_peer_state.py``).

============ ============================ ================================================
phase        event                        to (effects)
============ ============================ ================================================
unknown      Start                        unknown (begin its health checks)
unknown/down ProbeAnswered                the same (begin the reach, unless one runs)
unknown/down ProbeMissed                  the same, its reason the probe's problem
unknown/down Identified                   self (it is this router: log) or the same, with
                                          its instance id, node name and label
unknown/down Reached                      up (publish ``peer_up`` and each model's status,
                                          ``removed`` for models it no longer lists; begin
                                          following its events)
unknown/down ReachFailed                  the same, with the reason
up           ProbeAnswered                up (follow its events again if that ended)
up           ProbeMissed                  up, or down after ``misses`` in a row (abort its
                                          calls if it was silent: frozen)
up           Unreachable / Frozen         down (Frozen: abort its calls)
up           Listed / Resynced            up, with its models (``removed`` published)
up           Heard                        up: one of its events (status kept, relayed; a
                                          model it did not list: import again)
up           FollowerEnded                up (its event stream's problem, if any)
down-going   (any way to down)            publish ``peer_down`` and every model it listed
                                          unavailable; end the follower and the import
any          Close                        closed (end its tasks; up: models unavailable)
closed       anything                     ignored (a task's report as it was ending)
============ ============================ ================================================

Reports in a phase where their task never runs are rejected (``InvalidTransition``: a bug);
``Start`` is rejected but on a fresh peer; a call failing (``Unreachable``, ``Frozen``) on a
peer that is not up, and probes of a peer that is this router, are ignored.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any

NOT_REACHED = "not reached yet"
_NOTHING: Mapping[str, Any] = MappingProxyType({})


# ----------------------------------------------------------------------------- the state

class Phase(StrEnum):
    UNKNOWN = "unknown"  # not reached yet: probed until it answers
    UP = "up"  # used: its models are served through it
    DOWN = "down"  # it was up and stopped answering (or a call to it failed)
    SELF = "self"  # its /props gives this router's instance id: never used
    CLOSED = "closed"  # removed (no source names it now): its tasks ended


class Task(StrEnum):
    """The peer's tasks, each begun and ended by its state's effects."""

    WATCH = "watch"  # its health checks, for as long as it is configured
    REACH = "reach"  # who it is (/props) and its models (/models), once it answers
    FOLLOW = "follow"  # its /models/sse, while it is up
    RESYNC = "resync"  # its /models again, while it is up (once at a time)


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return mapping if isinstance(mapping, MappingProxyType) else MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class NodeFacts:
    """What a node says of its model, for placement (``by_saved_state``)."""

    keeps: bool = False  # it keeps the model's conversations on disk (``--state-dir``)
    load_s: float | None = None  # how long its last load of the model took
    prompt_s_per_char: float | None = None  # its fastest replica's prompt computation


UNKNOWN = NodeFacts()


def _seconds(value: object) -> float | None:
    """A duration a peer reported: a finite number of seconds, at least 0; else unknown."""
    if type(value) not in (int, float):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an integer past any float
        return None
    return number if math.isfinite(number) and number >= 0 else None


def facts_of(entry: Mapping[str, Any]) -> NodeFacts:
    """A node's facts from its ``/models`` entry for the model (read once, as its listing
    arrives: ``Listing.facts``): whether it keeps the model's conversations
    (``status.states``), how long its last load took (``status.load_s``), and how fast its
    replicas compute a prompt (``status.replicas[].pace``). Whatever is malformed or missing
    is unknown (a peer's listing is input, not trusted to be well formed)."""
    status = entry.get("status")
    if not isinstance(status, Mapping):
        return UNKNOWN
    rates = []
    replicas = status.get("replicas")
    for replica in replicas if isinstance(replicas, list) else ():
        pace = replica.get("pace") if isinstance(replica, Mapping) else None
        ms = _seconds(pace.get("prompt_ms_per_kchar")) if isinstance(pace, Mapping) else None
        if ms:
            rates.append(ms / 1e6)
    return NodeFacts(isinstance(status.get("states"), Mapping), _seconds(status.get("load_s")),
                     min(rates, default=None))


@dataclass(frozen=True, slots=True)
class Listing:
    """A peer's models as this router knows them: this router's id of each -> the peer's
    ``/models`` entry (with its ``node``), -> the peer's own id, and -> what the entry says
    of the node (``facts``: read once, here, when the listing is made; a model missing there
    is read from its entry now). Never changed in place: a change is a new listing."""

    models: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: _NOTHING)
    ids: Mapping[str, str] = field(default_factory=lambda: _NOTHING)
    facts: Mapping[str, NodeFacts] = field(default_factory=lambda: _NOTHING)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", _frozen(self.models))
        object.__setattr__(self, "ids", _frozen(self.ids))
        facts = self.facts
        if facts.keys() != self.models.keys():
            facts = {m: facts.get(m) or facts_of(e) for m, e in self.models.items()}
        object.__setattr__(self, "facts", _frozen(facts))


@dataclass(frozen=True, slots=True)
class PeerState:
    phase: Phase = Phase.UNKNOWN
    reason: str = NOT_REACHED  # why it is not used ("" while up)
    node: str = ""  # its label: its address until its /props names it
    name: str = ""  # the node name its /props gives (a label may add its address)
    instance: str = ""  # its instance id, from its /props (a llama.cpp router: none)
    listing: Listing = field(default_factory=Listing)
    missed: int = 0  # health checks missed in a row
    events_problem: str = ""  # why its event stream was given up, until it works again
    running: frozenset[Task] = frozenset()  # its tasks begun and not ended

    @property
    def up(self) -> bool:
        return self.phase is Phase.UP

    @property
    def models(self) -> Mapping[str, Mapping[str, Any]]:
        return self.listing.models


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """What the transition needs of the peer's configuration."""

    url: str
    own_instance: str  # this router's
    misses: int = 3  # health checks missed in a row that mark it down


# A model's status in a peer's listing, where it means something across nodes.
LOADED, LOADING = "loaded", "loading"


def status_of(models: Mapping[str, Mapping[str, Any]], model_id: str) -> str:
    entry = models.get(model_id) or {}
    status = entry.get("status")
    value = status.get("value") if isinstance(status, dict) else status
    return value if isinstance(value, str) else "unloaded"


# ----------------------------------------------------------------------------- events

@dataclass(frozen=True, slots=True)
class Start:
    """Begin its health checks (``Peer.start``)."""


@dataclass(frozen=True, slots=True)
class ProbeAnswered:
    """``GET /health`` answered 200 in time."""


@dataclass(frozen=True, slots=True)
class ProbeMissed:
    problem: str
    silent: bool = False  # no answer in time: frozen, or the network is cut


@dataclass(frozen=True, slots=True)
class Identified:
    """What its ``/props`` says (with what an earlier one said, where this one says
    nothing): its instance id, node name, and the label it is shown under ("" keeps it)."""

    instance: str = ""
    name: str = ""
    label: str = ""


@dataclass(frozen=True, slots=True)
class Reached:
    """The reach imported its models: it is up."""

    listing: Listing


@dataclass(frozen=True, slots=True)
class ReachFailed:
    reason: str


@dataclass(frozen=True, slots=True)
class Listed:
    """Its listing, imported again by the follower once subscribed."""

    listing: Listing


@dataclass(frozen=True, slots=True)
class Resynced:
    """The import of its models again ended (None: it failed; the next events or health
    check try again)."""

    listing: Listing | None = None


@dataclass(frozen=True, slots=True)
class Heard:
    """One event of its ``/models/sse``: the stream works. ``model`` (this router's id) and
    ``status``: a model's new status; ``relay``: the event as this router publishes it;
    ``resync``: its listing must be imported again (events were dropped)."""

    model: str = ""
    status: str | None = None
    relay: Mapping[str, Any] | None = None
    resync: bool = False


@dataclass(frozen=True, slots=True)
class FollowerEnded:
    problem: str = ""  # why its stream was given up ("": it ended; followed again)


@dataclass(frozen=True, slots=True)
class Unreachable:
    """A call to it failed: down at once; its calls in flight run on (a peer that refuses
    connections is gone, and so are they, or shutting down, finishing them)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Frozen:
    """It stopped answering at all: down, and its calls in flight end now."""

    reason: str


@dataclass(frozen=True, slots=True)
class Close:
    """Removed: no source names it now (or the router stops)."""


PeerEvent = (Start | ProbeAnswered | ProbeMissed | Identified | Reached | ReachFailed | Listed
             | Resynced | Heard | FollowerEnded | Unreachable | Frozen | Close)
EVENT_TYPES: tuple[type, ...] = (Start, ProbeAnswered, ProbeMissed, Identified, Reached,
                                 ReachFailed, Listed, Resynced, Heard, FollowerEnded,
                                 Unreachable, Frozen, Close)


# ----------------------------------------------------------------------------- effects

@dataclass(frozen=True, slots=True)
class Publish:
    payload: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Log:
    level: int
    message: str
    event: str


@dataclass(frozen=True, slots=True)
class Begin:
    task: Task


@dataclass(frozen=True, slots=True)
class End:
    task: Task


@dataclass(frozen=True, slots=True)
class Abort:
    """End the router's calls in flight to it and abort every connection of its pool."""


Effect = Publish | Log | Begin | End | Abort
Result = tuple[PeerState, tuple[Effect, ...]]


class InvalidTransition(RuntimeError):
    def __init__(self, phase: Phase, event: object) -> None:
        super().__init__(f"peer: {type(event).__name__} cannot happen while {phase}")
        self.phase = phase
        self.event = event


# ----------------------------------------------------------------------------- transitions

def transition(state: PeerState, event: PeerEvent, config: PeerConfig) -> Result:
    """The state after ``event`` and what to do about it; raises InvalidTransition for an
    event that cannot happen in the state's phase."""
    key = (state.phase, type(event))
    if key in IGNORED:
        return state, ()
    rule = TABLE.get(key)
    if rule is None:
        raise InvalidTransition(state.phase, event)
    return rule(state, event, config)


def _status(state: PeerState, model_id: str, **data: Any) -> Publish:
    return Publish({"model": model_id, "event": "status_change", "node": state.node,
                    "data": {"status": status_of(state.models, model_id), **data}})


def _unavailable(state: PeerState, message: str) -> tuple[Effect, ...]:
    return tuple(Publish({"model": model_id, "event": "status_change", "node": state.node,
                          "data": {"status": "unloaded", "unavailable": True,
                                   "message": message}})
                 for model_id in state.models)


def _ending(state: PeerState, *tasks: Task) -> tuple[Effect, ...]:
    return tuple(End(task) for task in tasks if task in state.running)


def _relisted(state: PeerState, listing: Listing) -> Result:
    """``state`` with ``listing``: each model it no longer lists published ``removed``."""
    gone = [m for m in state.models if m not in listing.models]
    return replace(state, listing=listing), tuple(
        Publish({"model": model_id, "event": "status_change", "node": state.node,
                 "data": {"status": "unloaded", "removed": True}}) for model_id in gone)


def _down(state: PeerState, reason: str, config: PeerConfig, *, abort: bool) -> Result:
    """Send the peer nothing new until a probe answers. With ``abort`` (it stopped
    answering at all: frozen, or cut off) its requests in flight and the router's own calls
    to it end now; otherwise they run on."""
    new = replace(state, phase=Phase.DOWN, reason=reason, missed=0,
                  running=state.running - {Task.FOLLOW, Task.RESYNC})
    return new, (
        *_ending(state, Task.FOLLOW, Task.RESYNC),
        *((Abort(),) if abort else ()),
        Log(logging.WARNING, f"peer {state.node} is down: {reason}", "peer_down"),
        Publish({"model": "*", "event": "peer_down", "node": state.node,
                 "data": {"url": config.url, "reason": reason}}),
        *_unavailable(state, f"node {state.node} is not answering: {reason}"))


def _start(s: PeerState, e: Start, c: PeerConfig) -> Result:
    if Task.WATCH in s.running:
        raise InvalidTransition(s.phase, e)  # started twice
    return replace(s, running=s.running | {Task.WATCH}), (Begin(Task.WATCH),)


def _answered_not_up(s: PeerState, e: ProbeAnswered, c: PeerConfig) -> Result:
    if Task.REACH in s.running:  # a reach runs: it says
        return replace(s, missed=0), ()
    return replace(s, missed=0, running=s.running | {Task.REACH}), (Begin(Task.REACH),)


def _missed_not_up(s: PeerState, e: ProbeMissed, c: PeerConfig) -> Result:
    return replace(s, missed=s.missed + 1, reason=e.problem), ()


def _identified(s: PeerState, e: Identified, c: PeerConfig) -> Result:
    if Task.REACH not in s.running:
        return s, ()  # late
    if e.instance and e.instance == c.own_instance:  # --peer-dns (or --peer) found this router
        reason = f"it is this router (instance {e.instance})"
        return replace(s, phase=Phase.SELF, reason=reason, instance=e.instance,
                       running=s.running - {Task.REACH}), (
            Log(logging.WARNING, f"peer {c.url} is this router (instance {e.instance}); "
                                 "not used", "peer_is_self"),)
    return replace(s, instance=e.instance, name=e.name, node=e.label or s.node), ()


def _reached(s: PeerState, e: Reached, c: PeerConfig) -> Result:
    if Task.REACH not in s.running:
        return s, ()  # late
    new, removed = _relisted(s, e.listing)
    new = replace(new, phase=Phase.UP, reason="", missed=0,
                  running=(s.running - {Task.REACH}) | {Task.FOLLOW})
    models = sorted(new.models)
    return new, (
        *removed,
        Log(logging.INFO, f"peer {new.node} is up at {c.url} with {len(models)} models",
            "peer_up"),
        Publish({"model": "*", "event": "peer_up", "node": new.node,
                 "data": {"url": c.url, "models": models}}),
        *(_status(new, model_id) for model_id in new.models),
        Begin(Task.FOLLOW))


def _reach_failed(s: PeerState, e: ReachFailed, c: PeerConfig) -> Result:
    if Task.REACH not in s.running:
        return s, ()  # late
    return replace(s, reason=e.reason, running=s.running - {Task.REACH}), ()


def _answered_up(s: PeerState, e: ProbeAnswered, c: PeerConfig) -> Result:
    if Task.FOLLOW in s.running:
        return (replace(s, missed=0) if s.missed else s), ()
    return replace(s, missed=0, running=s.running | {Task.FOLLOW}), (Begin(Task.FOLLOW),)


def _missed_up(s: PeerState, e: ProbeMissed, c: PeerConfig) -> Result:
    missed = s.missed + 1
    if missed >= c.misses:
        return _down(s, f"missed {missed} health checks ({e.problem})", c, abort=e.silent)
    return replace(s, missed=missed), ()


def _unreachable(s: PeerState, e: Unreachable, c: PeerConfig) -> Result:
    return _down(s, e.reason, c, abort=False)


def _frozen_up(s: PeerState, e: Frozen, c: PeerConfig) -> Result:
    return _down(s, e.reason, c, abort=True)


def _listed(s: PeerState, e: Listed, c: PeerConfig) -> Result:
    return _relisted(s, e.listing)


def _resynced(s: PeerState, e: Resynced, c: PeerConfig) -> Result:
    if Task.RESYNC not in s.running:
        return s, ()  # late
    new = replace(s, running=s.running - {Task.RESYNC})
    return _relisted(new, e.listing) if e.listing is not None else (new, ())


def _heard(s: PeerState, e: Heard, c: PeerConfig) -> Result:
    new = replace(s, events_problem="") if s.events_problem else s
    effects: list[Effect] = []
    entry = new.models.get(e.model) if e.model else None
    unlisted = bool(e.model) and entry is None  # a model it did not list before
    if (e.resync or unlisted) and Task.RESYNC not in new.running:
        new = replace(new, running=new.running | {Task.RESYNC})
        effects.append(Begin(Task.RESYNC))
    if entry is not None and e.status is not None and status_of(new.models, e.model) != e.status:
        status = entry.get("status")
        entry = {**entry, "status": {**status, "value": e.status} if isinstance(status, dict)
                 else {"value": e.status}}
        new = replace(new, listing=Listing({**new.models, e.model: entry}, new.listing.ids,
                                           new.listing.facts))  # its facts as listed
    if e.relay is not None:
        effects.append(Publish(e.relay))
    return new, tuple(effects)


def _follower_ended(s: PeerState, e: FollowerEnded, c: PeerConfig) -> Result:
    if Task.FOLLOW not in s.running:
        return s, ()  # late
    new = replace(s, running=s.running - {Task.FOLLOW})
    if not e.problem:
        return new, ()
    return replace(new, events_problem=e.problem), (
        Log(logging.WARNING, f"peer {s.node}: {e.problem} (the next health check follows it "
                             "again)", "peer_events_broken"),)


def _close(s: PeerState, e: Close, c: PeerConfig) -> Result:
    new = replace(s, phase=Phase.CLOSED, reason="removed", running=frozenset())
    return new, (*_ending(s, *Task),
                 *(_unavailable(s, f"peer {s.node} was removed") if s.up else ()))


NOT_UP = (Phase.UNKNOWN, Phase.DOWN)
LIVE = (Phase.UNKNOWN, Phase.UP, Phase.DOWN, Phase.SELF)
Rule = Callable[[PeerState, Any, PeerConfig], Result]
TABLE: dict[tuple[Phase, type], Rule] = {
    (Phase.UNKNOWN, Start): _start,
    **{(p, ProbeAnswered): _answered_not_up for p in NOT_UP},
    **{(p, ProbeMissed): _missed_not_up for p in NOT_UP},
    **{(p, Identified): _identified for p in NOT_UP},
    **{(p, Reached): _reached for p in NOT_UP},
    **{(p, ReachFailed): _reach_failed for p in NOT_UP},
    (Phase.UP, ProbeAnswered): _answered_up,
    (Phase.UP, ProbeMissed): _missed_up,
    (Phase.UP, Unreachable): _unreachable,
    (Phase.UP, Frozen): _frozen_up,
    (Phase.UP, Listed): _listed,
    (Phase.UP, Resynced): _resynced,
    (Phase.UP, Heard): _heard,
    (Phase.UP, FollowerEnded): _follower_ended,
    **{(p, Close): _close for p in LIVE},
}
IGNORED: frozenset[tuple[Phase, type]] = frozenset({
    # A call that fails on a peer that is not up (it was in flight when it went down).
    *((p, t) for p in (*NOT_UP, Phase.SELF) for t in (Unreachable, Frozen)),
    # A peer that is this router is still probed; nothing comes of it.
    (Phase.SELF, ProbeAnswered), (Phase.SELF, ProbeMissed),
    # Removed: what its tasks report as they end, and a second close.
    *((Phase.CLOSED, t) for t in EVENT_TYPES if t is not Start),
})
# Anything else cannot happen (InvalidTransition): ``Start`` but on a fresh peer; the reach's
# reports but while not up (it runs only then); the follower's and the import's but while up.
REJECTED: frozenset[tuple[Phase, type]] = frozenset(
    (p, t) for p in Phase for t in EVENT_TYPES) - TABLE.keys() - IGNORED
