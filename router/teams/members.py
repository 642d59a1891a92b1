"""Who a request is for: its team, its flow among the team's, its priority class.

Decided once, where its API key is matched (``edge/keys``), and read by every decision after:
the slot queue (``fairshare``), the quotas and the usage (``quotas``, ``usage``).

* The team is the key's ``name=`` (``keyfile.KeyPolicy``); the keys given with ``--api-key``
  are ``admin``; a router without keys has one team, ``anonymous``.
* The flow is what fair share is counted by: the team, or for a request with a key of
  ``role=admin``, ``team/ID`` with the ``FAIRNESS_HEADER`` it sends (llm-d's header: a gateway
  in front of the router names its own users). The header is ignored from any other key, and
  from a router without keys, where nobody is known.
* The class is the key's ``priority=``, or a lower one that the request asks for with
  ``PRIORITY_HEADER``; asking for a higher one is refused (403), never quietly lowered.

A request this router sends on to a peer carries what was decided here (``forwarded``): its
flow as the fairness id and its class, in place of whatever the client sent (the peer honours
the flow only if this router's key is an admin key there, and caps the class at that key's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ..config.keyfile import ANONYMOUS, PRIORITIES, UNLIMITED, KeyPolicy

FAIRNESS_HEADER = b"x-llm-d-inference-fairness-id"
PRIORITY_HEADER = b"x-llama-router-priority"
FAIRNESS_ID_MAX = 256
_FAIRNESS_ID = re.compile(rb"[\x21-\x7e]{1,%d}" % FAIRNESS_ID_MAX)  # printable ASCII, no spaces


class MemberError(ValueError):
    """A header naming a class or a flow the request may not have; ``status``: 400 or 403."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class Member:
    """A request's team (``name``), its ``flow``, its class ``rank`` (0: interactive) and the
    team's ``policy`` (its quotas)."""

    name: str
    flow: str
    rank: int
    policy: KeyPolicy

    @property
    def priority(self) -> str:
        return PRIORITIES[self.rank]


NOBODY = Member(ANONYMOUS, ANONYMOUS, UNLIMITED.priority, UNLIMITED)


def member_of(policy: KeyPolicy, admin: bool, headers: dict[bytes, bytes]) -> Member:
    """The member a request with a key of ``policy`` (``admin``: its role is admin) and these
    ``headers`` is; MemberError for a class above the key's or a malformed header."""
    rank = policy.priority
    asked = headers.get(PRIORITY_HEADER)
    if asked is not None:
        rank = _asked_rank(asked, policy)
    flow = policy.name
    fairness = headers.get(FAIRNESS_HEADER) if admin else None
    if fairness is not None:
        if not _FAIRNESS_ID.fullmatch(fairness):
            raise MemberError(f"{FAIRNESS_HEADER.decode()} must be 1 to {FAIRNESS_ID_MAX} "
                              "printable ASCII characters without spaces", 400)
        flow = f"{policy.name}/{fairness.decode('ascii')}"
    if rank == policy.priority and flow == policy.name:
        return _plain(policy)
    return Member(policy.name, flow, rank, policy)


def _asked_rank(asked: bytes, policy: KeyPolicy) -> int:
    word = asked.strip().lower().decode("latin-1")
    if word not in PRIORITIES:
        raise MemberError(f"{PRIORITY_HEADER.decode()} must be one of "
                          f"{', '.join(PRIORITIES)}", 400)
    rank = PRIORITIES.index(word)
    if rank < policy.priority:
        raise MemberError(f"this API key (name={policy.name}) may ask for priority "
                          f"{PRIORITIES[policy.priority]} or lower, not {word}", 403)
    return rank


def forwarded(member: Member) -> list[tuple[bytes, bytes]]:
    """The headers telling a peer who a request is for, as decided here."""
    return [(FAIRNESS_HEADER, member.flow[:FAIRNESS_ID_MAX].encode("ascii")),
            (PRIORITY_HEADER, member.priority.encode("ascii"))]


@lru_cache(maxsize=4096)
def _plain(policy: KeyPolicy) -> Member:
    """The member of a request asking nothing of its own: one per policy, made once."""
    return Member(policy.name, policy.name, policy.priority, policy)
