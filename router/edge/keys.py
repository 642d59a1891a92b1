"""API keys at the edge: which role a request needs, whether its key's scope reaches it.

The key files' grammar and ``KeyScope`` are in ``keyfile.py`` (read by ``settings``). Which
paths each role reaches is in ``paths.py`` (``INFER_PATHS`` and the rest), checked by
``needed_role``. ``ApiKeyMiddleware`` finds a presented key's scope by comparing it with every
key in constant time, checks the role of the request and leaves the scope in the request's
context (``requests.RequestContext.key_scope``) for the places that know the model: the proxy
(``route.decide``) and the routes naming a model or listing models. The role and the model
are read from that same context, which the router routes by: the key check and the router
never read a request differently. Keys are never logged.

The keys in force are one ``KeySet`` held by ``Keys``: a reload of the key file
(``reload.py``, the keys read by ``settings.read_api_keys`` as at start) swaps it whole, and
a request reads it once, so it is checked against one set or the other, never a mix. A keyed
request is in flight from its check to its end; when its key is gone from the new set, it is
ended at once as an unload ends a relay (``KeyRemoved``, a 503): with the envelope if nothing
was answered yet, with a last error event if it is an event stream, else cut.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..config.keyfile import (
    ADMIN,
    INFER,
    METRICS,
    UNLIMITED,
    KeyPolicy,
    KeyScope,
    policy_of,
    scope_of,
)
from ..errors import BadRequest, RouterError, Unauthorized, Unavailable, envelope_bytes, send_error
from ..http.paths import (
    ADMIN_PROXIED_PREFIXES,
    ADMIN_PROXIED_WRITES,
    INFER_PATHS,
    LISTING_PATHS,
    METRICS_PATHS,
    OLLAMA_ROUTES,
    PUBLIC_PATHS,
    READ_METHODS,
)
from ..http.requests import RequestContext, context
from ..ollama.answers import error_body
from ..teams.members import PRIORITY_HEADER, MemberError, member_of

if TYPE_CHECKING:
    from ..llama.webui import StaticUI


class Forbidden(RouterError):
    """A valid API key whose scope does not reach the path or the model."""

    status = 403
    type = "permission_error"


class KeyRemoved(Unavailable):
    """A request whose API key was removed from the key file while it ran (``Keys.swap``)."""

    def __init__(self) -> None:
        super().__init__("the API key of this request was removed from the router's key file "
                         "while the request was running")


_HASH_SECRET = secrets.token_bytes(32)  # made at start: key hashes mean nothing elsewhere


def key_hash(key: bytes) -> str:
    """What stands for a key where the router must remember who did something (the owner of
    a resumable stream): an HMAC of it under a secret made at start, never the key, and no
    plain hash that a guessed key could be checked against."""
    return hmac.new(_HASH_SECRET, key, hashlib.sha256).hexdigest()[:32]


# ---------------------------------------------------------------------------- enforcement

def needed_role(request: RequestContext) -> str:
    """The role a request needs (``admin``, ``infer`` or ``metrics``), from the path tables
    and the decoded query the router acts on."""
    path = request.path
    method = request.method
    if request.local:
        if path in METRICS_PATHS:
            return METRICS if method in READ_METHODS else ADMIN
        methods = INFER_PATHS.get(path)
        if methods is None or method not in methods:
            return ADMIN
        if path in LISTING_PATHS and request.params.get("reload"):
            return ADMIN  # GET /models?reload=1 re-reads the configuration
        return INFER
    if path in METRICS_PATHS:  # /metrics?model=: the child's own
        return METRICS if method in READ_METHODS else ADMIN
    if path.startswith(ADMIN_PROXIED_PREFIXES) or (
            path in ADMIN_PROXIED_WRITES and method not in READ_METHODS):
        return ADMIN
    return INFER


def check_path(key_scope: KeyScope, request: RequestContext) -> None:
    """Forbidden unless the key's roles reach this request."""
    role = needed_role(request)
    if role not in key_scope.grants:
        raise Forbidden(f"this API key ({key_scope.describe()}) may not use {request.method} "
                        f"{request.path[:200]}: that needs role={role}")


def _member_refusal(error: MemberError) -> RouterError:
    return Forbidden(str(error)) if error.status == 403 else BadRequest(str(error))


def key_scope_of(scope: Scope) -> KeyScope | None:
    """The scope the API key middleware left for this request; None: full access."""
    return context(scope).key_scope


# ---------------------------------------------------------------------------- the keys

