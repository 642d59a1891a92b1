"""Peer routers: other llama-routers (or llama.cpp routers) whose models this router serves.

``--peer URL`` and ``--peer-dns NAME:PORT`` (every address of NAME, resolved every
``--peer-dns-interval`` s: a Kubernetes headless Service) name the routers this one fronts.
For each of them a ``Peer``:

* imports its models from its ``GET /models`` (ids unchanged; ``NODE/ID`` with
  ``--peer-prefix``) and keeps their states live by following its ``/models/sse``; each of its
  events is relayed on this router's ``/models/sse`` with ``"node"`` added;
* is probed with ``GET /health`` every ``--liveness-interval`` s (``--liveness-timeout``).
  After ``--liveness-misses`` failures in a row, or at once when a connection to it is refused,
  it is *down*: its models are unavailable (an event says so for each) and nothing new is sent
  to it until a probe answers again; then its models are imported again. Requests in flight
  to it end at once (a 502 envelope, or a stream's error event) only if it stopped answering
  altogether (probes timed out: frozen, or cut off): one that refuses connections is either
  gone, and its connections with it, or shutting down and finishing them in its grace period;
  a peer that leaves ``--peer-dns`` finishes them too;
* carries requests over a keep-alive pool (``upstream.ChildConnections``), with the peer key
  (``--peer-api-key-file``) as a bearer token; the client's own credentials stay behind.

A model that several nodes list (peers, or this router and peers) is one model with replicas
across machines. ``rank`` orders the nodes for a request: those where it is loaded first, then
the fewest requests outstanding from this router, this router before a peer on a tie. The
request goes to the first; if a peer cannot be reached, or answers 502, 503 or 504 before
anything was sent to the client, it goes to the next (``forward``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from .affinity import Decision, PrefixTable, choose
from .events import EventBus
from .keys import parse_file as parse_key_file
from .process import ask_health, no_answer
from .upstream import ChildConnections

log = logging.getLogger("router.peers")

PEER_MAX_CONNECTIONS = 256  # to one peer; it queues what it cannot serve at once
FAIL_OVER_STATUSES = frozenset({502, 503, 504})
# Requests a node is taken to serve at once for prefix routing across nodes (llama-server's
# default parallel slots): the router does not know a peer's.
NODE_SLOTS = 4
_EMPTY = PrefixTable(0)
LOADED, LOADING = "loaded", "loading"
ADMIN_DEADLINE_S = 60.0  # a load or unload on a peer (an unload waits for its children to stop)
MAX_ANSWER_BYTES = 64 << 20  # the most a peer's answer to the router itself may hold


def new_instance_id() -> str:
    """This router's instance id: random, made at start. It decides "is this peer myself"
    and makes up the via chain; the node name is only a label."""
    return secrets.token_hex(8)


class PeerError(ValueError):
    """A peer setting that cannot work (named in the message)."""


def read_peer_key(path: Path | None) -> str | None:
    """The key sent to peers: the first key of ``path``, a key file read as
    ``--api-key-file`` is (``keys.parse_file``: comments, and a scope after the key, which
    the peer decides on), so one file can serve both."""
    if path is None:
        return None
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PeerError(f"--peer-api-key-file {path}: {getattr(exc, 'strerror', None) or exc}"
                        ) from None
    try:
        keys = parse_key_file(text)
    except ValueError as exc:
        raise PeerError(f"--peer-api-key-file {path}, {exc}") from None
    if not keys:
        raise PeerError(f"--peer-api-key-file {path} holds no key")
    return str(keys[0])


def peer_url(text: str) -> str:
    """``http://host:port`` (the port defaults to 80); a PeerError for anything else."""
    parts = urlsplit(text.strip())
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") \
            or parts.query:
        raise PeerError(f"--peer {text!r}: expected http://host:port")
    try:
        port = parts.port or 80
    except ValueError:
        raise PeerError(f"--peer {text!r}: bad port") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{host}:{port}"


def dns_target(text: str) -> tuple[str, int]:
    """``NAME:PORT`` of ``--peer-dns``."""
    name, _, port = text.strip().rpartition(":")
    if not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise PeerError(f"--peer-dns {text!r}: expected NAME:PORT, e.g. "
                        "llama-router-node.default.svc.cluster.local:8080")
    return name, int(port)


