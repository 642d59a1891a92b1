"""An upstream connection's lifecycle (``router/http/upstream.py``): every state x event of the pure
transition, a pool of real connections driven through exchanges whose responses arrive in any
splits, die mid-head or mid-body, miss their deadline or are aborted (Hypothesis, stateful,
on virtual time), and the one-writer rule checked on the router's source."""

from __future__ import annotations

import ast
import asyncio
import inspect
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from simloop import VirtualTimeLoop

from router.errors import Unavailable, UpstreamError
from router.http import upstream
from router.http.connstate import (
    CLOSED_STATE,
    EVENT_TYPES,
    IDLE_STATE,
    Aborted,
    Begin,
    BodyEnded,
    BrokenBody,
    Closed,
    ConnectionClosed,
    ConnState,
    Event,
    GivenUp,
    HeadLate,
    HeadReceived,
    InvalidTransition,
    Lost,
    Phase,
    Refused,
    transition,
)
from router.http.upstream import (
    MAX_RESPONSE_HEAD_BYTES,
    MAX_RESPONSE_HEADERS,
    READ_HIGH_WATER,
    Cancel,
    ChildConnections,
    UpstreamTimeout,
)

# ----------------------------------------------------------------------------- the table

FAILED = UpstreamError("the upstream sent something the router refused")
STATES: dict[str, ConnState] = {
    "idle": IDLE_STATE,
    "head due": ConnState(Phase.HEAD_DUE, keep_alive=True),
    "head due, last": ConnState(Phase.HEAD_DUE),
    "body": ConnState(Phase.BODY, keep_alive=True),
    "body, last": ConnState(Phase.BODY),
    "body until eof": ConnState(Phase.BODY, until_eof=True),
    "done": ConnState(Phase.DONE, keep_alive=True),
    "done, spent": ConnState(Phase.DONE),
    "closed": CLOSED_STATE,
    "closed, failed": ConnState(Phase.CLOSED, error=FAILED),
    "closed, given up": ConnState(Phase.CLOSED, given_up=True),
}
HEAD = ("head due", "head due, last")
BODY = ("body", "body, last", "body until eof")
DONE = ("done", "done, spent")
CLOSED = ("closed", "closed, failed", "closed, given up")

# One instance of each event type, for the state x event enumeration.
SAMPLES: dict[type, Event] = {
    Begin: Begin(), HeadReceived: HeadReceived(keep_alive=True, until_eof=False),
    BodyEnded: BodyEnded(), HeadLate: HeadLate(UpstreamTimeout("no head within 5 s")),
    Refused: Refused(UpstreamError("a head over 65536 bytes")), Aborted: Aborted(),
    GivenUp: GivenUp(), Closed: Closed(), Lost: Lost(),
}

H, B, D, C = Phase.HEAD_DUE, Phase.BODY, Phase.DONE, Phase.CLOSED
# state x event -> the phase after it; every pair not here is rejected (``InvalidTransition``).
EXPECTED: dict[tuple[str, type], Phase] = {
    ("idle", Begin): H, ("done", Begin): H, **{(s, Begin): C for s in CLOSED},
    **{(s, HeadReceived): B for s in HEAD},
    **{(s, BodyEnded): D for s in BODY},
    **{(s, HeadLate): C for s in HEAD},
    **{(s, Refused): C for s in HEAD + BODY + DONE + CLOSED},
    **{(s, kind): C for s in STATES for kind in (Aborted, GivenUp, Lost)},
    **{(s, Closed): C for s in ("idle", *DONE, *CLOSED)},
}


def test_every_event_type_and_phase_has_a_sample() -> None:
    assert set(SAMPLES) == set(EVENT_TYPES)
    assert {state.phase for state in STATES.values()} == set(Phase)


