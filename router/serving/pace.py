"""How soon each replica of a model would start answering a request, from what its child has
shown of its speed (pure: no I/O; the caller passes the time). Prefix routing weighs it.

A follow-up turn is cheapest on the replica that holds its conversation (``affinity``): only the
new messages need computing. But when that replica is busy, the turn waits there, and another
replica would compute the whole conversation again. Which costs less depends on how long the
wait is and how fast a prompt is computed, so both are measured:

* ``Timings``: what llama-server reports at the end of every completion (``"timings"``: the
  prompt tokens it computed, ``prompt_n``, in ``prompt_ms``; those it took from its cache,
  ``cache_n``; the tokens it generated, ``predicted_n``, in ``predicted_ms``), read from the
  last bytes of a response (``tail.ResponseTail``).
* ``Pace``: one replica's running estimates (exponentially weighted, ``WEIGHT`` for the newest
  sample): seconds per character of prompt computed, seconds per generated token, tokens per
  reply, and how much of the prefix its table says it holds it really had in its cache
  (``reuse``: a child whose cache is too small for the conversations sent to it shows less
  than its table promises).
* ``Backlog``: the requests a replica was given and has not answered, each with its expected
  work (``Ticket``: computing its uncached prompt, then its reply), started in arrival order as
  slots free (llama-server queues the rest in order): ``remaining`` is what is left of it all.
* ``by_cost``: the replica where the request's first token is expected soonest: the wait for a
  slot (when all its slots are taken: the backlog's remaining work over its slots) plus
  computing the part of the prompt it has not cached (its prefix times its ``reuse``). A
  replica whose child has reported nothing yet is taken to be as fast as its siblings; with no
  estimate at all, None (the caller keeps the rule by load, ``affinity.choose``).

A reply's expected length is the request's ``max_tokens`` when it asks for exactly that many
(``ignore_eos``), else the replica's typical reply, at most ``max_tokens``. A request that runs
longer than expected has at least ``OVERRUN_SHARE`` of its estimate left until it ends (it has
not ended, so the estimate was low: a loaded machine, a reply longer than usual); its timings
then teach the estimates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from ..http.tail import Timings
from .affinity import MISS, OVERRIDE, PREFIX_HIT, Decision, Prefix

WEIGHT: Final = 0.3  # of the newest sample in a running estimate
# A prompt computation shorter than this says more about fixed costs than about speed.
MIN_PROMPT_TOKENS: Final = 64
# A running request past its estimate is taken to have this share of it left, not none: it
# has not ended, so the estimate was low (a loaded machine, a longer reply than usual).
OVERRUN_SHARE: Final = 0.25
# Expected first-token times within this much of the cheapest (relative, plus seconds) are
# taken as equal: the longest prefix decides among them, not noise in the speeds learned.
COST_TOLERANCE: Final = 0.02
COST_TOLERANCE_S: Final = 0.02

def _blend(old: float | None, new: float) -> float:
    return new if old is None else old + WEIGHT * (new - old)


@dataclass(slots=True)
class Pace:
    """One replica's running estimates; None until its child has shown them."""

    prompt_s_per_char: float | None = None
    token_s: float | None = None  # per generated token
    reply_tokens: float | None = None  # tokens per reply
    reuse: float = 1.0  # of the prefix its table holds, the share its cache had

    def learn(self, timings: Timings, chars: int, expected_cached: int = 0) -> None:
        """Take in the timings of a completion whose prompt had ``chars`` characters, of which
        the replica's table said it held ``expected_cached``."""
        total = timings.prompt_n + timings.cache_n
        if expected_cached > 0 and total > 0:
            found = chars * timings.cache_n / total
            self.reuse = _blend(self.reuse, min(1.0, found / expected_cached))
        if timings.prompt_n >= MIN_PROMPT_TOKENS and chars > 0 and timings.prompt_ms > 0:
            computed = chars * timings.prompt_n / total  # the characters it did not have
            self.prompt_s_per_char = _blend(self.prompt_s_per_char,
                                            timings.prompt_ms / 1000.0 / computed)
        if timings.predicted_n > 0 and timings.predicted_ms > 0:
            self.token_s = _blend(self.token_s,
                                  timings.predicted_ms / 1000.0 / timings.predicted_n)
        if total > 0 or timings.predicted_n > 0:  # a completion, even of an empty reply
            self.reply_tokens = _blend(self.reply_tokens, timings.predicted_n)

    def describe(self) -> dict[str, float | None]:
        """For ``/models``: the estimates in milliseconds (per 1,000 prompt characters, per
        generated token), None where nothing was measured yet."""
        def ms(value: float | None, scale: float) -> float | None:
            return None if value is None else round(value * scale, 3)
        return {"prompt_ms_per_kchar": ms(self.prompt_s_per_char, 1e6),
                "token_ms": ms(self.token_s, 1e3),
                "reply_tokens": ms(self.reply_tokens, 1.0), "reuse": round(self.reuse, 3)}

    def reply_s(self, prefix: Prefix) -> float:
        """Expected seconds to generate the request's reply (0 while unknown)."""
        if self.token_s is None:
            return 0.0
        tokens = self.reply_tokens or 0.0
        if prefix.max_tokens is not None:
            tokens = prefix.max_tokens if prefix.to_the_end else min(tokens, prefix.max_tokens)
        return tokens * self.token_s


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's expected work on a replica (seconds), and when it got a slot."""

    work_s: float
    chars: int  # its prompt's, to learn from its timings
    cached_chars: int = 0  # of those, what the replica's table said it held
    started: float | None = None  # None: queued in the child behind the others


