"""Prefix-cache-aware routing among a model's replicas (pure: no I/O, no clock).

llama-server reuses a slot's KV cache (and, with ``--cache-ram``, prompts kept in RAM) for the
part of a new prompt that repeats a previous one. A conversation's next turn repeats all of its
previous turns, so it is cheapest on the replica that served the previous turn: the prompt is
already there and only the new messages need computing. This module decides which replica
that is, from 64-bit hashes alone (no request body is kept):

* ``request_keys``: a request's *prefix keys*, cumulative 64-bit hashes, stable across
  processes (``_mix``: saved states are labelled with them): for a chat (``messages``)
  one per message (role and content; other content, such as a list of parts, by its JSON),
  for a ``prompt`` one per block of ``BLOCK_CHARS`` characters (or ``BLOCK_TOKENS`` token
  ids). Key ``i`` stands for everything up to message (block) ``i``, so turn k+1 of a
  conversation shares its first keys with turn k. ``request_prefix`` adds what the choice by
  cost (``pace``) weighs: how many characters of prompt each key covers, and the longest reply
  the request allows.
* ``PrefixTable``: the keys a replica has seen lately, least recently used first out,
  ``TABLE_KEYS`` at most.
* ``choose``: given each replica's load and table, the replica for a request and why
  (``PREFIX_HIT``, ``MISS``, ``OVERRIDE``), by load alone: the rule among nodes
  (``placement``), and among replicas until their children have shown their speed; then
  replicas are chosen by expected cost (``pace.by_cost``).

The caller records the request's keys on the chosen replica (``PrefixTable.record``).
"""

from __future__ import annotations

import json
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from hashlib import blake2b
from typing import Any, Final, Literal, NamedTuple

BLOCK_CHARS: Final = 512  # characters per prefix key of a text prompt
BLOCK_TOKENS: Final = 128  # token ids per prefix key of a tokenized prompt
MAX_KEYS: Final = 1024  # keys per request at most: bounds the work on huge prompts
TABLE_KEYS: Final = 4096  # keys remembered per replica


Decision = Literal["prefix_hit", "miss", "override", "saved_state"]
PREFIX_HIT: Final = "prefix_hit"  # the replica that holds the longest prefix of the prompt
MISS: Final = "miss"  # no replica has seen any prefix of it: the least busy
OVERRIDE: Final = "override"  # the holder is saturated and another has a free slot
# among nodes: the node that keeps the conversation on disk, its model not loaded there
SAVED_STATE: Final = "saved_state"
DECISIONS: Final = (PREFIX_HIT, MISS, OVERRIDE, SAVED_STATE)

CHARS_PER_TOKEN: Final = 4  # what one token id of a tokenized prompt counts as in ``sizes``

_CHAT_SEED: Final = 0x6368_6174  # different seeds: a prompt never shares keys with a chat
_TEXT_SEED: Final = 0x7465_7874
_TOKEN_SEED: Final = 0x746F_6B73


class Prefix(NamedTuple):
    """A request's prompt as prefix routing sees it: its keys, the characters of prompt up to
    each key (``sizes[i]``: messages (blocks) ``0..i``; a token id counts ``CHARS_PER_TOKEN``),
    and its reply's length bound: ``max_tokens`` (None: unbounded) and whether the reply runs to
    it (``ignore_eos``)."""

    keys: tuple[int, ...]
    sizes: tuple[int, ...]
    max_tokens: int | None = None
    to_the_end: bool = False
    whole: int | None = None  # keys standing for whole messages or blocks (None: all)

    @property
    def chars(self) -> int:
        return self.sizes[-1] if self.sizes else 0

    @property
    def stable(self) -> tuple[int, ...]:
        """The keys the prompt's next turn shares: all of a chat's (one per message), a text's
        or token list's of its whole blocks only (the next turn fills the last one up)."""
        return self.keys if self.whole is None else self.keys[:self.whole]


NO_PREFIX: Final = Prefix((), ())


def request_keys(body: Mapping[str, Any]) -> tuple[int, ...]:
    """The prefix keys of a parsed JSON request body; empty when it has no prompt to key
    (embeddings, tokenize, a malformed prompt: llama-server judges those itself)."""
    return request_prefix(body).keys