@pytest.mark.parametrize(("label", "kind"), list(itertools.product(STATES, EVENT_TYPES)),
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_state_and_event(label: str, kind: type) -> None:
    state, event = STATES[label], SAMPLES[kind]
    if (label, kind) not in EXPECTED:
        with pytest.raises(InvalidTransition) as raised:
            transition(state, event)
        assert str(raised.value) == (f"connection: {kind.__name__} cannot happen while "
                                     f"{state.phase.value}")
        return
    after = transition(state, event)
    assert after.phase is EXPECTED[label, kind]
    if after.phase is not Phase.CLOSED:
        assert after.error is None and not after.given_up
    if state.phase is Phase.CLOSED:  # once closed, its reason stays
        assert after.given_up >= state.given_up
        if kind is not Begin:
            assert after.error is state.error


@pytest.mark.parametrize(("asked", "offered", "until_eof"),
                         list(itertools.product([False, True], repeat=3)))
def test_reuse_needs_both_sides_and_a_length(asked: bool, offered: bool,
                                             until_eof: bool) -> None:
    due = transition(IDLE_STATE, Begin(keep_alive=asked))
    assert due == ConnState(Phase.HEAD_DUE, keep_alive=asked)
    body = transition(due, HeadReceived(keep_alive=offered, until_eof=until_eof))
    assert body == ConnState(Phase.BODY, keep_alive=asked and offered and not until_eof,
                             until_eof=until_eof)
    done = transition(body, BodyEnded())
    assert done == ConnState(Phase.DONE, keep_alive=body.keep_alive)
    if done.keep_alive:
        assert transition(done, Begin()).phase is Phase.HEAD_DUE
    else:
        with pytest.raises(InvalidTransition):
            transition(done, Begin())


@pytest.mark.parametrize("kind", [Aborted, GivenUp, Lost])
@pytest.mark.parametrize("received_any", [False, True])
def test_an_exchange_cut_off_fails_with_what_its_phase_says(kind: type,
                                                           received_any: bool) -> None:
    given_up = kind is GivenUp
    for label in HEAD:
        after = transition(STATES[label], kind(received_any))
        assert isinstance(after.error, ConnectionClosed)
        assert after.error.received_any is received_any and after.given_up is given_up
    for label in BODY:
        after = transition(STATES[label], kind(received_any))
        assert type(after.error) is BrokenBody and after.given_up is given_up
    for label in ("idle", *DONE):  # no exchange in flight: none fails
        assert transition(STATES[label], kind(received_any)) == \
            ConnState(Phase.CLOSED, given_up=given_up)


def test_a_refusal_or_a_late_head_fails_with_its_own_error_and_a_done_exchange_stands() -> None:
    late, refused = SAMPLES[HeadLate], SAMPLES[Refused]
    assert isinstance(late, HeadLate) and isinstance(refused, Refused)
    assert transition(STATES["head due"], late).error is late.error
    for label in HEAD + BODY:
        assert transition(STATES[label], refused).error is refused.error
    for label in DONE:
        assert transition(STATES[label], refused) == CLOSED_STATE


def test_given_up_is_kept_and_a_begin_on_a_closed_connection_fails_at_once() -> None:
    given_up = transition(STATES["closed, failed"], GivenUp())
    assert given_up.given_up and given_up.error is FAILED
    again = transition(given_up, Begin())
    assert again.phase is Phase.CLOSED and again.given_up  # never retried on a fresh one
    assert isinstance(again.error, ConnectionClosed) and not again.error.received_any
    assert again.error is not FAILED  # the new exchange's own error: its waiter gets it
    for later in (Aborted(), Lost(), Closed(), Refused(FAILED)):
        assert transition(again, later) is again


def test_transitions_without_a_failure_allocate_nothing() -> None:
    """The states a healthy exchange goes through are made once (the hot path allocates no
    state per exchange); only a failure carries an error of its own."""
    for (label, kind), _ in EXPECTED.items():
        state, event = STATES[label], SAMPLES[kind]
        after = transition(state, event)
        if after.error is None and not after.given_up:
            assert transition(state, event) is after, (label, kind)


DERIVED = {  # label: closed, complete, reusable
    "idle": (False, True, True), "head due": (False, False, False),
    "head due, last": (False, False, False), "body": (False, False, False),
    "body, last": (False, False, False), "body until eof": (False, False, False),
    "done": (False, True, True), "done, spent": (False, True, False),
    "closed": (True, True, False), "closed, failed": (True, False, False),
    "closed, given up": (True, True, False),
}


def test_what_the_pool_and_the_relay_read_is_derived_from_the_state() -> None:
    async def check() -> None:
        conn = upstream._Connection()
        for label, (closed, complete, reusable) in DERIVED.items():
            state = STATES[label]
            conn._state = state  # the test's own writer: it checks the readers alone
            assert (conn.closed, conn.complete, conn.reusable) == (closed, complete, reusable)
            assert conn.error is state.error and conn.given_up is state.given_up
            assert conn.keep_alive is state.keep_alive and conn.until_eof is state.until_eof
            assert conn._in_head is (state.phase is Phase.HEAD_DUE)

    asyncio.run(check())


# ----------------------------------------------------------------------------- a transport


class FakeTransport(asyncio.Transport):
    """The router's end of one TCP connection, and what its server has to send on it.
    Closing it (either side) makes the loop call ``connection_lost`` once, as asyncio does."""

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: upstream._Connection) -> None:
        super().__init__()
        self.loop = loop
        self.conn = conn
        self.requests = 0  # requests written on it
        self.answers: list[str] = []  # the kinds of responses its server began, in order
        self.pending = b""  # what its server still has to send of the latest response
        self.delivered = b""  # what it has sent of it
        self.closed = False
        self.lost = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "a request written on a closed connection"
        assert self.requests == len(self.answers), "a request before the last was answered"
        self.requests += 1

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self._close(None)

    def abort(self) -> None:
        self._close(None)

    def reset(self) -> None:
        """The server's side goes away without a word (a crash, a reset)."""
        self._close(ConnectionResetError("reset by peer"))

    def _close(self, exc: Exception | None) -> None:
        if not self.closed:
            self.closed = True
            self.loop.call_soon(self._lost, exc)

    def _lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.conn.connection_lost(exc)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading


def test_bytes_before_any_request_abort_the_connection_unread() -> None:
    async def check() -> None:
        conn = upstream._Connection()
        transport = FakeTransport(asyncio.get_running_loop(), conn)
        conn.connection_made(transport)
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        assert conn.closed and transport.closed and conn.status == 0
        assert not conn.reusable

    asyncio.run(check())


def test_a_connection_its_server_closed_while_idle_is_never_handed_out() -> None:
    """The server's EOF on a kept-alive connection closes it at once (``connection_lost``
    comes a loop turn later): a request in between gets another connection."""
    async def check() -> None:
        pool = ChildConnections("127.0.0.1", 9)
        transports: list[FakeTransport] = []

        async def connect(conn: upstream._Connection) -> None:
            transports.append(FakeTransport(asyncio.get_running_loop(), conn))
            conn.connection_made(transports[-1])

        pool._connect = connect  # type: ignore[method-assign]
        sending = asyncio.create_task(pool.send("GET", b"/", [], b""))
        await asyncio.sleep(0)
        [first] = transports
        first.answers.append("length")
        first.conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        response = await sending
        assert await response.read() == b"ok"
        response.release()
        assert list(pool._idle) == [first.conn]
        first.conn.eof_received()  # the server closes it; the transport closes after
        assert first.conn.closed
        assert pool._take() is None  # discarded, not handed out

    asyncio.run(check())


def test_a_body_left_unread_while_reading_was_paused_does_not_stall_the_next_exchange() -> None:
    """A response completed by the read that passed the high-water mark, released unread:
    the next exchange on that connection reads again (it used to wait for its deadline)."""
    async def check() -> None:
        conn = upstream._Connection()
        transport = FakeTransport(asyncio.get_running_loop(), conn)
        conn.connection_made(transport)
        size = READ_HIGH_WATER + 1
        conn.begin(b"GET / HTTP/1.1\r\n\r\n", head_only=False)
        conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size
                           + b"x" * size)
        assert conn.complete and conn.reusable and not transport.reading
        transport.answers.append("big")
        conn.begin(b"GET / HTTP/1.1\r\n\r\n", head_only=False)
        assert transport.reading and conn.state.phase is Phase.HEAD_DUE

    asyncio.run(check())


# ----------------------------------------------------------------------------- stateful

HEAD_TIMEOUT = 5.0
PLACES = 2
BIG = READ_HIGH_WATER + READ_HIGH_WATER // 2

