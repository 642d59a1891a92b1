"""A metered request at the edge: the requests a model's slots run (``paths.METERED_PATHS``)
count against their team's quotas, take their turn for a slot, and are written in the
team's usage.

``Meter.begin`` is asked once the model is decided, before the request waits for anything:
over a quota it raises ``QuotaExceeded`` (429 with ``Retry-After``) and counts the refusal,
and the request never reaches a child. Else the request carries its ``Metered``: its quota
hold and its turn for a slot (``fairshare.Turn``, with its expected prompt tokens: the body's
bytes over ``BYTES_PER_TOKEN``); a request of a class below ``interactive`` whose answer is not
streamed may have its slot taken back before it answers (``preemption``). ``Metered.end``
reads once what the response told the client
(``tail``: its prompt and generated tokens; for a stream cut short, the events sent), corrects
the turn's charge (``Lease.spent``), settles the hold and writes the usage. A request that
never got an answer (its client left while queued) is charged nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import QuotaExceeded, Unavailable
from ..http.paths import METERED_PATHS
from ..http.proxy import Preemption
from ..http.requests import RequestContext
from ..teams.fairshare import GENERATED_WEIGHT, Turn
from ..teams.quotas import Hold, OverQuota, Quotas
from ..teams.usage import Usage

if TYPE_CHECKING:
    from ..core.leases import Lease

BYTES_PER_TOKEN = 4  # a prompt's expected tokens, from its body's size, until the child counts
_LIMITS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")


class Metered:
    """One metered request: its ``turn`` for a slot, its quota ``hold``."""

    __slots__ = ("_ended", "_hold", "_meter", "model", "preemptible", "turn")

    def __init__(self, meter: Meter, model: str, turn: Turn, hold: Hold | None,
                 preemptible: bool = False) -> None:
        self._meter = meter
        self.model = model
        self.turn = turn
        self._hold = hold
        self.preemptible = preemptible  # its slot may be taken back before it answers
        self._ended = False

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
        if request.first_sent:  # an answer went out: what it told the client
            tail = request.tail()
            told, generated = tail.prompt_tokens, tail.tokens
            cut = request.chunks > 1  # a stream cut short; else one body (an error says none)
            prompt = told if told is not None else round(self.turn.cost) if cut else 0
            completion = generated if generated is not None else request.chunks if cut else 0
            self._meter.usage.served(request.member.name, self.model, prompt, completion,
                                     request.queue_s or 0.0)
        elif isinstance(error, Unavailable):  # the wait ran out
            self._meter.usage.refused(request.member.name, self.model)
        if lease is not None:
            lease.spent(prompt + GENERATED_WEIGHT * completion)
        if self._hold is not None:
            self._hold.settle(prompt + completion)


class Meter:
    def __init__(self, usage: Usage, quotas: Quotas | None = None) -> None:
        self.usage = usage
        self.quotas = quotas or Quotas()

    def begin(self, request: RequestContext, model: str) -> Metered | None:
        """The metering of a request to ``model``; None for one that is not metered."""
        if request.method != "POST" or request.path not in METERED_PATHS:
            return None
        body = request.body or b""
        expected = len(body) / BYTES_PER_TOKEN
        member = request.member
        hold = None
        if member.policy.max_concurrent is not None or member.policy.tokens_per_minute:
            try:
                hold = self.quotas.admit(member.policy, expected + _limit(request))
            except OverQuota as exc:
                self.usage.refused(member.name, model)
                raise QuotaExceeded(str(exc), headers={"Retry-After": str(exc.retry_after)}
                                    ) from None
        parsed = request.parsed
        preemptible = member.rank > 0 and type(parsed) is dict and parsed.get("stream") is not True
        return Metered(self, model, Turn(member.flow, member.rank, expected), hold, preemptible)


def _limit(request: RequestContext) -> int:
    """The generated tokens a request allows itself (0: it names no limit)."""
    parsed = request.parsed
    if type(parsed) is not dict:
        return 0
    for name in _LIMITS:
        value = parsed.get(name)
        if type(value) is int and value > 0:
            return value
    return 0
