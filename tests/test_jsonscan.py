"""A big JSON body read without building it (``router.http.jsonscan``): it reads what a parser
reads (Hypothesis against ``json.loads``: the model, duplicates, escaped keys, strings full
of brackets and quotes), refuses what is too deep or holds too many values, renames a model
keeping every other byte, and, on a body of the largest size the router takes, neither holds
the event loop nor allocates more than a few objects.
"""

from __future__ import annotations

import asyncio
import json
import time
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config.settings import DEFAULT_MAX_BODY_BYTES
from router.errors import MalformedBody, NestedTooDeeply, PayloadTooLarge
from router.http import jsonscan
from router.http.jsonscan import Scanned, scan, scan_now
from router.http.requests import SMALL_JSON_BYTES, RequestContext
from tests.test_parse_once import nesting  # the nesting of a parsed value, as measured there

TRICKY = st.lists(st.sampled_from(['[', '{', ']', '}', '\\', '"', 'a', ':', ',', '\n', 'é',
                                   'model', '\x00']), max_size=6).map("".join)
VALUES = st.recursive(st.none() | st.integers() | st.booleans() | TRICKY,
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(TRICKY, inner, max_size=3), max_leaves=20)
KEYS = st.sampled_from(['"model"', '"mod\\u0065l"', '"\\u006d\\u006f\\u0064\\u0065\\u006c"',
                        '"Model"', '"model "', '"x"', '"mo\\"del"'])


def parsed_model(body: bytes) -> str | None:
    model = json.loads(body).get("model")
    return model if isinstance(model, str) and model else None


@st.composite
def objects(draw: st.DrawFn) -> bytes:
    """A JSON object written by hand: keys that may repeat or be escaped spellings of
    ``model``, any values, any whitespace."""
    space = draw(st.sampled_from(["", " ", "\n\t ", "  \r\n"]))
    members = []
    for _ in range(draw(st.integers(0, 5))):
        key = draw(KEYS)
        value = json.dumps(draw(VALUES), ensure_ascii=draw(st.booleans()))
        members.append(f"{space}{key}{space}:{space}{value}{space}")
    return f"{space}{{{','.join(members)}}}{space}".encode()


@settings(max_examples=500, deadline=None)
@given(objects())
def test_the_scan_reads_the_model_a_parser_reads(body: bytes) -> None:
    scanned = scan_now(body)
    assert scanned.model == parsed_model(body)
    assert scanned.empty == (json.loads(body) == {})


@settings(max_examples=300, deadline=None)
@given(objects(), st.text(max_size=8))
def test_a_rename_names_the_model_and_keeps_the_rest(body: bytes, name: str) -> None:
    renamed = scan_now(body).with_model(body, name)
    assert json.loads(renamed) == {**json.loads(body), "model": name}


def test_the_rename_writes_only_the_name() -> None:
    body = b'{ "model":"a" ,"x": [1, 2.50, "model"], "model" : "b"}'
    assert scan_now(body).with_model(body, "c") == \
        b'{ "model":"a" ,"x": [1, 2.50, "model"], "model" : "c"}'  # the last one is read


@settings(max_examples=300, deadline=None)
@given(objects(), st.integers(1, 6))
def test_the_depth_is_refused_past_the_limit(body: bytes, limit: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jsonscan, "MAX_JSON_DEPTH", limit)
        # every value counts, also those of a repeated key (the parser keeps the last)
        every = json.loads(body, object_pairs_hook=lambda pairs: dict(enumerate(
            value for _, value in pairs)))
        if nesting(every) > limit:
            with pytest.raises(NestedTooDeeply):
                scan_now(body)
        else:
            scan_now(body)


@pytest.mark.parametrize("body", [b"[]", b'"x"', b"", b"  ", b'{"a": "b', b'{"a": [1}',
                                  b'{"a": 1} {"b": 2}', b'{"mod\\u00": "x"}'])
def test_what_is_no_json_object_is_refused(body: bytes) -> None:
    with pytest.raises(MalformedBody):
        scan_now(body)


def test_too_many_values_and_too_long_a_name_are_refused() -> None:
    with pytest.raises(PayloadTooLarge, match="too many JSON values"):
        scan_now(b'{"a": [' + b"{}," * jsonscan.MAX_MARKS + b"{}]}")
    with pytest.raises(MalformedBody, match="longer than"):
        scan_now(b'{"model": "' + b"m" * (jsonscan.MAX_MODEL_BYTES + 1) + b'"}')


async def test_a_big_body_is_scanned_not_built() -> None:
    """A proxied body over ``SMALL_JSON_BYTES`` gets its model from the scan: nothing parsed
    (no prefix keys, no objects), and the rename reads the scan."""
    body = (b'{"messages": [{"role": "user", "content": "' + b"x" * SMALL_JSON_BYTES
            + b'"}], "model": "big"}')
    request = RequestContext({"method": "POST", "path": "/v1/chat/completions",
                              "query_string": b"",
                              "headers": [(b"content-type", b"application/json")]})
    sent = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return sent.pop()

    await request.read(receive, DEFAULT_MAX_BODY_BYTES)
    assert request.model == "big" and request.parsed is None
    scanned = request.json_scan()
    assert isinstance(scanned, Scanned) and scanned.model == "big"


