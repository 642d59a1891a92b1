"""One peer router: the one owner of what this router knows of it (``peerstate``).

``Peer.apply`` is the only writer of a peer's state: the other modules send it events
(``peerhealth`` its probes and what ``/props`` said, ``catalogue`` its listings and events,
``hop`` a call that could not reach it) and read its properties. It performs the effects and
owns the peer's tasks: its health checks (``peerhealth.watch``), the reach of a peer that
answers again (``peerhealth.reach``: who it is, its models), the follower of its events
(``catalogue.follow``) and the import of its models again (``catalogue.resync``), each run
by the ``work`` it is given (``tasks.perform``: those modules stand above this one). Each task
reports its end as an event; a task that was ended (cancelled) reports nothing, and a report
that comes when its task is no longer wanted is ignored.

Besides its state, a ``Peer`` holds its configuration (set once, in ``__init__``), the one
way to reach it: a keep-alive pool (``upstream.ChildConnections``) with the peer key
(``--peer-api-key-file``) as a bearer token, used by every call through ``hop``; the router's
own calls to it in progress (``calling``: aborted when it is found frozen) and the requests in
flight to it by model (``sending``: placement's load measure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import httpx

from ..config.settings import DEFAULT_UPSTREAM_TIMEOUT_S
from ..events import EventBus
from ..http.upstream import Cancel, ChildConnections
from .peerstate import (  # the peer's state: its one writer is ``Peer.apply``
    Abort,
    Begin,
    Close,
    End,
    FollowerEnded,
    Frozen,
    Log,
    NodeFacts,
    PeerConfig,
    PeerEvent,
    PeerState,
    Phase,
    Publish,
    ReachFailed,
    Resynced,
    Start,
    Task,
    Unreachable,
    status_of,
    transition,
)

log = logging.getLogger("router.peers")
PEER_MAX_CONNECTIONS = 256  # to one peer; it queues what it cannot serve at once
_NOTHING: Mapping[str, Any] = MappingProxyType({})

# What runs one of a peer's tasks, until it ends: the event that reports its end, if any.
Work = Callable[["Peer", Task], Awaitable[PeerEvent | None]]


def new_instance_id() -> str:
    """This router's instance id: random, made at start. It decides "is this peer myself"
    and makes up the via chain; the node name is only a label."""
    return secrets.token_hex(8)


# ----------------------------------------------------------------------------- the peer

class Peer:
    """One peer router at ``url`` (``http://host:port``). Its state is read through
    properties (none has a setter) and changed by ``apply`` only; its configuration is set in
    ``__init__`` and never again (``__slots__``: nothing else can be added to it)."""

    __slots__ = ("_calls", "_ending", "_outstanding", "_state", "_tasks", "auth", "client",
                 "config", "connections", "events", "host", "interval", "label",
                 "own_instance", "own_node", "port", "prefix", "probe_headers", "timeout",
                 "url", "work")

    def __init__(self, url: str, *, client: httpx.AsyncClient, events: EventBus, work: Work,
                 own_node: str, own_instance: str = "", api_key: str | None = None,
                 prefix: bool = False, interval: float = 2.0, timeout: float = 3.0,
                 misses: int = 3, label: Callable[[Peer, str], str] | None = None,
                 head_timeout: float = DEFAULT_UPSTREAM_TIMEOUT_S) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        self.client = client  # for its health probes only (``peerhealth``)
        self.events = events
        self.work = work  # runs its tasks (``tasks.perform``)
        self.own_node = own_node
        self.own_instance = own_instance or new_instance_id()
        self.label = label
        self.prefix = prefix
        self.interval = max(interval, 0.2)
        self.timeout = timeout
        self.config = PeerConfig(url, self.own_instance, misses)  # what the transition reads
        self.connections = ChildConnections(self.host, self.port, PEER_MAX_CONNECTIONS,
                                            label=f"peer router {self.url}",
                                            head_timeout_s=head_timeout)
        self.auth: list[tuple[bytes, bytes]] = []
        # With the health probes (never logged).
        self.probe_headers = {"connection": "close"}
        if api_key:
            self.auth = [(b"authorization", f"Bearer {api_key}".encode("latin-1"))]
            self.probe_headers["authorization"] = f"Bearer {api_key}"
        # Written by ``apply`` only.
        self._state = PeerState(node=f"{self.host}:{self.port}")
        self._tasks: dict[Task, asyncio.Task[None]] = {}  # the last one begun of each
        self._ending: set[asyncio.Task[None]] = set()  # ended (cancelled), not done yet
        # The router's own calls to it in progress (``hop``, through ``calling``): each ends
        # when it is found frozen, even one the pool would retry on a fresh connection.
        self._calls: set[Callable[[], None]] = set()
        self._outstanding: dict[str, int] = {}  # requests in flight to it, by model id

    def __repr__(self) -> str:
        return f"<Peer {self.node} {self.url} {self.phase}>"

    # ----------------------------------------------------------------- its state, read

    @property
    def state(self) -> PeerState:
        return self._state

    @property
    def phase(self) -> Phase:
        return self._state.phase

    @property
    def up(self) -> bool:
        return self._state.phase is Phase.UP

    @property
    def is_self(self) -> bool:
        """Its /props gives this router's instance id: never used."""
        return self._state.phase is Phase.SELF

    @property
    def reason(self) -> str:
        return self._state.reason

    @property
    def node(self) -> str:
        return self._state.node

    @property
    def name(self) -> str:
        return self._state.name

    @property
    def instance(self) -> str:
        return self._state.instance

    @property
    def models(self) -> Mapping[str, Mapping[str, Any]]:
        """This router's id of each model the peer lists -> the peer's entry (node set)."""
        return self._state.listing.models

    @property
    def peer_ids(self) -> Mapping[str, str]:
        """This router's id -> the peer's id."""
        return self._state.listing.ids

    @property
    def facts(self) -> Mapping[str, NodeFacts]:
        """This router's id -> what the peer's entry says of it (read once per listing)."""
        return self._state.listing.facts

    @property
    def events_problem(self) -> str:
        return self._state.events_problem

    @property
    def missed(self) -> int:
        return self._state.missed

    @property
    def calls(self) -> frozenset[Callable[[], None]]:
        return frozenset(self._calls)

    @property
    def outstanding(self) -> Mapping[str, int]:
        return MappingProxyType(self._outstanding)

    @property
    def via(self) -> str:
        """What stands for this peer in a via chain: its instance id (its address for a
        llama.cpp router, which has none)."""
        return self.instance or self.url

    def local_id(self, peer_id: str) -> str:
        return f"{self.node}/{peer_id}" if self.prefix else peer_id

    def status_of(self, model_id: str) -> str:
        return status_of(self.models, model_id)

    def serves(self, model_id: str) -> bool:
        """Up, and it lists ``model_id``: a candidate for its requests."""
        return self.up and model_id in self.models

    # ----------------------------------------------------------------- the one writer

    def apply(self, event: PeerEvent) -> None:
        """Move the peer through ``event`` and perform the effects (an event that cannot
        happen now raises InvalidTransition)."""
        self._state, effects = transition(self._state, event, self.config)
        for effect in effects:
            match effect:
                case Publish(payload):
                    self.events.publish_payload(dict(payload))
                case Log(level, message, name):
                    log.log(level, "%s", message, extra={"event": name})
                case Begin(task):
                    self._tasks[task] = asyncio.create_task(
                        self._run(task), name=f"peer-{task}:{self.url}")
                case End(task):
                    ended = self._tasks.pop(task, None)
                    if ended is not None and not ended.done():
                        ended.cancel()
                        self._ending.add(ended)
                        ended.add_done_callback(self._ending.discard)
                case Abort():
                    for cancel in list(self._calls):
                        cancel()
                    self.connections.abort_all()

    async def _run(self, task: Task) -> None:
        """One of its tasks; its end reported as an event (none when it was ended)."""
        try:
            ended = await self.work(self, task)
        except Exception as exc:  # reported as the task's failure: never left running
            log.exception("peer %s: %s failed", self.url, task, exc_info=exc)
            ended = (ReachFailed(f"{type(exc).__name__}: {exc}") if task is Task.REACH
                     else FollowerEnded() if task is Task.FOLLOW else Resynced())
        if ended is not None:
            self.apply(ended)

    # ----------------------------------------------------------------- events in

    def start(self) -> None:
        self.apply(Start())

    async def close(self) -> None:
        self.apply(Close())
        for task in [*self._tasks.values(), *self._ending]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.connections.aclose()  # requests in flight finish (see ``Unreachable``)

    def mark_down(self, reason: str, *, abort: bool = False) -> None:
        """Send the peer nothing new until a probe answers; with ``abort`` (it stopped
        answering at all) its calls in flight end now (``Frozen``, else ``Unreachable``)."""
        self.apply(Frozen(reason) if abort else Unreachable(reason))

    def unreachable(self, reason: str) -> None:
        """A connection to the peer failed: down at once (the probes bring it back)."""
        self.apply(Unreachable(reason))

    # ----------------------------------------------------------------- what is in flight

    @contextlib.contextmanager
    def calling(self, cancel: Cancel) -> Iterator[None]:
        """One of the router's own calls to it (``hop``), ended by ``cancel`` if it is found
        frozen meanwhile."""
        self._calls.add(cancel)
        try:
            yield
        finally:
            self._calls.discard(cancel)

    @contextlib.contextmanager
    def sending(self, model_id: str) -> Iterator[None]:
        """A request for ``model_id`` in flight to it (``nodes``)."""
        self._outstanding[model_id] = self._outstanding.get(model_id, 0) + 1
        try:
            yield
        finally:
            left = self._outstanding[model_id] - 1
            if left:
                self._outstanding[model_id] = left
            else:
                del self._outstanding[model_id]
