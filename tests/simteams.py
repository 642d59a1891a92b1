"""The teams in the scheduler simulation (``simulation.py``): three teams, their quotas, and
the invariants of the slot queue's order and of the quotas.

Each simulated request belongs to one of three teams (one sends three times as many as each
other) and asks for one of the three priority classes (drawn from its number, so a seed's
draws stay the same). Before it waits for
anything it is admitted by the teams' quotas (``teams.quotas.Quotas``, as the edge's meter
does): over one it ends with 429 and never reaches a slot. Its place is given back and its
tokens settled when it ends.

Invariants, checked whenever the loop is quiescent:

* **max-concurrent**: a team never has more requests admitted and not ended than its
  ``max-concurrent``;
* **tokens a minute**: what a team used never exceeds its bucket (a minute's worth) plus what
  the rate has added since the start (each request reserves what it will use);
* **fair share** (VTC's bound): between two flows of one class with requests waiting for a
  model's slots, the service difference stays within ``service_bound`` of a prompt and of
  what the model's slots hold at once (VTC's batch capacity ``M``: a flow's requests still
  running when another becomes backlogged are charged their real cost only as they end);
* **no starvation inside a class**: while a request waits for a slot, requests of other flows
  of its class take the model's slots at most ``passed_bound`` times (what VTC's order
  allows: each one raises its flow's service by at least the cheapest request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from router.config.keyfile import KeyPolicy
from router.teams.fairshare import GENERATED_WEIGHT, Turn, service_bound
from router.teams.quotas import Hold, Quotas

PROMPT_TOKENS = 500  # what a simulated child reports for every request it served
GENERATED = 8
USED = PROMPT_TOKENS + GENERATED  # tokens a served request used
CHARGED = PROMPT_TOKENS + GENERATED_WEIGHT * GENERATED  # its service, weighted
CHEAPEST = 100.0  # the least a turn is expected to cost (``turn_of``)


def bound(capacity: int) -> float:
    """VTC's bound for a model whose slots take ``capacity`` requests at once, each holding
    at most ``USED`` tokens."""
    return service_bound(PROMPT_TOKENS, capacity * USED)


def passed_bound(capacity: int) -> int:
    """How often a waiting request's class peers of other flows (two) may take a slot before
    it: each until its flow's service passes the waiter's, from at most ``bound`` behind, at
    least ``CHEAPEST`` a time, and once more at a tie."""
    return 2 * (math.ceil((bound(capacity) + CHARGED) / CHEAPEST) + 1)

# team0 sends three requests for each of the others' and has no quota; team1 may have 3 at
# once; team2 a minute's worth of tokens (each request reserves what it uses: ``USED``)
TEAMS = ("team0", "team0", "team0", "team1", "team2")
POLICIES = {
    "team0": KeyPolicy("team0"),
    "team1": KeyPolicy("team1", quotas={"max-concurrent": 3}),
    "team2": KeyPolicy("team2", quotas={"tokens-per-minute": 8 * USED}),
}


def turn_of(number: int) -> Turn:
    """Request ``number``'s turn: its team, its class, its expected cost (drawn from its
    number: a seed's other draws stay the same)."""
    return Turn(TEAMS[number % 5], number // 5 % 3, CHEAPEST + number % 7 * 50)


@dataclass
class Waiter:
    """A request waiting for a slot: what it is, and how often others passed it."""

    model: str
    flow: str
    rank: int
    passed: int = 0


@dataclass
class TeamsBook:
    """The teams' side of a simulation run: the quotas and what the invariants read."""

    quotas: Quotas = field(default_factory=Quotas)
    admitted: dict[str, int] = field(default_factory=dict)  # admitted and not ended
    used: dict[str, float] = field(default_factory=dict)
    waiters: dict[int, Waiter] = field(default_factory=dict)  # by request number
    started_at: float = 0.0
    contended: int = 0  # waiters passed by another flow of their class at least once

    def admit(self, number: int, expected: float) -> Hold | None:
        """Request ``number`` admitted by its team's quotas (``OverQuota`` raised when not)."""
        turn = turn_of(number)
        hold = self.quotas.admit(POLICIES[turn.flow], expected)
        self.admitted[turn.flow] = self.admitted.get(turn.flow, 0) + 1
        return hold

    def settle(self, number: int, hold: Hold | None, used: float, charged: float) -> None:
        """Request ``number`` ended having ``used`` tokens (what the invariants count) and
        been ``charged`` (what its quota hold settles: the meter's charge, which may differ
        where the child counted nothing)."""
        flow = turn_of(number).flow
        self.admitted[flow] -= 1
        self.used[flow] = self.used.get(flow, 0.0) + used
        if hold is not None:
            hold.settle(charged)

    def waits(self, number: int, model: str) -> None:
        turn = turn_of(number)
        self.waiters[number] = Waiter(model, turn.flow, turn.rank)

    def leased(self, number: int, model: str, capacity: int) -> list[str]:
        """Request ``number`` took a slot of ``model`` (of ``capacity`` slots): the requests
        of its class and other flows waiting there were passed once more; what broke
        ``passed_bound``."""
        self.waiters.pop(number, None)
        turn = turn_of(number)
        broken = []
        for other, waiter in self.waiters.items():
            if waiter.model == model and waiter.rank == turn.rank and waiter.flow != turn.flow:
                waiter.passed += 1
                self.contended += waiter.passed == 1
                if waiter.passed > passed_bound(capacity):
                    broken.append(f"request {other} ({waiter.flow}, class {waiter.rank}) "
                                  f"passed {waiter.passed} times for {model}'s slots, bound "
                                  f"{passed_bound(capacity)}")
        return broken

    def gone(self, number: int) -> None:
        """Request ``number`` waits no more (it ended without a slot)."""
        self.waiters.pop(number, None)

    def violations(self, now: float,
                   backlogged: dict[str, tuple[int, dict[int, list[float]]]]) -> list[str]:
        """The quotas' and fair share's invariants now; ``backlogged``: per model, its
        capacity and the service of each flow with requests waiting, by class
        (``SlotQueue.backlogged``)."""
        found = []
        for name, policy in POLICIES.items():
            limit = policy.quotas.get("max-concurrent")
            if limit is not None and self.admitted.get(name, 0) > limit:
                found.append(f"{name} has {self.admitted[name]} requests admitted, "
                             f"max-concurrent {limit}")
            rate = policy.quotas.get("tokens-per-minute")
            if rate is not None:
                allowed = rate + rate * (now - self.started_at) / 60
                if self.used.get(name, 0.0) > allowed:
                    found.append(f"{name} used {self.used[name]:.0f} tokens, its bucket "
                                 f"allows {allowed:.0f} by now")
        for model, (capacity, classes) in backlogged.items():
            for rank, services in classes.items():
                if len(services) > 1 and max(services) - min(services) > bound(capacity):
                    found.append(f"{model}: class {rank}'s backlogged flows have service "
                                 f"{sorted(services)}, apart more than VTC's bound "
                                 f"{bound(capacity):g}")
        return found