@dataclass(frozen=True)
class Candidate:
    """A node that can serve a request's model; ``peer`` None is this router."""

    node: str
    loaded: bool
    outstanding: int
    peer: Peer | None = None
    peer_model: str | None = None  # the peer's own id for the model


def rank(candidates: Iterable[Candidate]) -> list[Candidate]:
    """The order to try nodes in: loaded first (no cold load), then the fewest requests
    outstanding, then this router before a peer (no network hop)."""
    return sorted(candidates, key=lambda c: (not c.loaded, c.outstanding, c.peer is not None))


def by_prefix(order: list[Candidate], tables: dict[str, PrefixTable], keys: Sequence[int]
              ) -> tuple[list[Candidate], Decision | None]:
    """``order`` with the node that holds the longest prefix of the prompt (``keys``) first,
    among the nodes where the model is loaded (``affinity.choose``, each node taken to serve
    ``NODE_SLOTS`` requests at once: a holder with that many outstanding yields to a node with
    fewer), and the decision; unchanged (None) when fewer than two such nodes or no keys."""
    loaded = [c for c in order if c.loaded]
    if len(loaded) < 2 or not keys:
        return order, None
    index, decision = choose([(c.outstanding, NODE_SLOTS) for c in loaded],
                             [tables.get(c.node) or _EMPTY for c in loaded], keys)
    chosen = loaded[index]
    return [chosen, *(c for c in order if c is not chosen)], decision


