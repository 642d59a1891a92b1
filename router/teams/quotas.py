"""The teams' quotas: requests at once (``max-concurrent``) and tokens a minute
(``tokens-per-minute``), each per team name, across every model.

``Quotas.admit`` is asked before a request waits for anything: over a quota it raises
``OverQuota`` with the seconds after which trying again can succeed (the edge answers 429
with ``Retry-After``), and the request never reaches a child. Else it returns the ``Hold`` the
request keeps until it ends, and ``Hold.settle`` gives back its place and settles its tokens.

Tokens a minute are a token bucket per team that fills at the rate and holds a minute's worth:
a request reserves its expected tokens (prompt and ``max_tokens``; at most a full bucket, so
no request is refused for ever) and settles with what it really used, which may leave the
bucket in debt: the next requests wait for it to fill again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .. import clock
from ..config.keyfile import KeyPolicy


class OverQuota(Exception):
    """A request over its team's quota; ``retry_after``: whole seconds to wait."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class _Account:
    running: int = 0
    tokens: float = 0.0  # in the bucket (negative: in debt)
    filled_at: float = 0.0
    capacity: int = 0


class Hold:
    """A request's place in its team's quotas, given back once by ``settle``."""

    __slots__ = ("_account", "_quotas", "reserved")

    def __init__(self, quotas: Quotas, account: _Account, reserved: float) -> None:
        self._quotas = quotas
        self._account = account
        self.reserved = reserved

    def settle(self, used_tokens: float) -> None:
        """The request ended having used ``used_tokens`` (prompt and generated)."""
        account = self._account
        if account is None:
            return
        self._account = None  # type: ignore[assignment]
        account.running -= 1
        if account.capacity:
            self._quotas.fill(account)
            account.tokens += self.reserved - used_tokens


class Quotas:
    def __init__(self, now: Callable[[], float] = clock.now) -> None:
        self._now = now
        self._accounts: dict[str, _Account] = {}

    def admit(self, policy: KeyPolicy, expected_tokens: float) -> Hold | None:
        """The hold of a request of a team with ``policy`` expecting ``expected_tokens``;
        None for a team without quotas. OverQuota when over one."""
        limit, rate = policy.max_concurrent, policy.tokens_per_minute
        if limit is None and rate is None:
            return None
        account = self._accounts.get(policy.name)
        if account is None:
            account = self._accounts[policy.name] = _Account(
                tokens=rate or 0, filled_at=self._now(), capacity=rate or 0)
        if limit is not None and account.running >= limit:
            raise OverQuota(f"team {policy.name} has {account.running} requests running or "
                            f"queued, its max-concurrent={limit}: try again when one ends", 1)
        reserved = 0.0
        if rate is not None:
            if account.capacity != rate:  # the key file changed
                account.tokens = rate if not account.capacity else min(account.tokens, rate)
                account.capacity = rate
            self.fill(account)
            reserved = min(float(expected_tokens), float(rate))
            if account.tokens < reserved:
                wait = math.ceil((reserved - account.tokens) * 60 / rate)
                raise OverQuota(f"team {policy.name} is over its tokens-per-minute={rate} "
                                f"(this request expects {expected_tokens:.0f} tokens)",
                                max(1, wait))
            account.tokens -= reserved
        account.running += 1
        return Hold(self, account, reserved)

    def fill(self, account: _Account) -> None:
        now = self._now()
        account.tokens = min(float(account.capacity), account.tokens
                             + (now - account.filled_at) * account.capacity / 60)
        account.filled_at = now
