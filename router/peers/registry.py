"""Peer routers: other llama-routers (or llama.cpp routers) whose models this router serves.

``--peer URL`` and ``--peer-dns NAME:PORT`` (every address of NAME, resolved every
``--peer-dns-interval`` s: a Kubernetes headless Service) name the routers this one fronts;
``Peers`` keeps one ``peer.Peer`` for each, gives each a distinct label, and answers which
peers hold a model. The rest lives with its concept:

* ``peer``: one peer: its state (one value, a pure transition, one writer: ``Peer.apply``),
  its pool and its tasks;
* ``peerhealth``: its health checks, which bring it up and mark it down;
* ``catalogue``: its models (a bounded listing, kept live by its events) and the one
  ``/models`` entry of a model across nodes;
* ``placement``: which node serves a request (pure);
* ``hop``: every call to a peer (the via chain, deadlines, cancellation, bounded reads);
* ``nodes``: a request served across nodes, with fail-over.

Peers are trusted: a model that several nodes list is one model with replicas across
machines (``--peer-prefix`` keeps them apart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from ..config.keyfile import parse_file as parse_key_file
from ..config.settings import DEFAULT_UPSTREAM_TIMEOUT_S
from ..events import EventBus
from ..serving.affinity import PrefixTable
from .catalogue import REFUSED
from .peer import Peer, new_instance_id
from .tasks import perform

log = logging.getLogger("router.peers")


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


class Peers:
    """Every peer: the static ``--peer`` ones and those ``--peer-dns`` finds."""

    def __init__(self, *, client: httpx.AsyncClient, events: EventBus, own_node: str,
                 static: Iterable[str] = (), dns: Iterable[str] = (),
                 dns_interval: float = 10.0, api_key: str | None = None, prefix: bool = False,
                 interval: float = 2.0, timeout: float = 3.0, misses: int = 3,
                 instance: str | None = None,
                 head_timeout: float = DEFAULT_UPSTREAM_TIMEOUT_S) -> None:
        self.client = client
        self.events = events
        self.node = own_node  # this router's label
        self.instance = instance or new_instance_id()  # this router's identity
        self.static = [peer_url(url) for url in static]
        self.dns = [dns_target(spec) for spec in dns]
        self.dns_interval = dns_interval
        self._options = {"api_key": api_key, "prefix": prefix, "interval": interval,
                         "timeout": timeout, "misses": misses, "head_timeout": head_timeout}
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
                peer = Peer(url, client=self.client, events=self.events, work=perform,
                            own_node=self.node,
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
        return [p for p in self.peers.values() if p.serves(model_id) and p.via not in passed]

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
        ``"self": true`` and the reason it is not used; one whose event stream was given
        up, with ``"events"``: why)."""
        return [{"url": p.url, "node": p.node, "instance": p.instance, "up": p.up,
                 "models": len(p.models),
                 **({"self": True} if p.is_self else {}),
                 **({"reason": p.reason} if not p.up and p.reason else {}),
                 **({"events": p.events_problem} if p.events_problem else {})}
                for p in self.peers.values()]

    def skipped(self) -> list[dict[str, str]]:
        """The peers not used, with the reason (``/models``): those that are this router,
        and those whose listing was refused (``catalogue.ListingRefused``)."""
        return [{"url": p.url, "reason": p.reason} for p in self.peers.values()
                if p.is_self or (not p.up and p.reason.startswith(REFUSED))]


def default_node_name() -> str:
    return socket.gethostname() or f"router-{int(time.time())}"