class Peer:
    """One peer router at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, *, client: httpx.AsyncClient, events: EventBus,
                 own_node: str, own_instance: str = "", api_key: str | None = None,
                 prefix: bool = False, interval: float = 2.0, timeout: float = 3.0,
                 misses: int = 3, label: Callable[[Peer, str], str] | None = None) -> None:
        parts = urlsplit(url)
        assert parts.hostname is not None
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        self.node = f"{parts.hostname}:{self.port}"  # its label: until its /props names it
        self.name = ""  # the node name its /props gives (a label may add its address)
        self.instance = ""  # its instance id, from its /props (a llama.cpp router: none)
        self.client = client
        self.events = events
        self.own_node = own_node
        self.own_instance = own_instance or new_instance_id()
        self._label = label
        self.prefix = prefix
        self.interval = max(interval, 0.2)
        self.timeout = timeout
        self.misses = misses
        self.up = False
        self.is_self = False  # its /props gives this router's instance id: never used
        self.reason = "not reached yet"
        # This router's id of each model the peer lists -> the peer's entry (node set).
        self.models: dict[str, dict[str, Any]] = {}
        self.peer_ids: dict[str, str] = {}  # this router's id -> the peer's id
        self.outstanding: dict[str, int] = {}  # requests in flight to it, by model id
        self.connections = ChildConnections(self.host, self.port, PEER_MAX_CONNECTIONS)
        # The router's own calls to it in progress (``nodes.ask_peer``): each ends when it is
        # found frozen, even one the pool would retry on a fresh connection.
        self.calls: set[Callable[[], None]] = set()
        self.auth: list[tuple[bytes, bytes]] = []
        # With the probes and the router's own requests to it (never logged).
        self.probe_headers = {"connection": "close"}
        if api_key:
            self.auth = [(b"authorization", f"Bearer {api_key}".encode("latin-1"))]
            self.probe_headers["authorization"] = f"Bearer {api_key}"
        self._missed = 0
        self._watch: asyncio.Task[None] | None = None
        self._follower: asyncio.Task[None] | None = None
        self._resync: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<Peer {self.node} {self.url} up={self.up}>"

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
        self._watch = asyncio.create_task(self._run(), name=f"peer:{self.url}")

    async def close(self) -> None:
        for task in (self._watch, self._follower, self._resync):
            if task is not None:
                task.cancel()
        for task in (self._watch, self._follower, self._resync):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        await self.connections.aclose()  # requests in flight finish (see ``mark_down``)
        if self.up:
            self._publish_all_unavailable(f"peer {self.node} was removed")
        self.up = False

    async def _run(self) -> None:
        """Check the peer every ``interval`` s for as long as it is configured; a check that
        fails in an unforeseen way is logged and the next one runs as usual."""
        while True:
            try:
                await self._check()
            except Exception as exc:  # never leave a peer unwatched
                log.exception("peer %s: check failed", self.url, exc_info=exc)
            await asyncio.sleep(self.interval)

    async def _check(self) -> None:
        problem, silent = await self._probe()
        if problem is None:
            self._missed = 0
            if not self.up:
                await self._come_up()
            elif self._follower is None or self._follower.done():
                self._follow()
        else:
            self._missed += 1
            if self.up and self._missed >= self.misses:
                self.mark_down(f"missed {self._missed} health checks ({problem})",
                               abort=silent)
            elif not self.up:
                self.reason = problem

    async def _probe(self) -> tuple[str | None, bool]:
        """None if ``GET /health`` answered 200 within the timeout, else what went wrong;
        and whether the peer was silent (a timeout: frozen, or the network is cut)."""
        status, problem = await ask_health(self.client, f"{self.url}/health", self.timeout,
                                           self.probe_headers)
        if problem is not None:
            return problem, problem == no_answer(self.timeout)
        if status != 200:
            return f"/health answered {status}", False
        return (self.reason if self.is_self else None), False

    @property
    def via(self) -> str:
        """What stands for this peer in a via chain: its instance id (its address for a
        llama.cpp router, which has none)."""
        return self.instance or self.url

    async def _learn_node(self) -> None:
        """The peer's instance id and node name, from its ``/props`` (a llama.cpp router has
        neither: its address stays its name). The instance id decides whether it is this
        router; the name is a label, made distinct (``NAME@host:port``) when another node
        has it too."""
        with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError, TypeError):
            response = await self.client.get(f"{self.url}/props", timeout=self.timeout,
                                             headers=self.probe_headers)
            info = response.json().get("llama_router", {})
            node, instance = info.get("node"), info.get("instance")
            if isinstance(instance, str) and instance:
                self.instance = instance
            if isinstance(node, str) and node:
                self.name = node
        if self.instance and self.instance == self.own_instance:
            if not self.is_self:  # --peer-dns (or --peer) found this router itself
                log.warning("peer %s is this router (instance %s); not used", self.url,
                            self.instance, extra={"event": "peer_is_self"})
            self.is_self = True
            self.reason = f"it is this router (instance {self.instance})"
            return
        if self.name:
            self.node = self._label(self, self.name) if self._label is not None else self.name

    async def _come_up(self) -> None:
        try:
            await self._learn_node()
            if self.is_self:
                return
            await self._import_models()
        except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:
            self.reason = f"GET /models failed: {exc or type(exc).__name__}"
            return
        self.up = True
        self.reason = ""
        log.info("peer %s is up at %s with %d models", self.node, self.url, len(self.models),
                 extra={"event": "peer_up"})
        self.events.publish_payload({"model": "*", "event": "peer_up", "node": self.node,
                                     "data": {"url": self.url, "models": sorted(self.models)}})
        for model_id in self.models:
            self._publish_status(model_id)
        self._follow()

    def mark_down(self, reason: str, *, abort: bool = False) -> None:
        """Send the peer nothing new until a probe answers. With ``abort`` (it stopped
        answering at all: frozen, or cut off) its requests in flight end now; otherwise they
        run on: a peer that refuses connections is gone (and so are they) or shutting down,
        finishing them within its grace period."""
        if not self.up:
            return
        self.up = False
        self.reason = reason
        self._missed = 0
        if self._follower is not None:
            self._follower.cancel()
        if abort:
            for cancel in list(self.calls):
                cancel()
            self.connections.abort_all()
        log.warning("peer %s is down: %s", self.node, reason, extra={"event": "peer_down"})
        self.events.publish_payload({"model": "*", "event": "peer_down", "node": self.node,
                                     "data": {"url": self.url, "reason": reason}})
        self._publish_all_unavailable(f"node {self.node} is not answering: {reason}")

    def unreachable(self, reason: str) -> None:
        """A connection to the peer failed: down at once (the probes bring it back)."""
        self.mark_down(reason)

    # ----------------------------------------------------------------- models

    async def _import_models(self) -> None:
        response = await self.client.get(f"{self.url}/models", timeout=self.timeout * 2,
                                         headers=self.probe_headers)
        response.raise_for_status()
        data = response.json().get("data")
        if not isinstance(data, list):
            raise ValueError("no data list")
        models: dict[str, dict[str, Any]] = {}
        ids: dict[str, str] = {}
        for entry in data:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                continue
            peer_id = entry["id"]
            local = self.local_id(peer_id)
            entry = _foreign(copy.deepcopy(entry), self.own_instance)
            if entry is None:
                continue  # this router's own model, listed back by a peer that fronts it
            entry.setdefault("node", self.node)
            entry["id"] = local
            models[local] = entry
            ids[local] = peer_id
        gone = self.models.keys() - models.keys()
        self.models, self.peer_ids = models, ids
        for model_id in gone:
            self.events.publish_payload({"model": model_id, "event": "status_change",
                                         "node": self.node,
                                         "data": {"status": "unloaded", "removed": True}})

    def _follow(self) -> None:
        self._follower = asyncio.create_task(self._follow_quietly(), name=f"peer-sse:{self.url}")

    async def _follow_quietly(self) -> None:
        try:
            await self._follow_events()
        except Exception as exc:  # the next check follows again
            log.warning("peer %s: events stopped: %r", self.node, exc)

    async def _follow_events(self) -> None:
        """Follow the peer's ``/models/sse`` until it ends (the next probe follows again)."""
        timeout = httpx.Timeout(None, connect=self.timeout)
        headers = {k: v for k, v in self.probe_headers.items() if k != "connection"}
        with contextlib.suppress(httpx.HTTPError):
            async with self.client.stream("GET", f"{self.url}/models/sse", timeout=timeout,
                                          headers=headers) as response:
                if response.status_code != 200:
                    return
                # Subscribed: import again, so that nothing between the first import and
                # the subscription is missed.
                with contextlib.suppress(httpx.HTTPError, ValueError, TypeError,
                                         AttributeError):
                    await self._import_models()
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        with contextlib.suppress(ValueError):
                            self._apply(json.loads(line[5:]))

    def _apply(self, event: Any) -> None:
        """One of the peer's events: update the model table and relay it, with its node and
        the via chain (``"via"``: the instance ids it came through). An event that came
        through this router already (routers that front each other) is dropped."""
        if not isinstance(event, dict) or not isinstance(event.get("model"), str):
            return
        via = event.get("via")
        via = [v for v in via if isinstance(v, str)] if isinstance(via, list) else []
        if self.own_instance in via:
            return
        peer_id = event["model"]
        if peer_id == "*":
            if event.get("event") == "events_dropped":
                self._import_soon()
            return
        model_id = self.local_id(peer_id)
        data: dict[str, Any] = event["data"] if isinstance(event.get("data"), dict) else {}
        entry = self.models.get(model_id)
        if entry is None:
            self._import_soon()  # a model the peer did not list before
        elif isinstance(data.get("status"), str):
            status = entry.get("status")
            if isinstance(status, dict):
                status["value"] = data["status"]
            else:
                entry["status"] = {"value": data["status"]}
        self.events.publish_payload({**event, "model": model_id,
                                     "node": event.get("node", self.node),
                                     "via": [*via, self.via]})

    def _import_soon(self) -> None:
        if self._resync is None or self._resync.done():
            self._resync = asyncio.create_task(self._import_quietly())

    async def _import_quietly(self) -> None:
        with contextlib.suppress(httpx.HTTPError, ValueError, TypeError, AttributeError):
            await self._import_models()

    def _publish_status(self, model_id: str) -> None:
        self.events.publish_payload({"model": model_id, "event": "status_change",
                                     "node": self.node,
                                     "data": {"status": self.status_of(model_id)}})

    def _publish_all_unavailable(self, message: str) -> None:
        for model_id in self.models:
            self.events.publish_payload({"model": model_id, "event": "status_change",
                                         "node": self.node,
                                         "data": {"status": "unloaded", "unavailable": True,
                                                  "message": message}})


