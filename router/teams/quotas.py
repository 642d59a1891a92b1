"""The teams' quotas: requests at once (``max-concurrent``) and tokens a minute
(``tokens-per-minute``), each per team name, across every model.

The kinds of quota are one list (``QUOTA_KINDS``): each a class (a ``QuotaKind``) that names
its key-file field (``keyfile.QUOTA_FIELDS``, where the key file's grammar lists the same
names) and says how it admits a request, counts it and settles it; an instance is one team's
account of that kind. A new kind is one class and one entry of the list: ``Quotas`` and the
edge read nothing else.

``Quotas.admit`` is asked before a request waits for anything: over a quota it raises
``OverQuota`` with the seconds after which trying again can succeed (the edge answers 429
with ``Retry-After``), and the request never reaches a child. Else it returns the ``Hold`` the
request keeps until it ends, and ``Hold.settle`` gives back its place and settles its tokens.
A kind that meters tokens says how many one request may generate (``QuotaKind.allowance``):
the edge caps a completion's generation at the least of them (``Quotas.allowance``).

Tokens a minute are a token bucket per team that fills at the rate and holds a minute's worth:
a request reserves its expected tokens (prompt and ``max_tokens``; at most a full bucket, so
no request is refused for ever) and settles with what it really used, which may leave the
bucket in debt: the next requests wait for it to fill again.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from .. import clock
from ..config.keyfile import KeyPolicy


class OverQuota(Exception):
    """A request over its team's quota; ``retry_after``: whole seconds to wait."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class QuotaKind:
    """A kind of quota: ``field``, the key file's name for its limit; an instance is one
    team's account of it, made (at ``now``) when the team's first request under any quota is
    admitted, and kept while the router runs.

    A request is asked of every kind in the list's order: ``admit`` says what it reserves or
    raises ``OverQuota``, changing nothing that a refusal would have to undo; once every kind
    admits it, each ``take``s it, and each ``settle``s it when it ends. A ``limit`` of None
    (the team has no such quota now) admits every request, yet the kind still counts it: a
    limit that a reloaded key file sets finds the requests in flight."""

    field: ClassVar[str]

    def __init__(self, now: float) -> None:
        pass

    def admit(self, team: str, limit: int | None, expected_tokens: float, now: float) -> float:
        """What a request of ``team`` expecting ``expected_tokens`` reserves (0.0: nothing);
        OverQuota when it is over ``limit``."""
        return 0.0

    def take(self, reserved: float, now: float) -> None:
        """Count an admitted request, with what it reserved."""

    def settle(self, reserved: float, used_tokens: float, now: float) -> None:
        """A request it took ended, having used ``used_tokens`` (prompt and generated)."""

    @staticmethod
    def allowance(limit: int, prompt_tokens: float) -> float | None:
        """The tokens one request with ``prompt_tokens`` may generate under ``limit`` (None:
        the kind meters no tokens)."""
        return None


class MaxConcurrent(QuotaKind):
    """Requests of the team queued or running at once."""

    field = "max-concurrent"

    def __init__(self, now: float) -> None:
        self.running = 0

    def admit(self, team: str, limit: int | None, expected_tokens: float, now: float) -> float:
        if limit is not None and self.running >= limit:
            raise OverQuota(f"team {team} has {self.running} requests running or queued, its "
                            f"max-concurrent={limit}: try again when one ends", 1)
        return 0.0

    def take(self, reserved: float, now: float) -> None:
        self.running += 1

    def settle(self, reserved: float, used_tokens: float, now: float) -> None:
        self.running -= 1


