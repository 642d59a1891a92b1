"""The one hop between routers: every call this router makes to a peer goes through here.

A proxied request (``relay``), a resumed stream, a forwarded load or unload, a stream lookup
or stop, a metrics scrape, the peer's ``/props`` and ``/models`` and its ``/models/sse``
(``ask`` and ``stream``) all:

* go over the peer's keep-alive pool (``upstream.ChildConnections``) with the peer key;
* carry ``x-llama-router-via``: the instance ids of the routers the call passed through, this
  router's last. A router never sends a call to a router in its via chain, and one that finds
  itself there serves it itself or refuses it (``AlreadyRelayed``, 409): nothing goes round
  a loop of routers that front each other;
* have deadlines: the pool's connect deadline, and for the router's own calls one for the
  whole answer (``NoAnswer``); a stream's headers must come within its deadline;
* end when the peer is found frozen (its state's ``Frozen``: each call made
  ``peer.calling`` is cancelled, every connection of the pool aborted);
* read bounded answers: at most ``limit`` bytes (``TooLarge``), and event streams through
  ``sse.aiter_events`` (a line or event over 1 MiB ends the stream).

A peer's JSON (its listing, events, ``/props``, admin answers) is parsed in one place,
``read_json``: a number that is not finite (``NaN``, ``Infinity``, ``1e999``: Python's json
takes them, no JSON encoder of this router writes them back) is read as unknown (``null``), so
that one such number never breaks the answers made of it (``/models`` answered 500 for every
client).

Health probes are the one exception: ``GET /health`` on a connection of its own
(``process.ask_health``; children's is ``upstream.probe``, on its own connection too), so that
a pool full of long streams never delays them; ``/health`` is never relayed, so it needs no
via chain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from starlette.types import Receive, Scope, Send

from .. import otel
from ..errors import RouterError, UpstreamError, envelope
from ..http.proxy import direct_body, upstream_headers
from ..http.proxy import relay as relay_response
from ..http.requests import VIA_HEADER, RequestContext
from ..http.upstream import Cancel, UpstreamResponse
from ..teams.members import forwarded

if TYPE_CHECKING:
    from ..http.shutdown import Shutdown
    from .peer import Peer

log = logging.getLogger("router.hop")

MAX_ANSWER_BYTES = 64 << 20  # the most a peer's answer to the router's own call may hold
ADMIN_DEADLINE_S = 60.0  # a load or unload on a peer (an unload waits for its children to stop)


class NoAnswer(UpstreamError):
    """A peer took longer than the deadline of the router's own call to it."""


class TooLarge(UpstreamError):
    """A peer's answer to the router's own call is over the call's limit."""


class AlreadyRelayed(RouterError):
    """The request passed through this router already (its via chain names it), or only
    routers it passed through hold its model: it is never relayed again."""

    status = 409
    type = "invalid_request_error"


def _finite(text: str) -> float | None:
    number = float(text)
    return number if math.isfinite(number) else None


def read_json(raw: bytes | str) -> Any:
    """A peer's JSON document, every number in it that is not finite read as unknown
    (``None``); ValueError when it is not JSON (nested too deep included)."""
    try:
        return json.loads(raw, parse_constant=lambda _: None, parse_float=_finite)
    except RecursionError:
        raise ValueError("JSON nested too deep") from None


def came_through(request: RequestContext | None, instance: str) -> bool:
    """Whether the request passed through the router ``instance`` already
    (``x-llama-router-via``)."""
    return request is not None and instance in request.via


def loop_error(request: RequestContext, node: str, instance: str, what: str
               ) -> AlreadyRelayed:
    """The refusal of a request that came back to this router (``node``, ``instance``), or
    whose model only routers it passed through hold."""
    if came_through(request, instance):
        return AlreadyRelayed(
            f"{what} passed through this router ({node}, instance {instance}) "
            "already (x-llama-router-via names it): a router relays a request at most once, "
            "so that peers which front each other never send it round. A client must not "
            "set x-llama-router-via")
    return AlreadyRelayed(f"{what} is for nodes it passed through already "
                          f"(x-llama-router-via: {', '.join(request.via)[:200]}); it is not "
                          "sent back there")


def via_header(request: RequestContext | None, instance: str) -> tuple[bytes, bytes]:
    """The ``x-llama-router-via`` header a call leaving this router carries: the chain its
    request came with (none for the router's own calls), and this router's instance id."""
    chain = (*request.via, instance) if request is not None else (instance,)
    return VIA_HEADER, ",".join(chain).encode("latin-1")


def passed(peer: Peer, request: RequestContext | None) -> bool:
    """Whether ``request`` passed through ``peer`` already: nothing of it goes back there."""
    return request is not None and peer.via in request.via


def _headers(peer: Peer, request: RequestContext | None,
             extra: Sequence[tuple[bytes, bytes]] = ()) -> list[tuple[bytes, bytes]]:
    """The request's end-to-end headers, the peer key, the via chain, and who the request is
    for as this router decided it (``teams.members.forwarded``): the client's own priority
    and fairness headers never reach the peer."""
    headers = [*extra, *peer.auth, via_header(request, peer.own_instance)]
    if request is not None:
        headers += forwarded(request.member)
    return headers