class Peers:
    """Every peer: the static ``--peer`` ones and those ``--peer-dns`` finds."""

    def __init__(self, *, client: httpx.AsyncClient, events: EventBus, own_node: str,
                 static: Iterable[str] = (), dns: Iterable[str] = (),
                 dns_interval: float = 10.0, api_key: str | None = None, prefix: bool = False,
                 interval: float = 2.0, timeout: float = 3.0, misses: int = 3,
                 instance: str | None = None) -> None:
        self.client = client
        self.events = events
        self.node = own_node  # this router's label
        self.instance = instance or new_instance_id()  # this router's identity
        self.static = [peer_url(url) for url in static]
        self.dns = [dns_target(spec) for spec in dns]
        self.dns_interval = dns_interval
        self._options = {"api_key": api_key, "prefix": prefix, "interval": interval,
                         "timeout": timeout, "misses": misses}
        self.peers: dict[str, Peer] = {}  # by url
        # model -> node -> the prompt prefixes sent there lately (``by_prefix``)
        self.prefixes: dict[str, dict[str, PrefixTable]] = {}
        self._sources: dict[str, set[str]] = {}  # url -> the sources naming it
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def configured(self) -> bool:
        return bool(self.static or self.dns)

    def start(self) -> None:
        if self.static:
            self.sync("--peer", self.static)
        for name, port in self.dns:
            task = asyncio.create_task(self._discover(name, port), name=f"peer-dns:{name}")
            self._tasks.add(task)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(peer.close() for peer in self.peers.values()))
        self.peers.clear()

    def sync(self, source: str, urls: Iterable[str]) -> None:
        """Make ``urls`` the peers ``source`` names: new ones start, dropped ones stop (unless
        another source still names them)."""
        wanted = set(urls)
        for url in wanted - {u for u, s in self._sources.items() if source in s}:
            self._sources.setdefault(url, set()).add(source)
            if url not in self.peers:
                peer = Peer(url, client=self.client, events=self.events, own_node=self.node,
                            own_instance=self.instance, label=self._label,
                            **self._options)  # type: ignore[arg-type]
                self.peers[url] = peer
                log.info("peer %s added (%s)", url, source, extra={"event": "peer_added"})
                peer.start()
        for url, sources in list(self._sources.items()):
            if source in sources and url not in wanted:
                sources.discard(source)
                if not sources:
                    del self._sources[url]
                    peer = self.peers.pop(url)
                    for tables in self.prefixes.values():
                        tables.pop(peer.node, None)
                    log.info("peer %s removed (%s)", url, source,
                             extra={"event": "peer_removed"})
                    task = asyncio.create_task(peer.close())
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)

    async def _discover(self, name: str, port: int) -> None:
        source = f"--peer-dns {name}:{port}"
        loop = asyncio.get_running_loop()
        said = ""  # the last problem logged, so that each is logged once in a row
        while True:
            try:
                infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
            except (socket.gaierror, UnicodeError, OSError) as exc:
                if not isinstance(exc, socket.gaierror):  # a resolver failure of another kind
                    exc = socket.gaierror(socket.EAI_FAIL, str(exc))
                gone = exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", None))
                problem = f"{source}: {exc.strerror or exc}" + (
                    ": no peers until it has addresses" if gone
                    else ": keeping the peers found before")
                if problem != said:
                    log.warning("%s", problem, extra={"event": "peer_dns_failed"})
                    said = problem
                if gone:
                    self.sync(source, ())  # the name has no addresses now: no peers
            else:
                said = ""
                urls = set()
                for family, _, _, _, address in infos:
                    host = address[0]
                    urls.add(f"http://[{host}]:{port}" if family == socket.AF_INET6
                             else f"http://{host}:{port}")
                self.sync(source, urls)
            await asyncio.sleep(self.dns_interval)

    def _label(self, peer: Peer, name: str) -> str:
        """The label of ``peer``, whose node name is ``name``: the name, or ``NAME@host:port``
        when this router or another peer has that name too (two routers on one machine
        both default to its host name): never two nodes with one label."""
        taken = {self.node} | {p.node for p in self.peers.values() if p is not peer
                               and not p.is_self}
        if name not in taken:
            return name
        label = f"{name}@{peer.host}:{peer.port}"
        if peer.node != label:
            log.warning("peer %s has the node name %r of another node; labelled %r "
                        "(set --node-name on each router)", peer.url, name, label,
                        extra={"event": "peer_name_taken"})
        return label

    # ----------------------------------------------------------------- lookups

    def holders(self, model_id: str, passed: tuple[str, ...] = ()) -> list[Peer]:
        """The peers that are up and list ``model_id``, except those a request passed
        through already (``passed``: its via chain)."""
        return [p for p in self.peers.values() if p.up and model_id in p.models
                and p.via not in passed]

    def listing(self) -> dict[str, list[Peer]]:
        """Every model id any peer lists (up or not) -> those peers."""
        found: dict[str, list[Peer]] = {}
        for peer in sorted(self.peers.values(), key=lambda p: p.node):
            if peer.is_self:
                continue
            for model_id in peer.models:
                found.setdefault(model_id, []).append(peer)
        return found

    def describe(self) -> list[dict[str, Any]]:
        """The peers for ``/props`` and the dashboard (one that is this router too, with
        ``"self": true`` and the reason it is not used)."""
        return [{"url": p.url, "node": p.node, "instance": p.instance, "up": p.up,
                 "models": len(p.models),
                 **({"self": True} if p.is_self else {}),
                 **({"reason": p.reason} if not p.up and p.reason else {})}
                for p in self.peers.values()]

    def skipped(self) -> list[dict[str, str]]:
        """The peers that are this router itself, with the reason (``/models``)."""
        return [{"url": p.url, "reason": p.reason} for p in self.peers.values() if p.is_self]