@dataclass(slots=True)
class Backlog:
    """The requests a replica is working on or has queued, oldest first."""

    tickets: list[Ticket] = field(default_factory=list)

    def add(self, work_s: float, chars: int, cached_chars: int, now: float,
            slots: int) -> Ticket:
        ticket = Ticket(work_s, chars, cached_chars)
        if self.running() < slots:
            ticket.started = now
        self.tickets.append(ticket)
        return ticket

    def remove(self, ticket: Ticket, now: float, slots: int) -> None:
        """``ticket``'s request ended: the oldest queued one takes its slot."""
        self.tickets.remove(ticket)
        if self.running() < slots:
            for queued in self.tickets:
                if queued.started is None:
                    queued.started = now
                    break

    def running(self) -> int:
        return sum(t.started is not None for t in self.tickets)

    def remaining(self, now: float) -> float:
        """Seconds of expected work left: what the running requests have not done yet (at
        least ``OVERRUN_SHARE`` of its estimate, for one past it) and all of the queued ones."""
        return sum(t.work_s if t.started is None
                   else max(OVERRUN_SHARE * t.work_s, t.work_s - (now - t.started))
                   for t in self.tickets)

    def wait(self, now: float, in_flight: int, slots: int) -> float:
        """Expected seconds before a new request gets a slot: none while one is free."""
        return 0.0 if in_flight < slots else self.remaining(now) / slots


@dataclass(frozen=True, slots=True)
class Option:
    """One replica as ``by_cost`` sees it."""

    match: int  # how many of the request's keys it holds (``PrefixTable.longest``)
    in_flight: int
    slots: int
    wait_s: float  # ``Backlog.wait``
    pace: Pace


@dataclass(frozen=True, slots=True)
class Choice:
    index: int
    decision: Decision
    first_token_s: float  # expected: the wait plus its prompt's uncached part
    work_s: float  # expected: its uncached prompt and its reply, for its ``Ticket``


def by_cost(options: Sequence[Option], prefix: Prefix) -> Choice | None:
    """The replica where the request's first token is expected soonest (near-ties, within
    ``COST_TOLERANCE``: the longest prefix, then the most free slots, then the first); None
    while no replica's child has shown its prompt speed. The decision: ``MISS`` when no
    replica holds a prefix of it, ``PREFIX_HIT`` when the chosen one holds the longest, else
    ``OVERRIDE``."""
    known = [o.pace.prompt_s_per_char for o in options if o.pace.prompt_s_per_char is not None]
    if not known:
        return None
    sibling = sum(known) / len(known)
    ranks: list[tuple[float, int, int, int]] = []
    for index, option in enumerate(options):
        speed = option.pace.prompt_s_per_char
        cached = prefix.sizes[option.match - 1] * option.pace.reuse if option.match else 0.0
        cost = option.wait_s + (prefix.chars - cached) * (sibling if speed is None else speed)
        ranks.append((cost, -option.match, option.in_flight - option.slots, index))
    # Costs this close are estimates that cannot tell the replicas apart: the longest prefix
    # decides among them (then the most free slots, then the first).
    cheapest = min(rank[0] for rank in ranks)
    near = cheapest * (1 + COST_TOLERANCE) + COST_TOLERANCE_S
    cost, _, _, index = min((r for r in ranks if r[0] <= near), key=lambda r: r[1:])
    chosen = options[index]
    longest = max(o.match for o in options)
    decision: Decision = (MISS if longest == 0 else PREFIX_HIT if chosen.match == longest
                          else OVERRIDE)
    pace = chosen.pace if chosen.pace.token_s is not None else _reply_pace(options)
    return Choice(index, decision, cost, cost - chosen.wait_s + pace.reply_s(prefix))


def _reply_pace(options: Sequence[Option]) -> Pace:
    """A sibling's pace of generation, for a replica that has shown none."""
    for option in options:
        if option.pace.token_s is not None:
            return option.pace
    return Pace()
