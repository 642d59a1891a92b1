"""One peer router: what this router knows of it, and its lifetime.

A ``Peer`` holds the peer's identity (its address, its instance id and node name from its
``/props``, the label it is shown under), whether it is up and why not, its models
(``catalogue``), the requests in flight to it, and the one way to reach it: a keep-alive pool
(``upstream.ChildConnections``) with the peer key (``--peer-api-key-file``) as a bearer token,
used by every call through ``hop``. ``start`` runs its health checks (``peerhealth``), which
bring it up, follow its events (``catalogue``) and mark it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from .events import EventBus
from .liveness import Misses
from .peerhealth import watch
from .placement import LOADED, Candidate
from .settings import DEFAULT_UPSTREAM_TIMEOUT_S
from .upstream import ChildConnections

log = logging.getLogger("router.peers")
PEER_MAX_CONNECTIONS = 256  # to one peer; it queues what it cannot serve at once


def new_instance_id() -> str:
    """This router's instance id: random, made at start. It decides "is this peer myself"
    and makes up the via chain; the node name is only a label."""
    return secrets.token_hex(8)


class Peer:
    """One peer router at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, *, client: httpx.AsyncClient, events: EventBus,
                 own_node: str, own_instance: str = "", api_key: str | None = None,
                 prefix: bool = False, interval: float = 2.0, timeout: float = 3.0,
                 misses: int = 3, label: Callable[[Peer, str], str] | None = None,
                 missed: Misses[Peer] | None = None,
                 head_timeout: float = DEFAULT_UPSTREAM_TIMEOUT_S) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        self.node = f"{parts.hostname}:{self.port}"  # its label: until its /props names it
        self.name = ""  # the node name its /props gives (a label may add its address)
        self.instance = ""  # its instance id, from its /props (a llama.cpp router: none)
        self.client = client  # for its health probes only (``peerhealth``)
        self.events = events
        self.own_node = own_node
        self.own_instance = own_instance or new_instance_id()
        self.label = label
        self.prefix = prefix
        self.interval = max(interval, 0.2)
        self.timeout = timeout
        self.misses = misses  # health checks missed in a row that mark it down
        self.missed: Misses[Peer] = missed if missed is not None else Misses()
        self.up = False
        self.is_self = False  # its /props gives this router's instance id: never used
        self.reason = "not reached yet"
        self.events_problem = ""  # why its event stream was given up, until it works again
        # This router's id of each model the peer lists -> the peer's entry (node set).
        self.models: dict[str, dict[str, Any]] = {}
        self.peer_ids: dict[str, str] = {}  # this router's id -> the peer's id
        self.outstanding: dict[str, int] = {}  # requests in flight to it, by model id
        self.connections = ChildConnections(self.host, self.port, PEER_MAX_CONNECTIONS,
                                            label=f"peer router {self.url}",
                                            head_timeout_s=head_timeout)
        # The router's own calls to it in progress (``hop``): each ends when it is found
        # frozen, even one the pool would retry on a fresh connection.
        self.calls: set[Callable[[], None]] = set()
        self.auth: list[tuple[bytes, bytes]] = []
        # With the health probes (never logged).
        self.probe_headers = {"connection": "close"}
        if api_key:
            self.auth = [(b"authorization", f"Bearer {api_key}".encode("latin-1"))]
            self.probe_headers["authorization"] = f"Bearer {api_key}"
        self.watch: asyncio.Task[None] | None = None  # its health checks
        self.follower: asyncio.Task[None] | None = None  # following its events
        self.resync: asyncio.Task[None] | None = None  # importing its models again

    def __repr__(self) -> str:
        return f"<Peer {self.node} {self.url} up={self.up}>"

    @property
    def via(self) -> str:
        """What stands for this peer in a via chain: its instance id (its address for a
        llama.cpp router, which has none)."""
        return self.instance or self.url

    def local_id(self, peer_id: str) -> str:
        return f"{self.node}/{peer_id}" if self.prefix else peer_id

    def status_of(self, model_id: str) -> str:
        entry = self.models.get(model_id) or {}
        status = entry.get("status")
        value = status.get("value") if isinstance(status, dict) else status
        return value if isinstance(value, str) else "unloaded"

    def candidate(self, model_id: str) -> Candidate:
        return Candidate(self.node, self.status_of(model_id) == LOADED,
                         self.outstanding.get(model_id, 0), self, self.peer_ids[model_id])

    # ----------------------------------------------------------------- lifetime

    def start(self) -> None:
        self.watch = asyncio.create_task(watch(self), name=f"peer:{self.url}")

    async def close(self) -> None:
        tasks = [t for t in (self.watch, self.follower, self.resync) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.connections.aclose()  # requests in flight finish (see ``mark_down``)
        if self.up:
            self.publish_all_unavailable(f"peer {self.node} was removed")
        self.up = False
        self.missed.forget(self)

    def mark_down(self, reason: str, *, abort: bool = False) -> None:
        """Send the peer nothing new until a probe answers. With ``abort`` (it stopped
        answering at all: frozen, or cut off) its requests in flight and the router's own
        calls to it end now; otherwise they run on: a peer that refuses connections is gone
        (and so are they) or shutting down, finishing them within its grace period."""
        if not self.up:
            return
        self.up = False
        self.reason = reason
        self.missed.forget(self)
        if self.follower is not None:
            self.follower.cancel()
        if abort:
            for cancel in list(self.calls):
                cancel()
            self.connections.abort_all()
        log.warning("peer %s is down: %s", self.node, reason, extra={"event": "peer_down"})
        self.events.publish_payload({"model": "*", "event": "peer_down", "node": self.node,
                                     "data": {"url": self.url, "reason": reason}})
        self.publish_all_unavailable(f"node {self.node} is not answering: {reason}")

    def unreachable(self, reason: str) -> None:
        """A connection to the peer failed: down at once (the probes bring it back)."""
        self.mark_down(reason)

    # ----------------------------------------------------------------- its events

    def publish_status(self, model_id: str) -> None:
        self.events.publish_payload({"model": model_id, "event": "status_change",
                                     "node": self.node,
                                     "data": {"status": self.status_of(model_id)}})

    def publish_all_unavailable(self, message: str) -> None:
        for model_id in self.models:
            self.events.publish_payload({"model": model_id, "event": "status_change",
                                         "node": self.node,
                                         "data": {"status": "unloaded", "unavailable": True,
                                                  "message": message}})