# kind: (what the server sends, the body an exchange that reads it to its end gets; None:
# no exchange may end well with it).
RESPONSES: dict[str, tuple[bytes, bytes | None]] = {
    "length": (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", b"hello"),
    "chunked": (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n", b"hello world"),
    "stream": (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"transfer-encoding: chunked\r\n\r\n"
               b"9\r\ndata: a\n\n\r\n9\r\ndata: b\n\n\r\n0\r\n\r\n", b"data: a\n\ndata: b\n\n"),
    "until close": (b"HTTP/1.1 200 OK\r\n\r\nall of it, until the close",
                    b"all of it, until the close"),
    "interim": (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
                b"ok"),
    "no content": (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
    "close": (b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 3\r\n\r\nbye", b"bye"),
    "big": (b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % BIG + b"x" * BIG, b"x" * BIG),
    "endless head": (b"HTTP/1.1 200 OK\r\nx-a: " + b"v" * (MAX_RESPONSE_HEAD_BYTES + 4096), None),
    "many headers": (b"HTTP/1.1 200 OK\r\n" + b"x-b: c\r\n" * (MAX_RESPONSE_HEADERS + 5)
                     + b"\r\n", None),
    "upgrade": (b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n", None),
    "garbage": (b"NOT HTTP AT ALL\r\n\r\n", None),
}
UNASKED = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
# Where the final head of each response ends (the whole of a response that has none).
HEAD_ENDS = {kind: data.find(b"\r\n\r\n", data.find(b"HTTP/1.1 2")) + 4
             if b"HTTP/1.1 2" in data else len(data) for kind, (data, _) in RESPONSES.items()}
UNTIL = st.sampled_from(["the end", "in the head", "in the body"])
# The sizes of the reads a response arrives in: a byte at a time up to a read of 128 KiB.
SIZES = st.lists(st.integers(min_value=1, max_value=64) | st.integers(min_value=1,
                                                                       max_value=1 << 17),
                 min_size=1, max_size=6)


@dataclass
class Exchange:
    method: str
    keep_alive: bool
    accepts: tuple[bool, ...] | None  # the sink's answers in turn; None: next_chunk alone
    cancel: Cancel = field(default_factory=Cancel)
    task: asyncio.Task[None] | None = None
    body: bytearray = field(default_factory=bytearray)
    outcome: object = None  # "complete", or the exception it ended with
    answered: tuple[FakeTransport, str] | None = None  # where its head came from, what kind

    @property
    def done(self) -> bool:
        return self.task is not None and self.task.done()

    def expected(self) -> bytes | None:
        """The body a read to the end gets; None: no read may end well."""
        assert self.answered is not None
        transport, kind = self.answered
        if self.method == "HEAD":
            return b""
        if kind == "until close":  # it ends where the server closed: what it had sent
            return transport.delivered[HEAD_ENDS[kind]:]
        return RESPONSES[kind][1]


class ExchangesOnAPool(RuleBasedStateMachine):
    """Requests through a ``ChildConnections`` of real ``_Connection``s on fake transports:
    the test plays the server (answers of every kind, in any splits, closes and resets at any
    point, bytes nobody asked for), the clock (head deadlines), the clients (who leave) and
    the router (``abort_all``). Each exchange must end, with its response's exact body or an
    ``UpstreamError``; a connection is handed out only while reusable; no head is parsed
    past its bound or awaited past its deadline."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = VirtualTimeLoop()
        self.pool = ChildConnections("127.0.0.1", 9, PLACES, label="upstream u",
                                     head_timeout_s=HEAD_TIMEOUT)
        self.transports: list[FakeTransport] = []
        self.exchanges: list[Exchange] = []
        self.head_fed: dict[asyncio.Future[None], int] = {}  # per exchange: head bytes parsed
        self.pool._connect = self._connect  # type: ignore[method-assign]
        take, acquire = self.pool._take, self.pool._acquire

        def checked_take() -> upstream._Connection | None:
            conn = take()
            assert conn is None or (conn.reusable and not conn.transport.is_closing()), \
                f"handed out while {conn.state}"
            return conn

        async def checked_acquire(fresh: bool, cancel: Cancel | None = None
                                  ) -> tuple[upstream._Connection, bool]:
            conn, reused = await acquire(fresh, cancel)
            # Granted while reusable; it may have closed since (then its exchange fails at
            # once, and is tried again on a fresh one), never be in use or spent.
            assert conn.reusable or conn.closed, f"handed out while {conn.state}"
            return conn, reused

        self.pool._take = checked_take  # type: ignore[method-assign]
        self.pool._acquire = checked_acquire  # type: ignore[method-assign]

    # -- the network, the clock and the loop

    async def _connect(self, conn: upstream._Connection) -> None:
        transport = FakeTransport(self.loop, conn)
        self.transports.append(transport)
        conn.connection_made(transport)
        parse = conn._feed

        def counted(data: bytes) -> None:
            if conn._in_head:
                key = conn._headers_done
                self.head_fed[key] = self.head_fed.get(key, 0) + len(data)
            parse(data)

        conn._feed = counted  # type: ignore[method-assign]

    def run(self, make: Callable[[], Awaitable[Any]]) -> None:
        async def go() -> None:
            await make()
            for _ in range(40):  # until every callback and task has run as far as it can
                await asyncio.sleep(0)

        self.loop.run_until_complete(go())

    def act(self, action: Callable[[], object]) -> None:
        async def go() -> None:
            action()

        self.run(go)

    async def _exchange(self, ex: Exchange) -> None:
        try:
            response = await self.pool.send(ex.method, b"/", [], b"{}" if ex.method == "POST"
                                            else b"", keep_alive=ex.keep_alive,
                                            cancel=ex.cancel)
        except Exception as exc:  # what it is, is for the invariant to judge
            ex.outcome = exc
            return
        transport = response._conn.transport
        assert isinstance(transport, FakeTransport)
        ex.answered = transport, transport.answers[-1]
        try:
            if ex.accepts is not None:
                turns = itertools.cycle(ex.accepts)

                def sink(piece: bytes) -> bool:
                    if accepted := next(turns):
                        ex.body += piece
                    return accepted

                response.relay_to(sink)
            while (chunk := await response.next_chunk()) is not None:
                ex.body += chunk
            ex.outcome = "complete"
        except Exception as exc:
            ex.outcome = exc
        finally:
            response.release()

    def live(self) -> list[FakeTransport]:
        return [t for t in self.transports if not t.closed]

    def asked(self) -> list[FakeTransport]:
        """Connections with a request their server has not begun to answer."""
        return [t for t in self.live() if t.requests > len(t.answers)]

    def sending(self) -> list[FakeTransport]:
        return [t for t in self.live() if t.pending and t.reading]

    def between_exchanges(self) -> list[FakeTransport]:
        return [t for t in self.live() if not t.pending and t.requests == len(t.answers)
                and t.conn.state.phase in (Phase.IDLE, Phase.DONE)]

    def mid_exchange(self) -> list[FakeTransport]:
        return [t for t in self.live() if t.conn.state.phase in (Phase.HEAD_DUE, Phase.BODY)]

    def running(self) -> list[Exchange]:
        return [ex for ex in self.exchanges if not ex.done]

    # -- clients

    @precondition(lambda self: len(self.running()) < 4 and len(self.exchanges) < 12)
    @rule(method=st.sampled_from(["GET", "POST", "HEAD"]), keep_alive=st.booleans(),
          accepts=st.none() | st.lists(st.booleans(), min_size=1, max_size=3).map(tuple))
    def request(self, method: str, keep_alive: bool, accepts: tuple[bool, ...] | None) -> None:
        ex = Exchange(method, keep_alive, accepts)
        self.exchanges.append(ex)

        async def start() -> None:
            ex.task = asyncio.get_running_loop().create_task(self._exchange(ex))

        self.run(start)

    @precondition(lambda self: bool(self.running()))
    @rule(which=st.integers(min_value=0, max_value=7))
    def client_leaves(self, which: int) -> None:
        running = self.running()
        self.act(running[which % len(running)].cancel)

    # -- the server

    @precondition(lambda self: bool(self.asked()))
    @rule(which=st.integers(min_value=0, max_value=7), kind=st.sampled_from(list(RESPONSES)),
          sizes=SIZES, until=UNTIL, at=st.floats(min_value=0, max_value=1))
    def answer(self, which: int, kind: str, sizes: list[int], until: str, at: float) -> None:
        """A server begins its response: all of it, or only as far as somewhere in its head
        or its body (the rest for ``deliver``, or never: cut there)."""
        asked = self.asked()
        transport = asked[which % len(asked)]
        transport.answers.append(kind)
        transport.pending, transport.delivered = RESPONSES[kind][0], b""
        self._send(transport, sizes, until, at)

    @precondition(lambda self: bool(self.sending()))
    @rule(which=st.integers(min_value=0, max_value=7), sizes=SIZES, until=UNTIL,
          at=st.floats(min_value=0, max_value=1))
    def deliver(self, which: int, sizes: list[int], until: str, at: float) -> None:
        """More of a response arrives."""
        sending = self.sending()
        self._send(sending[which % len(sending)], sizes, until, at)

    def _send(self, transport: FakeTransport, sizes: list[int], until: str, at: float) -> None:
        """One read per piece, the loop turning in between (as a socket's reads), up to the
        point ``until`` and ``at`` choose in what the server still has to send."""
        data, sent = RESPONSES[transport.answers[-1]][0], transport.pending
        done = len(data) - len(sent)
        head = HEAD_ENDS[transport.answers[-1]]
        start, end = {"the end": (len(data), len(data)), "in the head": (done, max(done, head)),
                      "in the body": (max(done, head), len(data))}[until]
        stop = start + int((end - start) * at) - done  # how much of ``sent`` goes now
        now, transport.pending = sent[:stop], sent[stop:]
        pieces = itertools.chain(sizes, itertools.repeat(max(*sizes, 1 << 14)))

        async def reads(now: bytes) -> None:
            for size in pieces:
                for _ in range(8):  # the reader takes what is queued, and may resume reading
                    await asyncio.sleep(0)
                if not now or not transport.reading or transport.closed:
                    break
                piece, now = now[:size], now[size:]
                transport.delivered += piece
                transport.conn.data_received(piece)
            transport.pending = now + transport.pending  # what a paused reader did not take

        self.run(lambda: reads(now))

    @precondition(lambda self: bool(self.live()))
    @rule(which=st.integers(min_value=0, max_value=7), graceful=st.booleans())
    def server_closes(self, which: int, graceful: bool) -> None:
        """Mid-head, mid-body, between exchanges: a close (EOF) or a reset."""
        live = self.live()
        self._close(live[which % len(live)], graceful)

    @precondition(lambda self: bool(self.mid_exchange()))
    @rule(which=st.integers(min_value=0, max_value=7), graceful=st.booleans())
    def server_dies_mid_exchange(self, which: int, graceful: bool) -> None:
        mid = self.mid_exchange()
        self._close(mid[which % len(mid)], graceful)

    def _close(self, transport: FakeTransport, graceful: bool) -> None:
        transport.pending = b""
        event(f"server closes while {transport.conn.state.phase.value}")

        def close() -> None:
            if not graceful:
                transport.reset()
            elif not transport.conn.eof_received():
                transport.close()

        self.act(close)

    @precondition(lambda self: bool(self.between_exchanges()))
    @rule(which=st.integers(min_value=0, max_value=7))
    def server_speaks_unasked(self, which: int) -> None:
        between = self.between_exchanges()
        transport = between[which % len(between)]
        self.act(lambda: transport.conn.data_received(UNASKED))
        assert transport.conn.closed and not transport.conn.reusable

    # -- time and the router

    @rule(seconds=st.sampled_from([0.5, HEAD_TIMEOUT / 2, HEAD_TIMEOUT + 0.5]))
    def time_passes(self, seconds: float) -> None:
        self.run(lambda: asyncio.sleep(seconds))

    @precondition(lambda self: self.pool.ended is None and len(self.exchanges) >= 3)
    @rule(ended=st.sampled_from([False, False, False, True]))
    def abort_all(self, ended: bool) -> None:
        """The upstream was found gone (the pool goes on), or the model was unloaded (every
        later request fails at once)."""
        self.act(lambda: self.pool.abort_all(Unavailable("unloaded") if ended else None))

    # -- invariants

    @invariant()
    def every_ended_exchange_ended_well(self) -> None:
        for ex in self.exchanges:
            if not ex.done:
                continue
            if ex.outcome == "complete":
                expected = ex.expected()
                assert expected is not None, "a refused response was read as complete"
                assert bytes(ex.body) == expected, "the body changed on its way"
            else:
                assert isinstance(ex.outcome, UpstreamError), repr(ex.outcome)

    @invariant()
    def each_connection_agrees_with_its_transport(self) -> None:
        now = self.loop.time()
        for transport in self.transports:
            conn = transport.conn
            state = conn.state
            if transport.lost:
                assert conn.closed, f"lost while {state}"
            if conn.closed:
                assert transport.closed, "closed, its transport left open"
            timer = conn._head_timer
            assert (timer is not None) == (state.phase is Phase.HEAD_DUE), state
            if timer is not None:  # a head is never awaited past its deadline
                assert now - 1e-6 <= timer.when() <= now + HEAD_TIMEOUT + 1e-6
            if state.phase in (Phase.BODY, Phase.DONE) or (
                    state.phase is Phase.CLOSED and transport.requests):
                assert conn._headers_done.done(), f"an exchange's waiter left hanging: {state}"

    @invariant()
    def the_pool_keeps_its_bounds(self) -> None:
        assert 0 <= self.pool.open_connections <= PLACES
        for conn in self.pool._idle:
            assert conn.reusable or conn.closed, conn.state
        assert max(self.head_fed.values(), default=0) <= MAX_RESPONSE_HEAD_BYTES, \
            "a head parsed past its bound"

    def teardown(self) -> None:
        try:
            # Every server goes away, and time passes: whatever waited must have ended (a
            # request still waiting for a place gets one, and then its head's deadline).
            for _ in range(8):
                if all(ex.done for ex in self.exchanges):
                    break
                for transport in self.live():
                    self.act(transport.reset)
                self.run(lambda: asyncio.sleep(HEAD_TIMEOUT + 1))
            hanging = [ex for ex in self.exchanges if not ex.done]
            assert not hanging, f"exchanges that never ended: {hanging}"
            for ex in self.exchanges:  # what the runs covered (--hypothesis-show-statistics)
                outcome = ex.outcome if ex.outcome == "complete" else type(ex.outcome).__name__
                event(f"exchange: {outcome}")
            self.every_ended_exchange_ended_well()
            self.run(self.pool.aclose)
            for task in list(self.pool._warming):
                task.cancel()
            self.run(lambda: asyncio.sleep(0))
        finally:
            self.loop.close()


ExchangesOnAPool.TestCase.settings = settings(
    max_examples=250, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestExchangesOnAPool = ExchangesOnAPool.TestCase


# ----------------------------------------------------------------------------- one writer

ROUTER = Path(__file__).resolve().parent.parent / "router"
# Flags a connection used to keep as fields: now read from its state, never written.
DERIVED_NAMES = {"closed", "complete", "reusable", "keep_alive", "until_eof", "error",
                 "given_up", "received_any", "_in_head", "state"}


def _connection_class() -> ast.ClassDef:
    tree = ast.parse((ROUTER / "http" / "upstream.py").read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_Connection")


def test_the_flags_a_connection_derives_from_its_state_have_no_setter() -> None:
    """Who writes a connection's state, in the source, is checked with every other record
    (docs/architecture.toml, tests/test_architecture.py); the flags the pool and the relay
    read are derived from the state: properties without a setter (``conn.complete = True``
    was how a warmed connection became reusable)."""
    for name in DERIVED_NAMES:
        prop = inspect.getattr_static(upstream._Connection, name)
        assert isinstance(prop, property) and prop.fset is None, name


def test_the_per_chunk_path_applies_no_event() -> None:
    """The hot path (a read while the body streams: ``data_received``'s BODY branch, the
    parse in ``_feed``, ``on_body``, the sink, the queue) applies no event and makes no
    state; events come per exchange (begin, head, end) or per connection (loss, abort)."""
    methods = {m.name: m for m in _connection_class().body if isinstance(m, ast.FunctionDef)}
    received = methods["data_received"].body[1]
    feed = next(n for n in methods["_feed"].body if isinstance(n, ast.Try))
    assert isinstance(received, ast.If) and ast.unparse(received.test) == "phase is BODY"
    path = [*received.body, *feed.body, *feed.finalbody, *methods["on_body"].body,
            *methods["_to_sink"].body, *methods["_queue"].body, *methods["_wake"].body]
    calls = {ast.unparse(n.func) for stmt in path for n in ast.walk(stmt)
             if isinstance(n, ast.Call)}
    assert calls, "no per-chunk path found"
    assert not {c for c in calls if c.endswith("_apply") or c in {"transition", "ConnState"}
                or c[:1].isupper()}, calls