@contextlib.asynccontextmanager
async def stream(peer: Peer, method: str, target: bytes, *, body: bytes = b"",
                 request: RequestContext | None = None, deadline: float,
                 headers: Sequence[tuple[bytes, bytes]] = ()
                 ) -> AsyncIterator[UpstreamResponse]:
    """A call to ``peer`` whose response headers arrive within ``deadline``; its body is the
    caller's to read (released on leaving). Ends with ``UpstreamError`` when the peer is
    found frozen, ``NoAnswer`` when the headers are late."""
    cancel = Cancel()
    with peer.calling(cancel):
        try:
            try:
                async with asyncio.timeout(deadline):
                    response = await peer.connections.send(
                        method, target, _headers(peer, request, headers), body, cancel=cancel)
            except TimeoutError:
                raise NoAnswer(f"node {peer.node} ({peer.url}) did not answer within "
                               f"{deadline:g} s") from None
            try:
                yield response
            finally:
                response.release()
        except UpstreamError as exc:
            if cancel.cancelled:
                raise UpstreamError(f"node {peer.node} ({peer.url}) stopped answering: "
                                    f"{peer.reason}") from exc
            raise


async def ask(peer: Peer, method: str, target: bytes, body: bytes = b"", *,
              request: RequestContext | None = None, deadline: float,
              limit: int = MAX_ANSWER_BYTES) -> tuple[int, bytes]:
    """The router's own call to ``peer``: its status and whole answer, read within
    ``deadline`` and at most ``limit`` bytes (``TooLarge``: the rest is never read)."""
    try:
        async with asyncio.timeout(deadline):
            async with stream(peer, method, target, body=body, request=request,
                              deadline=deadline,
                              headers=[(b"content-type", b"application/json")] if body
                              else ()) as response:
                parts, size = [], 0
                while (chunk := await response.next_chunk()) is not None:
                    size += len(chunk)
                    if size > limit:
                        response.abort()
                        raise TooLarge(f"node {peer.node} answered {target.decode()} with "
                                       f"more than {limit} bytes")
                    parts.append(chunk)
                return response.status, b"".join(parts)
    except TimeoutError:
        raise NoAnswer(f"node {peer.node} ({peer.url}) did not answer within "
                       f"{deadline:g} s") from None


async def relay(peer: Peer, scope: Scope, request: RequestContext, receive: Receive,
                send: Send, method: str, target: bytes, body: bytes, *,
                shutdown: Shutdown | None, fail_over: frozenset[int] = frozenset(),
                span: Any = None) -> None:
    """A client's request to ``peer``, relayed both ways (``proxy.relay``) with the client's
    end-to-end headers, the peer key and the via chain, and the ``traceparent`` of ``span``
    (the exchange's, OpenTelemetry on: the peer continues the trace) in place of the
    client's; the peer is marked down at once when it cannot be reached."""
    headers = upstream_headers(scope["headers"], request)  # without the client's via header: ours
    if span is not None:
        headers = otel.inject(headers, span)
    try:
        await relay_response(peer.connections, method, target, _headers(peer, request, headers),
                             body, receive=receive, send=send, shutdown=shutdown,
                             fail_over=fail_over, direct=direct_body(scope))
    except UpstreamError as exc:
        if not peer.up:  # found frozen (or gone) while it was in flight: that is why
            raise UpstreamError(f"node {peer.node} ({peer.url}) stopped answering: "
                                f"{peer.reason}") from None
        cause = exc.__cause__
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else exc.message
        peer.unreachable(reason)
        raise UpstreamError(f"node {peer.node} ({peer.url}) failed before answering: "
                            f"{reason}") from None


# --------------------------------------------------------------------- the admin fan-out

async def forward_admin(peer: Peer, path: str, payload: dict[str, Any], model: str,
                        request: RequestContext, deadline: float = ADMIN_DEADLINE_S
                        ) -> tuple[int, dict[str, Any]]:
    """``POST path`` with ``payload`` (its model renamed to the peer's id) to ``peer``
    (``ask``); its status and JSON answer, or a 502 envelope when it cannot be reached or
    does not answer in time."""
    body = {**payload, "model": peer.peer_ids.get(model, model)}
    body.pop("node", None)
    try:
        status, raw = await ask(peer, "POST", path.encode(), json.dumps(body).encode(),
                                request=request, deadline=deadline)
    except UpstreamError as exc:
        if not isinstance(exc, NoAnswer):  # a slow peer is the probes' to judge
            peer.unreachable(exc.message)
        return 502, envelope(502, f"node {peer.node} ({peer.url}) could not be reached: "
                                  f"{exc.message}")
    try:
        answer = read_json(raw)
    except ValueError:
        return 502, envelope(502, f"node {peer.node} answered {status} without JSON")
    return status, answer if isinstance(answer, dict) else {"answer": answer}
