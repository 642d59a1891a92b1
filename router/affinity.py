"""Prefix-cache-aware routing among a model's replicas (pure: no I/O, no clock).

llama-server reuses a slot's KV cache (and, with ``--cache-ram``, prompts kept in RAM) for the
part of a new prompt that repeats a previous one. A conversation's next turn repeats all of its
previous turns, so it is cheapest on the replica that served the previous turn: the prompt is
already there and only the new messages need computing. This module decides which replica
that is, from 64-bit hashes alone (no request body is kept):

* ``request_keys``: a request's *prefix keys*, cumulative hashes: for a chat (``messages``)
  one per message (role and content; other content, such as a list of parts, by its JSON),
  for a ``prompt`` one per block of ``BLOCK_CHARS`` characters (or ``BLOCK_TOKENS`` token
  ids). Key ``i`` stands for everything up to message (block) ``i``, so turn k+1 of a
  conversation shares its first keys with turn k.
* ``PrefixTable``: the keys a replica has seen lately, least recently used first out,
  ``TABLE_KEYS`` at most.
* ``choose``: given each replica's load and table, the replica for a request and why
  (``PREFIX_HIT``, ``MISS``, ``OVERRIDE``).

The caller records the request's keys on the chosen replica (``PrefixTable.record``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

BLOCK_CHARS: Final = 512  # characters per prefix key of a text prompt
BLOCK_TOKENS: Final = 128  # token ids per prefix key of a tokenized prompt
MAX_KEYS: Final = 1024  # keys per request at most: bounds the work on huge prompts
TABLE_KEYS: Final = 4096  # keys remembered per replica

ROUTING_PREFIX: Final = "prefix"
ROUTING_LEAST_BUSY: Final = "least-busy"
ROUTINGS: Final = (ROUTING_PREFIX, ROUTING_LEAST_BUSY)

Decision = Literal["prefix_hit", "miss", "override"]
PREFIX_HIT: Final = "prefix_hit"  # the replica that holds the longest prefix of the prompt
MISS: Final = "miss"  # no replica has seen any prefix of it: the least busy
OVERRIDE: Final = "override"  # the holder is saturated and another has a free slot
DECISIONS: Final = (PREFIX_HIT, MISS, OVERRIDE)

_CHAT_SEED: Final = 0x6368_6174  # different seeds: a prompt never shares keys with a chat
_TEXT_SEED: Final = 0x7465_7874
_TOKEN_SEED: Final = 0x746F_6B73


def request_keys(body: Mapping[str, Any]) -> tuple[int, ...]:
    """The prefix keys of a parsed JSON request body; empty when it has no prompt to key
    (embeddings, tokenize, a malformed prompt: llama-server judges those itself)."""
    messages = body.get("messages")
    if type(messages) is list:
        return chat_keys(messages)
    prompt = body.get("prompt")
    if type(prompt) is str:
        return text_keys(prompt)
    if type(prompt) is list and prompt:
        return token_keys(prompt)
    return ()


def chat_keys(messages: list[Any]) -> tuple[int, ...]:
    """One cumulative key per message: key ``i`` hashes messages ``0..i``."""
    keys = []
    h = _CHAT_SEED
    for message in messages[:MAX_KEYS]:
        if type(message) is dict:
            role = message.get("role")
            content = message.get("content")
            if type(content) is str and type(role) is str:
                h = hash((h, role, content))
                keys.append(h)
                continue
        # content as parts, or null with tool_calls: the whole message by its JSON
        h = hash((h, _json(message)))
        keys.append(h)
    return tuple(keys)


def text_keys(text: str, block: int = BLOCK_CHARS) -> tuple[int, ...]:
    """One cumulative key per ``block`` characters (the last block may be shorter)."""
    keys = []
    h = _TEXT_SEED
    for start in range(0, min(len(text), block * MAX_KEYS), block):
        h = hash((h, text[start:start + block]))
        keys.append(h)
    return tuple(keys)


def token_keys(prompt: list[Any], block: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """One cumulative key per ``block`` items of a tokenized prompt (ids, or anything else
    llama-server takes in a list: by its JSON when it is not hashable)."""
    keys = []
    h = _TOKEN_SEED
    for start in range(0, min(len(prompt), block * MAX_KEYS), block):
        part = prompt[start:start + block]
        try:
            h = hash((h, tuple(part)))
        except TypeError:  # dicts (multimodal prompts), lists: unhashable
            h = hash((h, _json(part)))
        keys.append(h)
    return tuple(keys)


def _json(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # not from json.loads; keys stay usable
        return repr(type(value))


class PrefixTable:
    """The prefix keys one replica has seen lately: ``capacity`` at most, the least recently
    seen dropped first. Holds only the keys (ints), never a request."""

    __slots__ = ("_keys", "capacity")

    def __init__(self, capacity: int = TABLE_KEYS) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def longest(self, keys: Sequence[int]) -> int:
        """How many of ``keys`` the longest prefix this table holds covers (0: none).

        Scans from the longest prefix down: a follow-up turn finds its previous turn within a
        couple of lookups, and an earlier key evicted before a later one cannot hide a match.
        """
        table = self._keys
        for index in range(len(keys) - 1, -1, -1):
            if keys[index] in table:
                return index + 1
        return 0

    def record(self, keys: Sequence[int]) -> None:
        """Remember ``keys`` as just seen (the longest prefix last, so it is kept longest)."""
        table = self._keys
        for key in keys:
            if key in table:
                table.move_to_end(key)
            else:
                table[key] = None
        while len(table) > self.capacity:
            table.popitem(last=False)


def least_busy(loads: Sequence[tuple[int, int]], among: Sequence[int] | None = None) -> int:
    """The index with the most free slots (``slots - in_flight``) in ``loads`` (each
    ``(in_flight, slots)``), among ``among`` if given; ties: the first."""
    candidates = range(len(loads)) if among is None else among
    best = -1
    best_free = 0
    for index in candidates:
        in_flight, slots = loads[index]
        free = slots - in_flight
        if best < 0 or free > best_free:
            best, best_free = index, free
    return best


def choose(loads: Sequence[tuple[int, int]], tables: Sequence[PrefixTable],
           keys: Sequence[int]) -> tuple[int, Decision]:
    """The replica for a request with prefix ``keys``, and the decision that chose it.

    ``loads[i]`` is replica i's ``(in_flight, slots)`` and ``tables[i]`` its keys. The replica
    holding the longest prefix of the request wins (ties: the least busy of them, then the
    first), unless it is saturated (``in_flight >= slots``) while another replica has a free
    slot: then the least busy of those with a free slot (``OVERRIDE``). No prefix anywhere:
    the least busy (``MISS``). Every replica saturated: the holder still wins; a queue there
    costs no more than one elsewhere, and its cache is there.
    """
    matches = [table.longest(keys) for table in tables] if keys else [0] * len(loads)
    longest = max(matches, default=0)
    if longest == 0:
        return least_busy(loads), MISS
    holder = least_busy(loads, [i for i, m in enumerate(matches) if m == longest])
    in_flight, slots = loads[holder]
    if in_flight >= slots:
        free = [i for i, (busy, size) in enumerate(loads) if busy < size]
        if free:
            return least_busy(loads, free), OVERRIDE
    return holder, PREFIX_HIT
