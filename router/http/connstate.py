"""The lifecycle of one upstream connection, pure: ``ConnState``, the events that change it,
``transition``, and the read-only view the pool and the relay ask (``ConnectionView``).

``upstream._Connection`` holds one ``ConnState`` and changes it only through ``transition``
(its ``_apply``), once per exchange (begin, head, end) or per connection (loss, abort, close),
never per chunk. ``tests/test_connection_state.py`` enumerates every state and event.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..errors import UpstreamError


class BrokenBody(UpstreamError):
    """The child's response ended early, after its headers were already relayed."""


class ConnectionClosed(UpstreamError):
    """The connection closed before a complete response head arrived."""

    def __init__(self, received_any: bool) -> None:
        super().__init__("the model's llama-server closed the connection without a response")
        self.received_any = received_any


class Phase(Enum):
    """Where a connection is in its life (httpcore's NEW/ACTIVE/IDLE/CLOSED, with h11's
    per-exchange states folded in: one exchange at a time, so they are one state here)."""

    IDLE = "idle"  # open (or opening), no exchange yet: the pool may hand it out
    HEAD_DUE = "head due"  # request written, head awaited: bounded, its deadline armed
    BODY = "body"  # head received, body streaming (to ``next_chunk`` or the sink)
    DONE = "done"  # response read to its end: reusable when ``keep_alive``
    CLOSED = "closed"  # closing or closed, by either side; ``error``: why its exchange failed


@dataclass(frozen=True, slots=True)
class ConnState:
    """A connection's lifecycle state: its phase and what the phase carries."""

    phase: Phase
    # HEAD_DUE: the request lets the connection be reused after it (no ``connection: close``,
    # not a HEAD); BODY, DONE: so does the response (keep-alive, framed, not an event stream).
    keep_alive: bool = False
    until_eof: bool = False  # BODY: no length: the body ends where the connection does
    error: UpstreamError | None = None  # CLOSED: why the exchange in progress failed
    given_up: bool = False  # CLOSED by ``abort_all``: the server behind it is gone


# Events: what happens to a connection, once per exchange or connection, never per chunk.

@dataclass(frozen=True, slots=True)
class Begin:
    """The pool handed the connection out for a request (written if the connection is open)."""

    keep_alive: bool = True  # the request allows reuse


@dataclass(frozen=True, slots=True)
class HeadReceived:
    """The final (not 1xx) response head was parsed."""

    keep_alive: bool  # the response allows reuse: keep-alive and not an event stream
    until_eof: bool  # it has no length: its body ends where the connection does


@dataclass(frozen=True, slots=True)
class BodyEnded:
    """The response ended (its last byte, or EOF for a body without a length)."""


@dataclass(frozen=True, slots=True)
class HeadLate:
    """The head deadline fired: the exchange fails with ``error`` (a 504)."""

    error: UpstreamError


@dataclass(frozen=True, slots=True)
class Refused:
    """The upstream sent what the router does not read (a head past its bounds, a 101, a
    malformed response, a head nobody asked for): the exchange in progress fails with
    ``error`` and the connection is aborted."""

    error: UpstreamError


@dataclass(frozen=True, slots=True)
class Aborted:
    """The router closes the connection at once (the client went away, an unread body)."""

    received_any: bool = False  # some of the response head had arrived


@dataclass(frozen=True, slots=True)
class GivenUp:
    """``abort_all``: the server behind it is gone; its exchange is never retried."""

    received_any: bool = False


@dataclass(frozen=True, slots=True)
class Closed:
    """The pool closes the connection gracefully: nothing of an exchange is left unread."""


@dataclass(frozen=True, slots=True)
class Lost:
    """The connection closed (``connection_lost``), by either side."""

    received_any: bool = False


Event = Begin | HeadReceived | BodyEnded | HeadLate | Refused | Aborted | GivenUp | Closed | Lost
EVENT_TYPES: tuple[type[Event], ...] = (Begin, HeadReceived, BodyEnded, HeadLate, Refused,
                                        Aborted, GivenUp, Closed, Lost)


