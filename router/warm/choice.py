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


def prefix_keys(keys: Any) -> tuple[int, ...]:
    """The prefix keys saved with a state (JSON ints), at most ``PREFIX_KEYS``; none where
    they are not that."""
    if isinstance(keys, list) and all(isinstance(k, int) and not isinstance(k, bool)
                                      for k in keys):
        return tuple(keys[-PREFIX_KEYS:])
    return ()


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