def _foreign(entry: dict[str, Any], own_instance: str) -> dict[str, Any] | None:
    """A peer's ``/models`` entry without this router's own node (a peer that fronts this
    router lists its models back); None when nothing else is left. The status is then the
    best of the nodes left."""
    nodes = entry.get("nodes")
    if isinstance(nodes, list):
        kept = [n for n in nodes if not (isinstance(n, dict)
                                          and n.get("instance") == own_instance)]
        if not kept:
            return None
        if len(kept) < len(nodes):
            entry["nodes"] = kept
            values = [n.get("status") for n in kept
                      if isinstance(n, dict) and not n.get("unavailable")]
            status = entry.get("status")
            if isinstance(status, dict):
                status["value"] = LOADED if LOADED in values else LOADING if LOADING in values \
                    else next((v for v in values if isinstance(v, str)), "unloaded")
        return entry
    return None if entry.get("instance") == own_instance else entry


def merge_entries(model_id: str, peers: list[Peer], local: dict[str, Any] | None,
                  own_node: str, own_instance: str = "") -> dict[str, Any]:
    """The one ``/models`` entry for a model that ``peers`` (and maybe this router, whose
    entry is ``local``) list: the local entry or the first available peer's, with ``node``
    (where it is) or ``nodes`` (each node and its status) and the best status of all."""
    nodes: list[dict[str, Any]] = []
    if local is not None:
        nodes.append({"node": own_node, "instance": own_instance,
                      "status": local["status"]["value"]})
    for peer in peers:
        nodes.append({"node": peer.node, "instance": peer.instance,
                      "status": peer.status_of(model_id),
                      **({} if peer.up else {"unavailable": True, "message": peer.reason})})
    available = [n for n in nodes if not n.get("unavailable")]
    if local is not None:
        entry = copy.deepcopy(local)
    else:
        source = next((p for p in peers if p.up), peers[0])
        entry = copy.deepcopy(source.models[model_id])
        entry["id"] = model_id
    status: dict[str, Any] = entry["status"] if isinstance(entry.get("status"), dict) else {}
    entry["status"] = status
    if not available:
        status.update(value="unloaded", unavailable=True,
                      message="; ".join(f"node {n['node']}: {n.get('message')}" for n in nodes))
    else:
        values = [n["status"] for n in available]
        status["value"] = LOADED if LOADED in values else \
            LOADING if LOADING in values else values[0]
    if len(nodes) == 1:
        entry["node"] = nodes[0]["node"]
        entry["instance"] = nodes[0]["instance"]
    else:
        entry.pop("node", None)
        entry.pop("instance", None)
        entry["nodes"] = nodes
    return entry


def default_node_name() -> str:
    return socket.gethostname() or f"router-{int(time.time())}"
