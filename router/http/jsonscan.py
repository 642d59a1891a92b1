"""What the router reads of a JSON request body without building it (``scan``): its top-level
``model``, where that value lies, where the object closes, and how deep it nests.

A body over ``requests.SMALL_JSON_BYTES`` is never turned into Python objects: JSON of many
small values takes 30 to 60 times its size as objects, and parsing it holds the event loop
for the whole body (a 64 MiB body of ``{},`` grew the router by 2 GiB; 16 MiB of deep nests
held the loop 25 s). ``scan`` walks only the body's strings and brackets, finding each with C
code (``bytes.find``, one regex), and gives the event loop a turn after every
``SLICE_BYTES`` it passed over; its memory is a few objects, whatever the body.

It also reads the top-level fields the router's policies decide on (``POLICY_FIELDS``: whether
the request streams, its generation limit, its slot, its response fields), each as the value a
parser would build for a number, a literal or a string, ``COMPOUND`` for an array or object
(``Scanned.fields``), so that a large body is decided on exactly as a small one that is parsed.

What it reads, on valid JSON, is what a parser reads (Python's ``json``, llama-server's
nlohmann::json): a top-level key is compared after its escapes are decoded
(``"mod\\u0065l"`` is ``model``), and of two ``model`` keys the last wins. What it does not
check (numbers, literals, commas and colons, the escapes of other strings) makes a body that
llama-server refuses with its own 400; no invalid body reads as another model there.

Bounds, each refused with its envelope before anything acts on the body: arrays and objects
nested deeper than ``MAX_JSON_DEPTH`` (400), more than ``MAX_MARKS`` quotes, brackets and
backslashes in all (413: the walk's Python steps are bounded by them), a ``model`` value
longer than ``MAX_MODEL_BYTES`` (400).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from itertools import accumulate, count
from operator import sub
from typing import Any, Final

from ..errors import MalformedBody, NestedTooDeeply, PayloadTooLarge

# Arrays and objects nested deeper than this are refused, in every JSON a client sends: far
# past what any API request holds, far below the interpreter's recursion limit.
MAX_JSON_DEPTH = 256
SLICE_BYTES = 4 << 20  # bytes walked between two turns of the event loop
MAX_MARKS = 4_000_000  # quotes, brackets and backslashes in one body
MAX_MODEL_BYTES = 64 * 1024  # a model name, as written in the body
_LONGEST_MODEL_KEY = len('"' + "\\u006d" * 5 + '"')  # "model" with every letter escaped

# The top-level fields read besides ``model`` (``Scanned.fields``): those a policy decides on.
POLICY_FIELDS = frozenset({"stream", "max_tokens", "max_completion_tokens", "n_predict",
                           "max_output_tokens", "id_slot", "response_fields", "ignore_eos",
                           "keep_alive"})
_LONGEST_FIELD_KEY = 2 + 6 * max(map(len, POLICY_FIELDS))  # every letter escaped
_MAX_FIELD_STRING = 4096  # a policy field's string value longer than this reads as COMPOUND
COMPOUND: Final = "<compound>"  # an array or object value (or a long string) of a field
_SCALAR = re.compile(rb"-?[0-9][0-9.eE+-]{0,63}|true|false|null")

_BRACKET = re.compile(rb"[\[\]{}]")
_SPACE = re.compile(rb"[ \t\r\n]*")
_OPEN = frozenset(b"[{")


@dataclass(frozen=True, slots=True)
class Scanned:
    """A JSON object body as routing reads it.

    * ``model``: its top-level ``model`` when that (the last such key) is a non-empty string;
      None for none, or a value of another type;
    * ``model_span``: where that string value lies, its quotes included (a rename writes
      there); None when there is no string ``model``;
    * ``close``: the offset of the object's closing brace (a rename adds ``model`` there);
    * ``empty``: the object has no key;
    * ``fields``: the top-level ``POLICY_FIELDS`` it has, each the last such key's value as a
      parser builds a number, literal or string (``COMPOUND`` for an array or object).
    """

    model: str | None
    model_span: tuple[int, int] | None
    close: int
    empty: bool
    fields: Mapping[str, Any] = field(default_factory=dict)

    def with_model(self, body: bytes, model: str) -> bytes:
        """``body`` naming ``model``: its string ``model`` value replaced, else ``model``
        added as the object's last key (the one a parser keeps); every other byte kept."""
        value = json.dumps(model, ensure_ascii=False).encode()
        if self.model_span is not None:
            start, end = self.model_span
            return body[:start] + value + body[end:]
        return add_key(body, self.close, self.empty, "model", value)


_WHITESPACE = b" \t\r\n"  # JSON's whitespace