class InvalidTransition(RuntimeError):
    """An event that cannot happen in the connection's state: a bug in the router, never
    something an upstream can cause."""


# Module names for the phases: one global load on the hot path, not an attribute lookup more.
IDLE, HEAD_DUE, BODY, DONE, CLOSED = (Phase.IDLE, Phase.HEAD_DUE, Phase.BODY, Phase.DONE,
                                      Phase.CLOSED)
IDLE_STATE = ConnState(IDLE)
CLOSED_STATE = ConnState(CLOSED)
# The states without an error, made once: a transition allocates only for a failure.
_HEAD_DUE_STATES = (ConnState(HEAD_DUE, keep_alive=False), ConnState(HEAD_DUE, keep_alive=True))
_BODY_STATES = (ConnState(BODY, keep_alive=False), ConnState(BODY, keep_alive=True))
_BODY_UNTIL_EOF = ConnState(BODY, until_eof=True)
_DONE_STATES = (ConnState(DONE, keep_alive=False), ConnState(DONE, keep_alive=True))
BEGIN_REUSABLE, BEGIN_LAST = Begin(keep_alive=True), Begin(keep_alive=False)
BODY_ENDED = BodyEnded()
HEADS = ((HeadReceived(keep_alive=False, until_eof=False),  # [keep_alive][until_eof]
           HeadReceived(keep_alive=False, until_eof=True)),
          (HeadReceived(keep_alive=True, until_eof=False),
           HeadReceived(keep_alive=True, until_eof=True)))
CLOSE = Closed()


def transition(state: ConnState, event: Event) -> ConnState:
    """The state after ``event``; ``InvalidTransition`` for an event that cannot happen in
    ``state``. Pure: it creates the exchange's error where the transition decides it, and
    does nothing else (``_Connection._apply`` carries out what a change means).

    ============ ======================= ==================================================
    from         event                   to
    ============ ======================= ==================================================
    IDLE         Begin                   HEAD_DUE (keep_alive: the request's)
    DONE         Begin                   HEAD_DUE, if keep_alive (else the pool closed it)
    CLOSED       Begin                   CLOSED, the exchange failed at once
                                         (``ConnectionClosed``, nothing received)
    HEAD_DUE     HeadReceived            BODY (keep_alive: both sides' and framed;
                                         until_eof: no length)
    BODY         BodyEnded               DONE (keep_alive kept)
    HEAD_DUE     HeadLate                CLOSED (``UpstreamTimeout``)
    HEAD_DUE     Refused                 CLOSED (its error)
    BODY         Refused                 CLOSED (its error: bad trailers, malformed)
    DONE         Refused                 CLOSED (bytes after the response; it stands)
    CLOSED       Refused                 CLOSED (refused while parsing: first reason)
    HEAD_DUE     Aborted, GivenUp, Lost  CLOSED (``ConnectionClosed(received_any)``)
    BODY         Aborted, GivenUp, Lost  CLOSED (``BrokenBody``)
    IDLE, DONE   Aborted, GivenUp, Lost  CLOSED (no exchange failed)
    CLOSED       Aborted, GivenUp, Lost  CLOSED (its error stands)
    IDLE, DONE   Closed                  CLOSED
    CLOSED       Closed                  CLOSED
    ============ ======================= ==================================================

    ``GivenUp`` also marks the CLOSED state ``given_up``, kept by every later event. Every
    other pair raises: Begin while an exchange runs or on a spent connection, a head or a
    body end outside its phase, a deadline outside HEAD_DUE, bytes refused while IDLE (they
    abort it unread), a graceful close with an exchange unread.
    """
    new = _RULES[type(event)](state, event)
    if new is None:
        raise InvalidTransition(f"connection: {type(event).__name__} cannot happen while "
                                f"{state.phase.value}")
    return new


def _begin(state: ConnState, event: Begin) -> ConnState | None:
    phase = state.phase
    if phase is IDLE or (phase is DONE and state.keep_alive):
        return _HEAD_DUE_STATES[event.keep_alive]
    if phase is CLOSED:  # closed since the pool chose it: fail the exchange, never hang
        return ConnState(CLOSED, error=ConnectionClosed(received_any=False),
                         given_up=state.given_up)
    return None


