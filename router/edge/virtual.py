"""Virtual models: one name, several targets, one chosen per request (a preset's ``targets``
and ``choose``).

    [assistant]
    targets = qwen-small, qwen-big, gpu-box-model      ; models, profiles, or a peer's models
    choose = spillover

How a target is chosen (``choose``, pure):

* a conversation's next turn goes to the target that served its earlier turns, whose slots or
  saved states hold its prompt (the prefix keys each target served lately, ``affinity``), as
  long as that target can serve (``conversation``); it moves only when that target is gone;
* ``warm``: the first target loaded (``warm``), else the first that can serve (``first``);
* ``spillover``: the first target with a slot free and no queue deeper than its slots
  (``spillover``), else the least loaded (``least_loaded``);
* ``fallback``: the first target that can serve (``first``, then ``fallback`` for a later
  one): one that failed its last load or is crash-looping is passed over, and a request
  whose load fails is tried on the next target (``Choice.rest``).

``Virtuals`` keeps, per virtual model, what each target served lately (their prefix tables)
and which target served last and when (``/models``); the metrics count the choices by reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..config.presets import CHOOSE_FALLBACK, CHOOSE_SPILLOVER, ModelPreset
from ..serving.affinity import PrefixTable

CONVERSATION: Final = "conversation"
WARM: Final = "warm"
FIRST: Final = "first"
SPILLOVER: Final = "spillover"
LEAST_LOADED: Final = "least_loaded"
FALLBACK: Final = "fallback"


@dataclass(frozen=True, slots=True)
class Target:
    """What the choice reads of one target: its name; whether it can serve (it exists here
    and neither failed its last load nor crash-loops, or a peer that is up lists it), is
    loaded, has every slot busy, has more requests waiting than slots; its load (requests in
    flight and waiting per slot); how many of the request's prefix keys it served lately."""

    name: str
    can_serve: bool
    loaded: bool = False
    busy: bool = False
    deep: bool = False
    load: float = 0.0
    match: int = 0


@dataclass(frozen=True, slots=True)
class Choice:
    """The target chosen, why, and the targets to try next if it refuses (``fallback``)."""

    target: str
    reason: str
    rest: tuple[str, ...] = ()


def choose(policy: str, targets: Sequence[Target]) -> Choice | None:
    """The target a request goes to (module docstring); None when none can serve."""
    able = [t for t in targets if t.can_serve]
    if not able:
        return None
    held = max(able, key=lambda t: t.match)
    if held.match:
        return Choice(held.name, CONVERSATION, _after(able, held))
    if policy == CHOOSE_SPILLOVER:
        free = next((t for t in able if not t.busy and not t.deep), None)
        if free is not None:
            return Choice(free.name, SPILLOVER)
        return Choice(min(able, key=lambda t: t.load).name, LEAST_LOADED)
    if policy == CHOOSE_FALLBACK:
        first = able[0]
        return Choice(first.name, FIRST if first is targets[0] else FALLBACK,
                      _after(able, first))
    warm = next((t for t in able if t.loaded), None)
    return Choice(warm.name, WARM) if warm is not None else Choice(able[0].name, FIRST)


def _after(able: list[Target], chosen: Target) -> tuple[str, ...]:
    return tuple(t.name for t in able if t is not chosen)


@dataclass
class _Served:
    tables: dict[str, PrefixTable] = field(default_factory=dict)
    last: str | None = None
    last_reason: str | None = None
    choices: dict[str, int] = field(default_factory=dict)


class Virtuals:
    """What each virtual model's targets served lately: their prefix keys (a conversation's
    next turn follows them), the last choice, and the choices by target and reason."""

    def __init__(self) -> None:
        self._served: dict[str, _Served] = {}

    def match(self, virtual: str, target: str, keys: Sequence[int]) -> int:
        """How many of a request's prefix ``keys`` ``target`` served lately for ``virtual``."""
        served = self._served.get(virtual)
        table = served.tables.get(target) if served is not None else None
        return table.longest(keys) if table is not None and keys else 0

    def chose(self, virtual: ModelPreset, choice: Choice, keys: Sequence[int]) -> None:
        """``choice`` was made for a request to ``virtual`` with prefix ``keys``."""
        served = self._served.setdefault(virtual.id, _Served())
        served.last, served.last_reason = choice.target, choice.reason
        counted = f"{choice.target}:{choice.reason}"
        served.choices[counted] = served.choices.get(counted, 0) + 1
        if keys:
            served.tables.setdefault(choice.target, PrefixTable()).record(keys)

    def keep(self, virtuals: Sequence[ModelPreset]) -> None:
        """Forget what no longer is: the virtual models a reload removed, and the targets a
        virtual model no longer has (its ``targets`` changed)."""
        targets = {v.id: set(v.targets) for v in virtuals}
        for virtual in [v for v in self._served if v not in targets]:
            del self._served[virtual]
        for virtual, served in self._served.items():
            for target in [t for t in served.tables if t not in targets[virtual]]:
                del served.tables[target]

    def __len__(self) -> int:
        """The virtual models with a record (what ``keep`` bounds)."""
        return len(self._served)

    def describe(self, virtual: str) -> dict[str, Any]:
        """For ``/models``: the target that served last and why, and the choices so far."""
        served = self._served.get(virtual)
        if served is None or served.last is None:
            return {}
        return {"last_target": served.last, "last_reason": served.last_reason,
                "choices": dict(served.choices)}
