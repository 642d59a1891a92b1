"""A metered request at the edge: the requests a model's slots run (``paths.METERED_PATHS``)
count against their team's quotas, take their turn for a slot, and are written in the
team's usage.

``Meter.begin`` is asked once the model is decided, before the request waits for anything:
over a quota it raises ``QuotaExceeded`` (429 with ``Retry-After``) and counts the refusal,
and the request never reaches a child. Else the request carries its ``Metered``: its quota
hold and its turn for a slot (``fairshare.Turn``, with its expected prompt tokens: the body's
bytes over ``BYTES_PER_TOKEN``); a request of a class below ``interactive`` whose answer is not
streamed may have its slot taken back before it answers (``preemption``); a batch request's,
where its answer can be assembled whole (``llama.unstreamed``), is asked of the child as a
stream (``asked_whole``), so that a take-back stops the child within a token, not a second.
What it streams and the limit it sets are read from the request's one reading
(``RequestContext.fields``), for every body shape.

The client cannot shape what it is charged. Its answer is the child's whole answer: a
``response_fields`` that would hide the counts is overridden (``shaped``: an empty list
added as the body's last key, which llama-server reads as "every field"). ``Metered.end``
reads once what the child's answer says (``tail``: its prompt and generated tokens, clamped);
where it says nothing, the reservation is charged: the prompt's estimate, and the limit the
request set (for a stream cut short, the events sent, if more). An error answer (a status of
400 or more) is charged nothing, and so is a request that never got an answer (its client
left while queued).

A team whose quotas meter tokens (tokens a minute) cannot overrun them by one request's
generation: a completion whose limit is unset or larger than what its quotas allow
(``Quotas.allowance``: a minute's worth less its prompt) gets that as its limit
(``Metered.cap``, written into the body the child gets). The edge asks the quotas, never a
kind of quota by name.

The usage is written here alone: what a request used (``Metered.end``), a refusal, and its
file, by the writer the router's lifespan runs (``Meter.run``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..config.keyfile import PRIORITIES
from ..errors import BadRequest, QuotaExceeded, Unavailable
from ..http.jsonscan import COMPOUND
from ..http.paths import METERED_PATHS, SLOT_PATHS, UNPINNED_SLOT_PATHS
from ..http.proxy import Preemption
from ..http.requests import RequestContext
from ..llama.unstreamed import CHAT_PATHS, INCLUDE_USAGE, STREAM, Assembly, assembly, wholeable
from ..teams.fairshare import GENERATED_WEIGHT, Turn
from ..teams.quotas import Hold, OverQuota, Quotas
from ..teams.usage import Usage

if TYPE_CHECKING:
    from ..serving.leases import Lease

BATCH_RANK = PRIORITIES.index("batch")  # the lowest class: its answers may be assembled whole
MAX_LIMIT = 1 << 31  # a limit past this is read as this (no request generates more)
BYTES_PER_TOKEN = 4  # a prompt's expected tokens, from its body's size, until the child counts
# The generation limit's names, in the order llama-server reads them (``n_predict`` and its
# aliases; ``max_output_tokens`` is the Responses API's ``max_tokens``): the first given wins.
_LIMITS = ("n_predict", "max_completion_tokens", "max_tokens", "max_output_tokens")


class Metered:
    """One metered request: its ``turn`` for a slot, its quota ``hold``."""

    __slots__ = ("_ended", "_hold", "_meter", "cap", "limit", "model", "preemptible", "turn",
                 "whole")

    def __init__(self, meter: Meter, model: str, turn: Turn, hold: Hold | None,
                 preemptible: bool = False, limit: int = 0, cap: int = 0,
                 whole: bool = False) -> None:
        self._meter = meter
        self.model = model
        self.turn = turn
        self._hold = hold
        self.preemptible = preemptible  # its slot may be taken back before it answers
        self.limit = limit  # the tokens it may generate (0: it set none)
        self.cap = cap  # the limit the router sets it (its team's quotas allow; 0: none)
        # asked of the child as a stream, its answer assembled whole (``llama.unstreamed``)
        self.whole = whole
        self._ended = False

    def shaped(self, request: RequestContext, body: bytes) -> bytes:
        """The body the child gets: one that names ``response_fields`` (which could leave the
        counts out of the answer) gets an empty list as its last key, which llama-server reads
        as the whole answer; one whose generation its team's quotas cap
        (``cap``) gets that limit as its last key (``n_predict``, which llama-server reads
        over its aliases; Anthropic's ``max_tokens``); any other body unchanged, byte for
        byte."""
        fields = request.fields.get("response_fields")
        if fields is not None and (fields is COMPOUND or type(fields) is list) and fields != []:
            body = request.with_field(body, "response_fields", b"[]") or body
        if self.cap:
            name = "max_tokens" if request.path in UNPINNED_SLOT_PATHS else "n_predict"
            body = request.with_field(body, name, str(self.cap).encode()) or body
        return body

    def asked_whole(self, request: RequestContext, body: bytes
                    ) -> tuple[bytes, Assembly | None]:
        """For a request whose answer is assembled (``whole``), the body that asks llama-server
        for a stream (and for a chat completion, the usage at its end), and a new assembly of
        its answer; else the body as it is, and None."""
        if not self.whole:
            return body, None
        streamed = request.with_field(body, "stream", STREAM)
        if streamed is None:
            return body, None
        if request.path in CHAT_PATHS:
            streamed = request.with_field(streamed, "stream_options", INCLUDE_USAGE)
            if streamed is None:
                return body, None
        return streamed, assembly(request.path)

    def preemption(self) -> Preemption | None:
        """What takes this request's slot back while its answer has not begun, set on its
        turn for the slot queue (``slotqueue``); None for a request that cannot be."""
        if not self.preemptible:
            return None
        preemption = Preemption()
        self.turn.preempt = preemption
        return preemption

    def end(self, request: RequestContext, lease: Lease | None,
            error: BaseException | None = None) -> None:
        """The request ended (its lease, when it got one; ``error``, when it failed before
        an answer): charge what it used, once."""
        if self._ended:
            return
        self._ended = True
        prompt = completion = 0
        if request.first_sent:  # an answer went out (an error's is charged nothing)
            if request.status < 400:  # what the child said it did
                tail = request.tail()
                prompt, completion = charged(tail.prompt_tokens, tail.tokens, self.turn.cost,
                                             self.limit, request.chunks)
            self._meter.usage.served(request.member.name, self.model, prompt, completion,
                                     request.queue_s or 0.0)
        elif isinstance(error, Unavailable):  # the wait ran out
            self._meter.usage.refused(request.member.name, self.model)
        if lease is not None:
            lease.spent(prompt + GENERATED_WEIGHT * completion)
        if self._hold is not None:
            self._hold.settle(prompt + completion)


def charged(prompt: int | None, generated: int | None, estimate: float, limit: int,
            chunks: int) -> tuple[int, int]:
    """The prompt and generated tokens an answer is charged: what the child counted
    (``prompt``, ``generated``; None: its answer said nothing); where it said nothing, the
    reservation: the prompt's ``estimate``, and the ``limit`` the request set (a stream cut
    short, of more than one of its ``chunks``: the events sent, when more)."""
    return (prompt if prompt is not None else round(estimate),
            generated if generated is not None else max(limit, chunks if chunks > 1 else 0))


class Meter:
    def __init__(self, usage: Usage, quotas: Quotas | None = None) -> None:
        self.usage = usage
        self.quotas = quotas or Quotas()

    async def run(self) -> None:
        """Write the usage to its file every few seconds until cancelled, then what is left at
        once (``Usage.run``): the router's lifespan runs it beside the server."""
        await self.usage.run()

    def begin(self, request: RequestContext, model: str) -> Metered | None:
        """The metering of a request to ``model``; None for one that is not metered."""
        if request.method != "POST" or request.path not in METERED_PATHS:
            return None
        body = request.body or b""
        expected = len(body) / BYTES_PER_TOKEN
        member = request.member
        fields = request.fields
        limit = _limit(fields)
        allowed = self.quotas.allowance(member.policy, expected) \
            if request.path in SLOT_PATHS else None
        cap = 0
        if allowed is not None and not 0 < limit <= allowed.tokens:
            limit = cap = max(1, int(allowed.tokens))
            if body and not request.json_object:  # (a multipart body: no field can cap it)
                raise BadRequest(f"team {member.name} has {allowed.quota}: its "
                                 f"completions take a JSON body, whose generation limit the "
                                 "router caps (a multipart field is no limit to llama-server)")
        try:
            hold = self.quotas.admit(member.policy, expected + limit)
        except OverQuota as exc:
            self.usage.refused(member.name, model)
            raise QuotaExceeded(str(exc), headers={"Retry-After": str(exc.retry_after)}
                                ) from None
        preemptible = member.rank > 0 and fields.get("stream") is not True
        # The batch class only: every router has a class above it (default), whereas a
        # default-class request is taken back only where interactive keys exist, and asking
        # every unstreamed request of a router without keys as a stream would tax its hot path.
        whole = preemptible and member.rank == BATCH_RANK \
            and wholeable(request.path, fields, request.parsed is not None)
        return Metered(self, model, Turn(member.flow, member.rank, expected), hold, preemptible,
                       limit, cap, whole)


def _limit(fields: Mapping[str, Any]) -> int:
    """The generated tokens a request allows itself, from its one reading (0: it names no
    limit)."""
    for name in _LIMITS:
        value = fields.get(name)
        if value is not None:
            return min(value, MAX_LIMIT) if type(value) is int and value > 0 else 0
    return 0
