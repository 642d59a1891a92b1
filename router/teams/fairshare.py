"""The order in which one model's waiting requests get its slots: priority classes first,
then fair share between flows inside a class (the Virtual Token Counter scheduler, VTC,
Sheng et al., OSDI '24), first come first served inside a flow.

``FairQueue`` is pure bookkeeping (no clock, no asyncio): the core's slot queue
(``core/wait``) pushes a waiting request, pops the next one when a slot frees, and tells it
what each request cost. Fair share counts weighted tokens per flow: a request's prompt tokens
when it starts (an estimate, ``Turn.cost``), corrected when it ends by what the child reports,
with each generated token weighing ``GENERATED_WEIGHT``. Among the flows of a class with
requests waiting, the one with the least service goes first.

Idle time is not banked: a flow that arrives (nothing of it waiting or running here) is lifted
to the least service of the flows active in its class, so coming back late earns no burst;
a flow's service is kept only while it may still matter (it is above that least), so memory
stays bounded by the flows active. Between two flows that stay backlogged, the service
difference stays within VTC's bound (``service_bound``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

GENERATED_WEIGHT = 2.0  # a generated token weighs two prompt tokens


def service_bound(longest_prompt: float, slot_context: float) -> float:
    """VTC's bound on the service difference between two backlogged flows of one class:
    twice the larger of the longest prompt and the context the model's slots hold at once
    (``slot_context``: with one slot, its context; VTC's batch capacity), weighted. Several
    slots widen it: a flow's requests still running are charged their real cost only as they
    end."""
    return 2 * max(longest_prompt, GENERATED_WEIGHT * slot_context)


MAX_PREEMPTIONS = 3  # a request taken back this often runs to its end the next time


@dataclass(eq=False)
class Turn:
    """One request's place: its ``flow`` in class ``rank``, its expected prompt ``cost``
    (weighted tokens); ``seq`` orders it among its flow's. ``preempt``, while it runs and
    its answer has not begun, takes its slot back (True when it did); ``preemptions``
    counts how often that happened."""

    flow: str
    rank: int
    cost: float
    seq: int = 0
    started: bool = False
    preempt: Callable[[], bool] | None = None
    preemptions: int = 0


@dataclass(eq=False)
class _Flow:
    service: float = 0.0
    running: int = 0
    waiting: deque[Turn] = field(default_factory=deque)

    @property
    def active(self) -> bool:
        return self.running > 0 or bool(self.waiting)


class FairQueue:
    """One model's requests in the router: ``running`` in its slots, ``waiting`` for one."""

    def __init__(self) -> None:
        self._flows: dict[tuple[int, str], _Flow] = {}
        self._seq = 0
        self._started: dict[Turn, None] = {}  # the running turns, oldest first
        self.running = 0
        self.running_interactive = 0  # of ``running``: turns of the highest class (rank 0)
        self.waiting = 0

    def __bool__(self) -> bool:
        return self.waiting > 0

    def service(self, flow: str, rank: int) -> float:
        """A flow's service so far in class ``rank`` (0 when it has none remembered)."""
        entry = self._flows.get((rank, flow))
        return entry.service if entry is not None else 0.0

    def backlogged(self) -> dict[int, list[float]]:
        """The service of each flow with requests waiting, by class: between any two of one
        class the difference stays within ``service_bound`` (VTC)."""
        found: dict[int, list[float]] = {}
        for (rank, _), flow in self._flows.items():
            if flow.waiting:
                found.setdefault(rank, []).append(flow.service)
        return found

    def arrive(self, turn: Turn) -> _Flow:
        """The turn's flow, lifted to the least service of its class when it was idle."""
        key = (turn.rank, turn.flow)
        flow = self._flows.get(key)
        if flow is None or not flow.active:
            floor = self._least(turn.rank, but=key)
            if flow is None:
                flow = self._flows[key] = _Flow(service=floor or 0.0)
            elif floor is not None:
                flow.service = max(flow.service, floor)
        return flow

    def start(self, turn: Turn) -> None:
        """``turn`` takes a slot now (it never waited, or it was popped): it is charged its
        expected cost."""
        self._begin(self.arrive(turn), turn)

    def push(self, turn: Turn) -> None:
        """``turn`` waits for a slot: last of its flow, or first again after it was
        preempted (its place kept)."""
        flow = self.arrive(turn)
        if turn.preemptions and turn.seq:
            flow.waiting.appendleft(turn)
        else:
            self._seq += 1
            turn.seq = self._seq
            flow.waiting.append(turn)
        self.waiting += 1

    def victim(self, turn: Turn) -> Turn | None:
        """The running turn whose slot ``turn`` may take back: of a lower class, preemptible
        (its ``preempt`` set, taken back fewer than ``MAX_PREEMPTIONS`` times), the lowest
        class first, then the one that started last (the least work lost)."""
        found: Turn | None = None
        for running in self._started:
            if (running.rank > turn.rank and running.preempt is not None
                    and running.preemptions < MAX_PREEMPTIONS
                    and (found is None or running.rank >= found.rank)):
                found = running
        return found

    def remove(self, turn: Turn) -> None:
        """A waiting ``turn`` leaves without a slot (its client left, its budget ran out)."""
        flow = self._flows.get((turn.rank, turn.flow))
        if flow is None or turn not in flow.waiting:
            return
        flow.waiting.remove(turn)
        self.waiting -= 1
        self._prune()

    def pop(self, admits: Callable[[int], bool] = lambda rank: True) -> Turn | None:
        """The next turn to take a free slot, started; None when nobody waits, or when the
        next one's class may not take it (``admits``: e.g. a slot kept for the interactive
        class, where the next turn is of a lower one: so is every turn behind it)."""
        best: tuple[int, float, int] | None = None
        chosen: _Flow | None = None
        for (rank, _), flow in self._flows.items():
            if flow.waiting:
                order = (rank, flow.service, flow.waiting[0].seq)
                if best is None or order < best:
                    best, chosen = order, flow
        if best is None or chosen is None or not admits(best[0]):
            return None
        turn = chosen.waiting.popleft()
        self.waiting -= 1
        self._begin(chosen, turn)
        return turn

    def _begin(self, flow: _Flow, turn: Turn) -> None:
        assert turn not in self._started, "a turn holds one slot at most"
        turn.started = True
        flow.running += 1
        flow.service += turn.cost
        self.running += 1
        self.running_interactive += turn.rank == 0
        self._started[turn] = None

    def end(self, turn: Turn, correction: float) -> None:
        """A started ``turn`` ended; ``correction``: what it really cost less its expected
        cost (its prompt as the child counted it, its generated tokens weighted)."""
        flow = self._flows.get((turn.rank, turn.flow))
        if flow is None or not turn.started:
            return
        turn.started = False
        flow.running -= 1
        flow.service = max(0.0, flow.service + correction)
        self.running -= 1
        self.running_interactive -= turn.rank == 0
        self._started.pop(turn, None)
        assert flow.running >= 0 and self.running == len(self._started) \
            and 0 <= self.running_interactive <= self.running, "a slot counted twice or never"
        self._prune()

    def _least(self, rank: int, but: tuple[int, str] | None = None) -> float | None:
        services = [f.service for key, f in self._flows.items()
                    if key[0] == rank and key != but and f.active]
        return min(services) if services else None

    def _prune(self) -> None:
        """Forget the idle flows whose service no longer matters: at or below the least of
        their class's active flows (they would be lifted to it), or every idle one of a class
        with none active."""
        floors: dict[int, float] = {}
        for (rank, _), flow in self._flows.items():
            if flow.active:
                floors[rank] = min(floors.get(rank, flow.service), flow.service)
        for key in [k for k, f in self._flows.items() if not f.active
                    and (k[0] not in floors or f.service <= floors[k[0]])]:
            del self._flows[key]