# Bodies of the largest size the router takes (--max-body-bytes' default, 256 MiB), each
# shape its worst: one long string, deep nests up to the mark bound, and every value a mark.
def long_text() -> bytes:
    head, tail = b'{"model": "m", "prompt": "', b'"}'
    return head + b"word " * ((DEFAULT_MAX_BODY_BYTES - len(head) - len(tail)) // 5) + tail


def deep_nests() -> bytes:
    nest = b"[" * 200 + b"]" * 200 + b","
    count = (jsonscan.MAX_MARKS - 10) // 400
    padding = b" " * (DEFAULT_MAX_BODY_BYTES - count * len(nest) - 64)
    return b'{"x": [' + nest * count + b'0],' + padding + b'"model": "m"}'


def many_values() -> bytes:
    return b'{"x": [' + b"{}," * (DEFAULT_MAX_BODY_BYTES // 3 - 10) + b"{}]}"


@pytest.mark.parametrize("make", [long_text, deep_nests, many_values])
async def test_the_largest_body_holds_neither_the_loop_nor_memory(make: Any) -> None:
    """While the scan runs, a ticker on the same loop keeps running (its longest gap is
    bounded generously here: the figure is the benchmark's), and the scan allocates next to
    nothing (tracemalloc's peak, a count, not a time)."""
    body = make()
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    tracemalloc.start()
    try:
        try:
            scanned: Scanned | None = await scan(body)
        except PayloadTooLarge:
            scanned = None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        done.set()
        await ticking
    assert scanned is None or scanned.model == "m"
    assert scanned is not None or make is many_values
    assert peak < 1 << 20, peak  # bytes: no copy of the body, no value built
    assert len(gaps) > 1 and max(gaps) < 2.0, max(gaps)  # a hang guard on a busy machine


# -- a key added at the object's end (a completion's id_slot) ---------------------------------

@pytest.mark.parametrize("value", [
    {}, {"a": 1}, {"messages": [{"role": "user", "content": "}{\"}"}]}, {"x": {"y": {}}},
    {"prompt": "ends with a brace }"}, {"ünï": "cödé ☃", "n": [1, 2, {"}": "{"}]}])
@pytest.mark.parametrize("spacing", ["", " \n\t", "\r\n"])
def test_a_key_added_at_the_end_keeps_every_other_byte(value: dict[str, Any],
                                                       spacing: str) -> None:
    body = (spacing + json.dumps(value, ensure_ascii=False) + spacing).encode()
    end = jsonscan.object_end(body)
    assert end is not None and body[end:end + 1] == b"}"
    added = jsonscan.add_key(body, end, not value, "id_slot", b"3")
    assert json.loads(added) == {**value, "id_slot": 3}
    assert added.replace(b', "id_slot": 3', b"").replace(b'"id_slot": 3', b"") == body


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"])
def test_a_body_not_in_utf8_gets_no_key(encoding: str) -> None:
    body = json.dumps({"prompt": "x"}).encode(encoding)
    assert json.loads(body) == {"prompt": "x"}  # it reads as JSON all the same
    assert jsonscan.object_end(body) is None


def test_what_is_no_object_gets_no_key() -> None:
    for body in (b"", b"  ", b"[1]", b"}", b"{", b'"{}"'):
        assert jsonscan.object_end(body) is None, body


def test_the_policy_fields_are_read_as_a_parser_reads_them() -> None:
    """A large body is decided on as a small one that is parsed: its top-level policy fields
    (the last of each, escapes decoded), arrays and objects as COMPOUND, nested ones never."""
    body = (b'{"stream": false, "n\\u005fpredict": 7, "messages": [{"stream": true, '
            b'"id_slot": 9}], "id_slot": 1, "response_fields": ["content"], "stream": true,'
            b' "max_tokens": -1, "ignore_eos": null, "other": {"max_tokens": 5}}')
    fields = jsonscan.scan_now(body).fields
    assert fields == {"stream": True, "n_predict": 7, "id_slot": 1,
                      "response_fields": jsonscan.COMPOUND, "max_tokens": -1,
                      "ignore_eos": None}
    parsed = json.loads(body)
    assert {k: parsed[k] for k in fields if fields[k] is not jsonscan.COMPOUND} == \
        {k: v for k, v in fields.items() if v is not jsonscan.COMPOUND}


@pytest.mark.parametrize("bad", [b'{"stream": tru}', b'{"n_predict": -}', b'{"id_slot": +1}'])
def test_a_policy_field_that_is_no_json_is_refused(bad: bytes) -> None:
    with pytest.raises(MalformedBody):
        jsonscan.scan_now(bad)