class KeySet:
    """The keys in force as the check reads them, made once from one reading of the keys and
    never changed: the keys (bytes, each once: the first giving of a key stands) and, by the
    same position, each one's hash, scope (None: full access, nothing more to check),
    policy and whether its role is admin. ValueError for a key given twice with different
    scopes."""

    __slots__ = ("admins", "entries", "hashes", "keys", "policies", "scopes")

    def __init__(self, keys: Sequence[str]) -> None:
        entries: dict[bytes, tuple[KeyScope, KeyPolicy]] = {}
        for key in keys:
            if entries.setdefault(key.encode(), (scope_of(key), policy_of(key)))[0] \
                    != scope_of(key):
                raise ValueError("an API key is given twice with different scopes")
        self.entries = entries
        self.keys = list(entries)
        self.hashes = [key_hash(key) for key in self.keys]  # what owns a resumable stream
        self.scopes = [None if scope.full else scope for scope, _ in entries.values()]
        self.policies = [policy for _, policy in entries.values()]
        self.admins = [ADMIN in scope.roles for scope, _ in entries.values()]


@dataclass(frozen=True)
class KeysChanged:
    """What a swap of the keys changed: keys ``added``, ``removed``, ``changed`` (in scope or
    policy), and the requests in flight it ``ended`` (those of the removed keys); never a
    key."""

    added: int
    removed: int
    changed: int
    ended: int

    def describe(self) -> str:
        return (f"{self.added} added, {self.removed} removed, {self.changed} changed; "
                f"{self.ended} requests of removed keys ended")


class Flight:
    """One keyed request in flight: its task, and the ``send`` its response goes through
    (called as it), noting what went out: the response's start (``head``), its end
    (``finished``). ``end`` ends it (its key was removed)."""

    __slots__ = ("_send", "ended", "finished", "head", "task")

    def __init__(self, send: Send, task: asyncio.Task[object] | None) -> None:
        self._send = send
        self.task = task
        self.head: Message | None = None
        self.finished = False
        self.ended = False

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.head = message
        elif kind == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    def end(self) -> None:
        """Cancel the request's task, wherever it is (reading its body, waiting for its model,
        relaying): ``ApiKeyMiddleware`` answers for it (``answer``)."""
        self.ended = True
        if self.task is not None:
            self.task.cancel()

    async def answer(self, error: RouterError, last: bytes) -> None:
        """End the response with ``error`` as an unload ends a relay's (``proxy.relay``): the
        envelope if it has not started; a last error event if it is an event stream (after a
        blank line if ``last``, the last chunk sent, left an event unfinished); else nothing
        more: returning with the body unfinished makes the server close the connection, so
        the client sees it cut."""
        if self.finished:
            return
        if self.head is None:
            await send_error(self._send, error)
            return
        if not _event_stream(self.head):
            return
        event = b"data: " + envelope_bytes(error.status, error.message, error.type) + b"\n\n"
        if last and not last.endswith((b"\n\n", b"\r\r", b"\r\n\r\n")):
            event = b"\n\n" + event
        await self._send({"type": "http.response.body", "body": event, "more_body": True})
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