def request_prefix(body: Mapping[str, Any], responses: bool = False) -> Prefix:
    """The ``Prefix`` of a parsed JSON request body (no keys: ``NO_PREFIX``); ``responses``:
    a body of OpenAI's Responses API, whose ``input`` is its prompt (a text, or items read as
    a chat's messages)."""
    messages = body.get("messages")
    if responses and type(messages) is not list and type(body.get("input")) is list:
        messages = body["input"]
    if type(messages) is list:
        keys, sizes = _chat(messages)
    else:
        prompt = body.get("input" if responses else "prompt")
        if type(prompt) is str:
            keys, sizes = _text(prompt, BLOCK_CHARS)
        elif type(prompt) is list and prompt:
            keys, sizes = _tokens(prompt, BLOCK_TOKENS)
        else:
            return NO_PREFIX
    limit = body.get("max_tokens", body.get("max_completion_tokens", body.get("n_predict")))
    max_tokens = limit if type(limit) is int and limit >= 0 else None
    whole = None
    if type(messages) is not list:  # blocks: the last one whole only at its full size
        block = BLOCK_CHARS if type(body.get("prompt")) is str else \
            BLOCK_TOKENS * CHARS_PER_TOKEN
        whole = len(keys) - (len(sizes) > 0 and (sizes[-1] - (sizes[-2] if len(sizes) > 1
                                                              else 0)) < block)
    return Prefix(keys, sizes, max_tokens,
                  max_tokens is not None and body.get("ignore_eos") is True, whole)


def _mix(previous: int, *parts: str) -> int:
    """The key after ``previous`` for ``parts``: 64 bits of a BLAKE2b digest, the same in every
    process and across restarts (Python's ``hash`` of a string is salted per process), so that
    keys saved with a conversation's state still name it after the router restarts. Each part is
    framed by its length: ("ab", "c") and ("a", "bc") differ."""
    digest = blake2b(previous.to_bytes(8, "little", signed=True), digest_size=8)
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return int.from_bytes(digest.digest(), "little", signed=True)


def _mix_ids(previous: int, ids: list[Any]) -> int:
    """``_mix`` for a block of token ids (as 64-bit integers; anything else by its JSON)."""
    try:
        data = array("q", ids).tobytes()
    except (TypeError, OverflowError):  # dicts (multimodal prompts), floats, huge ints
        return _mix(previous, _json(ids))
    digest = blake2b(previous.to_bytes(8, "little", signed=True), digest_size=8,
                     person=b"token-ids")
    digest.update(data)
    return int.from_bytes(digest.digest(), "little", signed=True)


def chat_keys(messages: list[Any]) -> tuple[int, ...]:
    """One cumulative key per message: key ``i`` hashes messages ``0..i``."""
    return _chat(messages)[0]


def text_keys(text: str, block: int = BLOCK_CHARS) -> tuple[int, ...]:
    """One cumulative key per ``block`` characters (the last block may be shorter)."""
    return _text(text, block)[0]


def token_keys(prompt: list[Any], block: int = BLOCK_TOKENS) -> tuple[int, ...]:
    """One cumulative key per ``block`` items of a tokenized prompt (ids, or anything else
    llama-server takes in a list: by its JSON when it is not hashable)."""
    return _tokens(prompt, block)[0]


def _chat(messages: list[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    keys = []
    sizes = []
    h = _CHAT_SEED
    size = 0
    for message in messages[:MAX_KEYS]:
        if type(message) is dict:
            role = message.get("role")
            content = message.get("content")
            if type(content) is str and type(role) is str:
                h = _mix(h, role, content)
                size += len(role) + len(content)
                keys.append(h)
                sizes.append(size)
                continue
        # content as parts, or null with tool_calls: the whole message by its JSON
        text = _json(message)
        h = _mix(h, text)
        size += len(text)
        keys.append(h)
        sizes.append(size)
    return tuple(keys), tuple(sizes)


def _text(text: str, block: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    keys = []
    h = _TEXT_SEED
    starts = range(0, min(len(text), block * MAX_KEYS), block)
    for start in starts:
        h = _mix(h, text[start:start + block])
        keys.append(h)
    return tuple(keys), tuple(min(start + block, len(text)) for start in starts)


def _tokens(prompt: list[Any], block: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    keys = []
    h = _TOKEN_SEED
    starts = range(0, min(len(prompt), block * MAX_KEYS), block)
    for start in starts:
        h = _mix_ids(h, prompt[start:start + block])
        keys.append(h)
    return tuple(keys), tuple(min(start + block, len(prompt)) * CHARS_PER_TOKEN
                              for start in starts)


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

    def recent(self, count: int) -> list[int]:
        """The ``count`` keys seen last, the most recent last (as ``record`` takes them)."""
        keys = list(self._keys)
        return keys[-count:] if count > 0 else []

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
    return choose_among(loads, [table.longest(keys) for table in tables] if keys
                        else [0] * len(loads))


def choose_among(loads: Sequence[tuple[int, int]], matches: Sequence[int]
                 ) -> tuple[int, Decision]:
    """``choose``, given how many keys of the request each replica holds (``matches``)."""
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