def object_end(body: bytes) -> int | None:
    """Where the closing brace of ``body``, a JSON object already read as one
    (``requests.parse_json``), lies: its last byte but whitespace, so nothing is scanned.
    None for a body not in UTF-8 (UTF-16 and UTF-32 read as JSON too)."""
    end = len(body.rstrip(_WHITESPACE)) - 1
    if end < 1 or body[end] != 0x7D or body.lstrip(_WHITESPACE)[:1] != b"{":
        return None
    return end


def add_key(body: bytes, end: int, empty: bool, name: str, value: bytes) -> bytes:
    """``body`` with the key ``name`` (which it must not have) added as the last of the
    object closing at ``end`` (``object_end``; ``empty``: it has no key), ``value`` JSON
    already; every other byte kept."""
    return body[:end] + (b"" if empty else b", ") + json.dumps(name).encode() + b": " \
        + value + body[end:]


async def scan(body: bytes) -> Scanned:
    """``body`` read as a JSON object (see the module docstring), the event loop given a turn
    every ``SLICE_BYTES``."""
    walk = _walk(body)
    while (found := _step(walk)) is None:  # noqa: ASYNC110 (a turn for others, no event)
        await asyncio.sleep(0)
    return found


def scan_now(body: bytes) -> Scanned:
    """``scan`` at once, for a body small enough to read in one go."""
    walk = _walk(body)
    while (found := _step(walk)) is None:
        pass
    return found


def _step(walk: Generator[None, None, Scanned]) -> Scanned | None:
    """One step of the walk: its result once it has ended, else None."""
    try:
        next(walk)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    return None


def _walk(body: bytes) -> Generator[None, None, Scanned]:
    """The scan, yielding where the event loop may run: after every ``SLICE_BYTES`` passed
    over, and after every ``RUN`` bytes of brackets counted."""
    yield from _count_marks(body)
    size = len(body)
    pos = yield from _after_space(body, 0)
    if pos >= size or body[pos] != ord("{"):
        raise MalformedBody("request body must be a JSON object")
    state = _State()
    while True:
        window = min(size, pos + SLICE_BYTES)
        stop = yield from _brackets(body, pos, window, state)
        if stop is None:  # nothing but brackets and other bytes up to the window's end
            if window >= size:
                raise MalformedBody("request body is not valid JSON: it ends inside an "
                                    "object or array")
            pos = window
            yield
        elif body[stop] == ord('"'):
            pos = yield from _string(body, stop, state)
        else:  # the top-level object closed at ``stop``
            rest = yield from _after_space(body, stop + 1)
            if rest != size:
                raise MalformedBody("request body is not valid JSON: more follows the "
                                    "top-level object")
            return Scanned(state.model, state.span, stop, state.empty, state.fields)




class _State:
    """What the walk has read so far."""

    __slots__ = ("depth", "empty", "fields", "model", "span")

    def __init__(self) -> None:
        self.depth = 0
        self.fields: dict[str, Any] = {}
        self.model: str | None = None
        self.span: tuple[int, int] | None = None
        self.empty = True


def _brackets(body: bytes, pos: int, window: int, state: _State
              ) -> Generator[None, None, int | None]:
    """Count the brackets from ``pos`` up to the first quote before ``window`` (returned),
    or up to the top-level object's close (returned); None when neither came first.

    The brackets between two strings are counted in C (``bytes.translate``, ``accumulate``),
    ``RUN`` bytes at a time: the depth after each is the opening ones so far less the closing
    ones, checked against ``MAX_JSON_DEPTH``; only the run where the object closes is walked
    one bracket at a time (``_close``), to find where."""
    quote = body.find(b'"', pos, window)
    end = window if quote < 0 else quote
    for start in range(pos, end, RUN):
        stop = min(start + RUN, end)
        brackets = body[start:stop].translate(None, _NOT_BRACKET)
        if not brackets:
            continue
        depths = list(map(sub, accumulate(brackets.translate(_RISE)), count(1)))
        if state.depth + max(depths) > MAX_JSON_DEPTH:
            raise NestedTooDeeply(f"request body is nested too deeply to read (more than "
                                  f"{MAX_JSON_DEPTH} levels of arrays and objects)")
        if state.depth + min(depths) <= 0:  # the object closes in this run: find where
            return _close(body, start, stop, state)
        state.depth += depths[-1]
        yield
    return None if quote < 0 else quote


RUN = 1 << 12  # bytes whose brackets are counted between two turns of the event loop
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_RISE = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # an opening bracket 2, a closing 0


def _close(body: bytes, pos: int, end: int, state: _State) -> int:
    """Where the top-level object closes between ``pos`` and ``end`` (no quote there),
    walked one bracket at a time from ``state.depth``."""
    for found in _BRACKET.finditer(body, pos, end):
        state.depth += 1 if body[found.start()] in _OPEN else -1
        if state.depth == 0:
            return found.start()
    raise AssertionError("the object closes in this run")  # (its depths said so)