async def send_ollama_error(send: Send, exc: RouterError) -> None:
    """A refusal in Ollama's shape (``{"error": "..."}``), for Ollama's paths."""
    body = error_body(exc.message)
    await send({"type": "http.response.start", "status": exc.status, "headers": [
        (b"content-type", b"application/json; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in exc.headers.items())]})
    await send({"type": "http.response.body", "body": body})


def _event_stream(head: Message) -> bool:
    return any(name.lower() == b"content-type" and value.lower().startswith(b"text/event-stream")
               for name, value in head.get("headers", ()))


class Keys:
    """The API keys in force (``current``) and the keyed requests in flight, by key hash.

    Contract: ``current`` is replaced whole, never changed (``swap``); a request reads it
    once and enters its flight in the same step (no await between), so a swap either comes
    before its check (a removed key: 401) or finds it in flight (ended)."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self.current = KeySet(keys)
        self._flights: dict[str, set[Flight]] = {}

    def swap(self, keys: Sequence[str]) -> KeysChanged:
        """Put ``keys`` in force (ValueError, nothing changed, for a key given twice with
        different scopes); end the requests in flight of every key no longer among them.
        Changed scopes and policies apply to the requests checked from now on."""
        new = KeySet(keys)
        old, self.current = self.current, new
        removed = [hashed for key, hashed in zip(old.keys, old.hashes, strict=True)
                   if key not in new.entries]
        ended = 0
        for hashed in removed:
            for flight in self._flights.pop(hashed, ()):
                flight.end()
                ended += 1
        changed = sum(1 for key, entry in new.entries.items()
                      if key in old.entries and old.entries[key] != entry)
        return KeysChanged(added=sum(1 for key in new.entries if key not in old.entries),
                           removed=len(removed), changed=changed, ended=ended)

    def enter(self, hashed: str, flight: Flight) -> None:
        self._flights.setdefault(hashed, set()).add(flight)

    def leave(self, hashed: str, flight: Flight) -> None:
        flights = self._flights.get(hashed)
        if flights is not None:
            flights.discard(flight)
            if not flights:
                del self._flights[hashed]

    def in_flight(self) -> int:
        """Keyed requests in flight (for tests and the log)."""
        return sum(len(flights) for flights in self._flights.values())


class ApiKeyMiddleware:
    """Require one of the keys in force (``keys``: a ``Keys``, or the keys themselves, held
    by one of its own) as ``Authorization: Bearer <k>`` or ``X-Api-Key: <k>``.

    Every decision reads the request's context (``requests.RequestContext``), the one the
    router acts on: whether the request is public, the role it needs. A key with a scope
    (``keys.ApiKey``) gets 403 for a request its roles do not reach, and leaves its scope in
    the context for the checks that know the model (``route.resolve_in_scope``); a full-access
    key (a plain string, or an ``ApiKey`` without a scope) costs nothing more than the
    comparison and its flight (``Keys``: what a removal of its key ends)."""

    def __init__(self, app: ASGIApp, keys: Keys | Sequence[str],
                 webui: StaticUI | None = None) -> None:
        self.app = app
        self.keys = keys if isinstance(keys, Keys) else Keys(keys)
        self.webui = webui

    def _public(self, request: RequestContext) -> bool:
        """The health checks, the dashboard's files, and ``/`` and the web UI's files, as
        llama-server's UI files are (not with a model named: the router sends that request
        to the model, as it reads the same ``request.model``). (No OPTIONS comes here:
        ``cors.CorsMiddleware`` answers them all.)"""
        return (request.path in PUBLIC_PATHS
                or (self.webui is not None and request.method in ("GET", "HEAD")
                    and request.model is None and self.webui.is_public(request.path)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = context(scope)
        keys = self.keys.current  # read once: one set decides (``Keys``)
        if not keys.keys:
            if PRIORITY_HEADER in request.headers:
                try:  # without keys, a request may still ask for a lower class
                    request.member = member_of(UNLIMITED, False, request.headers)
                except MemberError as exc:
                    await send_error(send, _member_refusal(exc))
                    return
            await self.app(scope, receive, send)
            return
        if self._public(request):
            await self.app(scope, receive, send)
            return
        found = _matched(keys, request.credential())
        refuse = send_error if request.path not in OLLAMA_ROUTES else send_ollama_error
        if not found:
            await refuse(send, Unauthorized())
            return
        refusal = _admit(keys, found - 1, request)
        if refusal is not None:
            await refuse(send, refusal)
            return
        await self._in_flight(keys.hashes[found - 1], scope, receive, send)

    async def _in_flight(self, hashed: str, scope: Scope, receive: Receive, send: Send) -> None:
        """The request of the key with hash ``hashed``, in flight until it ends: ended with
        ``KeyRemoved`` if its key is removed meanwhile (``Keys.swap``)."""
        flight = Flight(send, asyncio.current_task())
        self.keys.enter(hashed, flight)
        try:
            await self.app(scope, receive, flight)
        except asyncio.CancelledError:
            # Ours alone (a removal), unless the task was also cancelled otherwise (the
            # server's shutdown backstop): then it goes on up.
            if not flight.ended or flight.task is None or flight.task.uncancel():
                raise
            await flight.answer(KeyRemoved(), context(scope).sent_last)
        finally:
            self.keys.leave(hashed, flight)


def _matched(keys: KeySet, presented: bytes) -> int:
    """The 1-based position of ``presented`` among the keys, 0 for none. Compared against
    every key so timing does not reveal which one matched (the keys are distinct: at most one
    matches)."""
    found = 0
    for position, key in enumerate(keys.keys, start=1):
        found |= position * hmac.compare_digest(presented, key)
    return found


def _admit(keys: KeySet, index: int, request: RequestContext) -> RouterError | None:
    """Who the request of the key at ``index`` is for, and its scope, left in its context;
    the refusal if its headers ask too much or its roles do not reach it."""
    request.key_hash = keys.hashes[index]
    try:
        request.member = member_of(keys.policies[index], keys.admins[index], request.headers)
    except MemberError as exc:
        return _member_refusal(exc)
    key_scope = keys.scopes[index]
    if key_scope is not None:
        try:
            check_path(key_scope, request)
        except Forbidden as exc:
            return exc
        request.key_scope = key_scope
    return None
