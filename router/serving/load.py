"""What runs on a model's children: its load, one record a model and one a replica, written by
the leases alone (``leases``; declared in ``docs/architecture.toml``).

* ``ModelLoad``: the model's requests in flight, across its replicas, and the clock time a
  request last took or gave back one.
* ``Replica``: one child that serves the model, with its load: its requests in flight, the
  prompt prefixes it served lately (``affinity``), how fast it computes and the expected work
  of the prefix-routed requests it holds (``pace``), and what its slots hold (``book``, for a
  model that keeps its conversations).

A model's requests in flight are the sum of its replicas' (a replica that left its model, a
crash or a replacement, still counts until its last request ends): ``Leases.take`` and
``Leases.release`` change both in one step and assert it.

The core's record of a model (``core.runtime.ModelRuntime``) holds these, and is what the
leases are handed as a ``Served``: the few things of a model the serving part reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..children.backend import Backend
from ..config.presets import ModelPreset
from ..warm.slotbook import Conversation, SlotBook
from ..warm.swaps import WarmSwaps
from .affinity import PrefixTable
from .pace import Backlog, Pace


@dataclass(eq=False, slots=True)
class ModelLoad:
    """A model's requests in flight and the clock time a request last took or released one.
    Read live through the model's record and its published snapshot."""

    in_flight: int = 0
    used_at: float = 0.0


@dataclass(eq=False)
class Replica:
    """One child serving a model, and its load."""

    child: Backend
    in_flight: int = 0
    # Prefix keys of the prompts it served lately (``affinity``); a new child starts empty,
    # as its KV cache does.
    prefixes: PrefixTable = field(default_factory=PrefixTable)
    # How fast its child computes prompts and replies (learned from its responses' timings),
    # and the expected work of the prefix-routed requests it holds (``pace``).
    pace: Pace = field(default_factory=Pace)
    backlog: Backlog = field(default_factory=Backlog)
    # What its slots hold, for a model that keeps its conversations (``placement``).
    book: SlotBook | None = None


class Served(Protocol):
    """A model as the serving part reads it (``core.runtime.ModelRuntime``)."""

    @property
    def id(self) -> str: ...

    @property
    def preset(self) -> ModelPreset: ...

    @property
    def load(self) -> ModelLoad: ...

    @property
    def replicas(self) -> tuple[Replica, ...]: ...

    @property
    def slots(self) -> int: ...

    @property
    def loaded(self) -> bool: ...

    @property
    def serving(self) -> bool: ...

    @property
    def has_slots(self) -> bool: ...


def new_replica(child: Backend, learned: Sequence[int] = (), book: SlotBook | None = None
                ) -> Replica:
    """A replica of a child that starts serving: its prefix table holds ``learned``, the
    keys of the states restored into it (``warm``), or nothing, as its KV cache does; its
    slots' ``book``, for a model that keeps its conversations."""
    replica = Replica(child, book=book)
    if learned:
        replica.prefixes.record(learned)
    return replica


def book_of(preset: ModelPreset, warm: WarmSwaps | None,
            held: Sequence[tuple[int, Conversation | None, int]] = ()) -> SlotBook | None:
    """The slots' book of a new replica of a model with ``preset``, when it can keep its
    conversations (warm swaps cover it), holding what was restored into it (``held``: slot,
    conversation, tokens)."""
    if warm is None or not warm.covers(preset):
        return None
    book = SlotBook(preset.slots, warm.fingerprint_of(preset))
    for slot, conversation, tokens in held:
        if 0 <= slot < book.n_slots and (conversation is not None or tokens > 0):
            book.holding(slot, conversation, tokens)
    return book