def _string(body: bytes, at: int, state: _State) -> Generator[None, None, int]:
    """Past the string that starts at ``at``: when it is a key of the top-level object, its
    value too if the key is ``model`` (a string value is read, any other means no model)."""
    end = _string_end(body, at + 1) + 1
    if state.depth != 1:
        return end
    after = yield from _after_space(body, end)
    if after >= len(body) or body[after] != ord(":"):
        return end  # a value of the top-level object, not a key
    state.empty = False
    if not _is_model_key(body, at, end - 1):
        name = _field_name(body, at, end - 1)
        if name is None:
            return end
        value_at = yield from _after_space(body, after + 1)
        return _field_value(body, value_at, name, state)
    value_at = yield from _after_space(body, after + 1)
    if value_at < len(body) and body[value_at] == ord('"'):
        value_end = _string_end(body, value_at + 1) + 1
        state.model = _model_value(body, value_at, value_end)
        state.span = value_at, value_end
        return value_end
    state.model = state.span = None  # a number, a literal, an array or an object
    return value_at


def _count_marks(body: bytes) -> Generator[None, None, None]:
    marks = 0
    for start in range(0, len(body), SLICE_BYTES):
        end = start + SLICE_BYTES
        marks += (body.count(b'"', start, end) + body.count(b"[", start, end)
                  + body.count(b"{", start, end) + body.count(b"\\", start, end))
        if marks > MAX_MARKS:
            raise PayloadTooLarge(f"request body holds more than {MAX_MARKS} quotes, brackets "
                                  "and backslashes: too many JSON values to read")
        yield


def _after_space(body: bytes, pos: int) -> Generator[None, None, int]:
    """The offset of the first byte at or after ``pos`` that is no JSON whitespace."""
    while True:
        end = _SPACE.match(body, pos, pos + SLICE_BYTES).end()  # type: ignore[union-attr]
        if end < pos + SLICE_BYTES or end >= len(body):
            return end
        pos = end
        yield


def _string_end(body: bytes, pos: int) -> int:
    """The offset of the quote that ends the string whose text starts at ``pos``. Linear in
    the string: the next quote is searched again only when an escape took the last one."""
    quote = body.find(b'"', pos)
    while True:
        if quote < 0:
            raise MalformedBody("request body is not valid JSON: a string does not end")
        backslash = body.find(b"\\", pos, quote)
        if backslash < 0:
            return quote
        pos = backslash + 2  # the escaped character, whatever it is, is the string's
        if pos > quote:
            quote = body.find(b'"', pos)


def _decoded(raw: bytes) -> str:
    try:
        text = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedBody(f"request body is not valid JSON: {exc}") from None
    assert isinstance(text, str)
    return text


def _is_model_key(body: bytes, start: int, end: int) -> bool:
    """Whether the key written from ``start`` to ``end`` (its quotes) is ``model``."""
    if end - start + 1 > _LONGEST_MODEL_KEY:
        return False
    raw = body[start:end + 1]
    return raw == b'"model"' or (b"\\" in raw and _decoded(raw) == "model")


def _field_name(body: bytes, start: int, end: int) -> str | None:
    """The ``POLICY_FIELDS`` name the key written from ``start`` to ``end`` (its quotes) is,
    its escapes decoded; None for any other key."""
    if end - start + 1 > _LONGEST_FIELD_KEY:
        return None
    raw = body[start:end + 1]
    name = _decoded(raw) if b"\\" in raw else raw[1:-1].decode("utf-8", "replace")
    return name if name in POLICY_FIELDS else None


def _field_value(body: bytes, at: int, name: str, state: _State) -> int:
    """Read the value of field ``name`` starting at ``at`` into ``state.fields``; where the
    walk goes on: past a string, number or literal, or at an array's or object's opening
    bracket (the walk counts its brackets)."""
    if at >= len(body):
        return at
    first = body[at]
    if first == ord('"'):
        value_end = _string_end(body, at + 1) + 1
        state.fields[name] = _decoded(body[at:value_end]) \
            if value_end - at <= _MAX_FIELD_STRING else COMPOUND
        return value_end
    if first in _OPEN:
        state.fields[name] = COMPOUND
        return at
    scalar = _SCALAR.match(body, at)
    if scalar is None:
        raise MalformedBody(f'request body is not valid JSON: the value of "{name}"')
    try:
        state.fields[name] = json.loads(scalar.group())
    except ValueError:
        raise MalformedBody(f'request body is not valid JSON: the value of "{name}"') from None
    return scalar.end()


def _model_value(body: bytes, start: int, end: int) -> str | None:
    if end - start > MAX_MODEL_BYTES:
        raise MalformedBody(f'"model" is longer than {MAX_MODEL_BYTES} bytes: no model is')
    return _decoded(body[start:end]) or None