class TokensPerMinute(QuotaKind):
    """Prompt and generated tokens a minute: a token bucket that fills at the rate and holds
    a minute's worth (``tokens`` negative: in debt)."""

    field = "tokens-per-minute"

    def __init__(self, now: float) -> None:
        self.tokens = 0.0
        self.filled_at = now
        self.capacity = 0  # the rate it fills at (0: the team never had one)

    def admit(self, team: str, limit: int | None, expected_tokens: float, now: float) -> float:
        if limit is None:
            return 0.0
        if self.capacity != limit:  # the key file changed
            self.tokens = limit if not self.capacity else min(self.tokens, limit)
            self.capacity = limit
        self._fill(now)
        reserved = min(float(expected_tokens), float(limit))
        if self.tokens < reserved:
            wait = math.ceil((reserved - self.tokens) * 60 / limit)
            raise OverQuota(f"team {team} is over its tokens-per-minute={limit} "
                            f"(this request expects {expected_tokens:.0f} tokens)", max(1, wait))
        return reserved

    def take(self, reserved: float, now: float) -> None:
        self.tokens -= reserved

    def settle(self, reserved: float, used_tokens: float, now: float) -> None:
        if self.capacity:
            self._fill(now)
            self.tokens += reserved - used_tokens

    @staticmethod
    def allowance(limit: int, prompt_tokens: float) -> float | None:
        return limit - prompt_tokens  # one request, one minute's worth

    def _fill(self, now: float) -> None:
        self.tokens = min(float(self.capacity),
                          self.tokens + (now - self.filled_at) * self.capacity / 60)
        self.filled_at = now


# The kinds of quota, in the order a request is asked of them (the first over its limit
# answers); their fields are the key file's ``keyfile.QUOTA_FIELDS``, in the same order.
QUOTA_KINDS: tuple[type[QuotaKind], ...] = (MaxConcurrent, TokensPerMinute)


@dataclass(frozen=True)
class Allowance:
    """What a team's quotas let one request generate: ``tokens`` (may be under 1), under
    ``quota``, as the key file spells it (``tokens-per-minute=300``)."""

    tokens: float
    quota: str


class Hold:
    """A request's place in its team's quotas, given back once by ``settle``."""

    __slots__ = ("_accounts", "_now", "reserved")

    def __init__(self, accounts: tuple[QuotaKind, ...], reserved: tuple[float, ...],
                 now: Callable[[], float]) -> None:
        self._accounts: tuple[QuotaKind, ...] | None = accounts
        self.reserved = reserved  # what each kind's account reserved for it
        self._now = now

    def settle(self, used_tokens: float) -> None:
        """The request ended having used ``used_tokens`` (prompt and generated)."""
        accounts = self._accounts
        if accounts is None:
            return
        self._accounts = None
        now = self._now()
        for account, reserved in zip(accounts, self.reserved, strict=True):
            account.settle(reserved, used_tokens, now)


class Quotas:
    """Each team's accounts of the ``kinds`` of quota (``QUOTA_KINDS`` unless given)."""

    def __init__(self, now: Callable[[], float] = clock.now,
                 kinds: Sequence[type[QuotaKind]] | None = None) -> None:
        self._now = now
        self.kinds = tuple(QUOTA_KINDS if kinds is None else kinds)
        self._accounts: dict[str, tuple[QuotaKind, ...]] = {}

    def admit(self, policy: KeyPolicy, expected_tokens: float) -> Hold | None:
        """The hold of a request of a team with ``policy`` expecting ``expected_tokens``;
        None for a team without quotas. OverQuota when over one."""
        limits = [policy.quotas.get(kind.field) for kind in self.kinds]
        if all(limit is None for limit in limits):
            return None
        now = self._now()
        accounts = self._accounts.get(policy.name)
        if accounts is None:
            accounts = self._accounts[policy.name] = tuple(kind(now) for kind in self.kinds)
        reserved = tuple(account.admit(policy.name, limit, expected_tokens, now)
                         for account, limit in zip(accounts, limits, strict=True))
        for account, amount in zip(accounts, reserved, strict=True):
            account.take(amount, now)
        return Hold(accounts, reserved, self._now)

    def allowance(self, policy: KeyPolicy, prompt_tokens: float) -> Allowance | None:
        """What one request of a team with ``policy`` and ``prompt_tokens`` may generate: the
        least its kinds that meter tokens allow; None where none does."""
        least = None
        for kind in self.kinds:
            limit = policy.quotas.get(kind.field)
            tokens = None if limit is None else kind.allowance(limit, prompt_tokens)
            if tokens is not None and (least is None or tokens < least.tokens):
                least = Allowance(tokens, f"{kind.field}={limit}")
        return least