def _head_received(state: ConnState, event: HeadReceived) -> ConnState | None:
    if state.phase is not HEAD_DUE:
        return None
    if event.until_eof:  # RFC 9112 §6.3: read until the upstream closes; never reuse
        return _BODY_UNTIL_EOF
    return _BODY_STATES[state.keep_alive and event.keep_alive]


def _body_ended(state: ConnState, event: BodyEnded) -> ConnState | None:
    return _DONE_STATES[state.keep_alive] if state.phase is BODY else None


def _head_late(state: ConnState, event: HeadLate) -> ConnState | None:
    return ConnState(CLOSED, error=event.error) if state.phase is HEAD_DUE else None


def _refused(state: ConnState, event: Refused) -> ConnState | None:
    phase = state.phase
    if phase is HEAD_DUE or phase is BODY:
        return ConnState(CLOSED, error=event.error)
    if phase is DONE:  # past the end of its response: that exchange stands
        return CLOSED_STATE
    if phase is CLOSED:  # refused while the parser still ran: the first reason stands
        return state
    return None


def _gone(state: ConnState, event: Aborted | GivenUp | Lost) -> ConnState:
    """Aborted, given up or lost: closed, failing the exchange in progress, if any."""
    phase = state.phase
    given_up = state.given_up or isinstance(event, GivenUp)
    if phase is CLOSED:  # closed already (a loss after an abort, ...): its reason stands
        return state if given_up == state.given_up else \
            ConnState(CLOSED, error=state.error, given_up=True)
    error: UpstreamError | None = None
    if phase is HEAD_DUE:
        error = ConnectionClosed(event.received_any)
    elif phase is BODY:
        error = BrokenBody("the model's llama-server closed the connection mid-response")
    if error is None and not given_up:
        return CLOSED_STATE
    return ConnState(CLOSED, error=error, given_up=given_up)


def _closed(state: ConnState, event: Closed) -> ConnState | None:
    phase = state.phase
    if phase is IDLE or phase is DONE:
        return CLOSED_STATE
    return state if phase is CLOSED else None


_RULES: dict[type, Callable[[ConnState, Any], ConnState | None]] = {
    Begin: _begin, HeadReceived: _head_received, BodyEnded: _body_ended,
    HeadLate: _head_late, Refused: _refused, Aborted: _gone, GivenUp: _gone, Lost: _gone,
    Closed: _closed}


class ConnectionView:
    """What the pool and the relay read of a connection's lifecycle: derived from its one
    state (``_state``), never stored beside it."""

    __slots__ = ()
    _state: ConnState
    _head_bytes: int

    @property
    def state(self) -> ConnState:
        return self._state

    @property
    def closed(self) -> bool:
        return self._state.phase is CLOSED

    @property
    def given_up(self) -> bool:
        """Aborted by ``abort_all``: the server behind it is gone."""
        return self._state.given_up

    @property
    def complete(self) -> bool:
        """Nothing of an exchange is left to read: its response ended (or none began) and
        it did not fail."""
        state = self._state
        return state.error is None and state.phase is not HEAD_DUE and state.phase is not BODY

    @property
    def reusable(self) -> bool:
        """The pool may hand it out for another exchange."""
        state = self._state
        return state.phase is IDLE or (state.phase is DONE and state.keep_alive)

    @property
    def keep_alive(self) -> bool:
        return self._state.keep_alive

    @property
    def until_eof(self) -> bool:
        """The body has no length: it ends where the connection does."""
        return self._state.until_eof

    @property
    def error(self) -> UpstreamError | None:
        return self._state.error

    @property
    def received_any(self) -> bool:
        """Some of this exchange's response arrived (every byte before the head's end is
        counted against its bound)."""
        return self._head_bytes > 0

    @property
    def _in_head(self) -> bool:
        return self._state.phase is HEAD_DUE
