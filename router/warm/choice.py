"""What warm swaps decide, as pure functions of what they read: which of a child's slots are
worth saving and which fit the store's budget, where each saved state goes back, and what a
model's saves and restores cost (``Io``, learned from the children's answers).

``swaps.WarmSwaps`` applies these decisions: it asks the children, writes, commits and
restores, and counts what happened. Nothing here does I/O or keeps state of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from .slotbook import Conversation

MIN_TOKENS = 64  # a slot holding fewer is cheaper to compute again than to save and read
PREFIX_KEYS = 1024  # a replica's prefix keys kept with its states (well within the manifest's cap)

State = TypeVar("State")


@dataclass
class Io:
    """What a model's saves and restores cost, as measured (``None``: not yet)."""

    bytes_per_token: float | None = None
    save_ms_per_byte: float | None = None
    restore_ms_per_byte: float | None = None

    def cost_ms(self, tokens: int) -> float | None:
        """The milliseconds to save and restore ``tokens``, or None while unknown."""
        if self.bytes_per_token is None or self.save_ms_per_byte is None:
            return None
        per_byte = self.save_ms_per_byte + (self.restore_ms_per_byte or 0.0)
        return tokens * self.bytes_per_token * per_byte


def worth_saving(tokens: int, prompt_tps: float | None, io: Io) -> bool:
    """Whether a slot of ``tokens`` is worth saving: at least ``MIN_TOKENS``, and computing
    it again (at ``prompt_tps`` tokens a second) would take longer than saving and restoring
    it (``io``); when either is unknown, the threshold alone decides."""
    if tokens < MIN_TOKENS:
        return False
    cost = io.cost_ms(tokens)
    if cost is None or not prompt_tps or prompt_tps <= 0:
        return True
    return tokens / prompt_tps * 1000.0 > cost


def worth_saving_of(slots: Iterable[Mapping[str, Any]], prompt_tps: float | None, io: Io
                    ) -> list[tuple[int, int]]:
    """The slots (a child's ``GET /slots``) worth saving, as (slot id, tokens), in order."""
    return [(int(slot["id"]), tokens) for slot in slots
            if isinstance(tokens := slot.get("n_prompt_tokens"), int)
            and not isinstance(tokens, bool) and worth_saving(tokens, prompt_tps, io)]


def within_budget(wanted: Sequence[tuple[int, int]], most_tokens: int | None
                  ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``wanted`` split into the slots a state may hold and those of more tokens than the
    whole budget (``most_tokens``; None: unknown, every one fits): such a file could never be
    kept, so it is never written."""
    if most_tokens is None:
        return list(wanted), []
    return ([w for w in wanted if w[1] <= most_tokens],
            [w for w in wanted if w[1] > most_tokens])


def destinations(states: Sequence[State], slot_of: Sequence[int], n_slots: int,
                 n_replicas: int) -> list[tuple[int, int, State]]:
    """Where each saved state goes back, as (replica index, slot, state), in the states'
    order: a state's number is ``replica * n_slots + slot`` (``slot_of``, one per state); a
    state of a replica the model no longer has is left out."""
    found = []
    for state, number in zip(states, slot_of, strict=True):
        index, slot = divmod(number, n_slots) if n_slots else (0, number)
        if index < n_replicas:
            found.append((index, slot, state))
    return found


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(type(k) is int for k in value)


def prefix_keys(prefix: Any) -> tuple[int, ...]:
    """The replica's recent prefix keys saved with a state (JSON ints: its ``recent``, or the
    whole value as states saved before conversations had labels), at most ``PREFIX_KEYS``;
    none where they are not that."""
    keys: Any = prefix.get("recent") if isinstance(prefix, dict) else prefix
    return tuple(keys[-PREFIX_KEYS:]) if _ints(keys) else ()


def label(conversation: Conversation | None, recent: list[int] | None) -> Any:
    """What a state keeps as its prefix: the conversation it holds (its key count, its last
    key, its owner) and the replica's recent prefix keys; None when neither is known."""
    if conversation is None or not conversation.keys:
        return recent or None
    return {"conversation": {"n": len(conversation.keys), "key": conversation.keys[-1],
                             "owner": conversation.owner},
            **({"recent": recent} if recent else {})}


def labelled(prefix: Any) -> tuple[int, int, str | None] | None:
    """A state's conversation as ``label`` kept it: (key count, last key, owner), or None."""
    found = prefix.get("conversation") if isinstance(prefix, dict) else None
    if not isinstance(found, dict):
        return None
    n, key, owner = found.get("n"), found.get("key"), found.get("owner")
    if type(n) is not int or n < 1 or type(key) is not int \
            or not (owner is None or isinstance(owner, str)):
        return None
    return n, key, owner


def covers(prefix: Any, keys: Sequence[int], owner: str | None) -> int:
    """How many of a request's ``keys`` a state labelled ``prefix`` holds, for ``owner``."""
    found = labelled(prefix)
    if found is None:
        return 0
    n, key, held_by = found
    if n > len(keys) or keys[n - 1] != key or (held_by is not None and held_by != owner):
        return 0
    return n


def supersedes(conversation: Conversation, prefix: Any) -> bool:
    """Whether a new state of ``conversation`` makes an older one labelled ``prefix`` useless:
    the older holds an earlier turn of it (a prefix of its keys), for the same owner."""
    found = labelled(prefix)
    return found is not None and found[2] == conversation.owner \
        and covers(prefix, conversation.keys, conversation.owner) > 0


def timing(answer: Mapping[str, Any], key: str) -> float | None:
    """A child's ``timings[key]`` in an action's answer (``save_ms``, ``restore_ms``), when
    it is a number of milliseconds."""
    timings = answer.get("timings")
    value = timings.get(key) if isinstance(timings, dict) else None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        and value >= 0 else None


def learn(io: Io, tokens: int, size: int, ms: float | None, step: str) -> None:
    """Fold one save's or restore's measure into ``io`` (the latest counts most)."""
    if tokens <= 0 or size <= 0:
        return
    io.bytes_per_token = _blend(io.bytes_per_token, size / tokens)
    if ms is not None:
        if step == "save":
            io.save_ms_per_byte = _blend(io.save_ms_per_byte, ms / size)
        else:
            io.restore_ms_per_byte = _blend(io.restore_ms_per_byte, ms / size)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else 0.5 * old + 0.5 * new
