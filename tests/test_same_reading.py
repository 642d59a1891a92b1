"""The router and llama-server read one request alike: what the router decided on (the decoded
path and query, ``requests.RequestContext``) is exactly what the child's HTTP library reads
from the target the router forwards (``RequestContext.target``), or the request is refused.

The child's reading is cpp-httplib's (llama.cpp b11434, ``vendor/cpp-httplib/httplib.cpp``),
ported here line for line as the oracle (``httplib_path``, ``httplib_params``): its path
decoder also reads ``%uXXXX``, its query decoder reads ``+`` as a space, a repeated name's
first value is the one llama-server gets, and a pair without a name is dropped. Hypothesis
writes the targets; ``test_same_reading_real.py`` checks the same against the real
llama-server and llama.cpp's router.
"""

from __future__ import annotations

import string
from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.errors import BadRequest
from router.http.requests import RequestContext

HEX = set(b"0123456789abcdefABCDEF")


def _hex(raw: bytes, at: int, count: int) -> int | None:
    """``from_hex_to_i``: ``count`` hex digits at ``at``, else None."""
    digits = raw[at:at + count]
    if len(digits) < count or not all(c in HEX for c in digits):
        return None
    return int(digits, 16)


def httplib_path(raw: bytes) -> bytes:
    """``decode_path_component``: ``%XX`` and ``%uXXXX`` (lower-case ``u`` only)."""
    out = bytearray()
    i = 0
    while i < len(raw):
        if raw[i] == ord("%") and i + 1 < len(raw):
            if raw[i + 1] == ord("u"):
                value = _hex(raw, i + 2, 4)
                if value is not None:
                    out += chr(value).encode("utf-8", "surrogatepass")
                    i += 6
                    continue
            else:
                value = _hex(raw, i + 1, 2)
                if value is not None:
                    out.append(value)
                    i += 3
                    continue
        out.append(raw[i])
        i += 1
    return bytes(out)


def _query_component(raw: bytes) -> bytes:
    """``decode_query_component`` (``+`` as a space)."""
    out = bytearray()
    i = 0
    while i < len(raw):
        if raw[i] == ord("%") and i + 2 < len(raw):
            value = _hex(raw, i + 1, 2)
            if value is not None:
                out.append(value)
                i += 3
                continue
        out.append(ord(" ") if raw[i] == ord("+") else raw[i])
        i += 1
    return bytes(out)


def httplib_params(query: bytes) -> dict[bytes, bytes]:
    """``parse_query_text`` then ``get_param_value``: each name's first value (segments
    split on ``&`` and trimmed of spaces and tabs, exact repeats dropped, no empty name)."""
    seen: set[bytes] = set()
    params: dict[bytes, bytes] = {}
    for segment in query.split(b"&"):
        segment = segment.strip(b" \t")
        if not segment or segment in seen:
            continue
        seen.add(segment)
        key, _, value = segment.partition(b"=")
        if key:
            params.setdefault(_query_component(key), _query_component(value))
    return params


def scope_for(target: bytes) -> dict[str, object]:
    """The ASGI scope uvicorn (httptools) makes of a request target."""
    raw_path, _, query = target.partition(b"?")
    return {"type": "http", "method": "GET", "path": unquote(raw_path.decode("ascii")),
            "raw_path": raw_path, "query_string": query, "headers": []}


def assert_read_alike(target: bytes) -> RequestContext:
    """The forwarded target of ``target`` reads, for cpp-httplib, as the router read it; or
    the request was refused."""
    request = RequestContext(scope_for(target))  # type: ignore[arg-type]
    if request.refused is not None:
        return request
    path, _, query = request.target().partition(b"?")
    assert httplib_path(path) == request.path.encode("utf-8"), target
    read = httplib_params(query)
    decided = {name.encode("utf-8"): value.encode("utf-8")
               for name, value in request.params.items() if name}
    assert read == decided, target
    return request


# Spellings an attacker tried: each reads differently for cpp-httplib and for the router as
# it was sent (the first assertion shows it), and the router refuses or re-encodes it.
HOSTILE = [b"/%u0073lots", b"/sl%u006Fts", b"/%U0073lots", b"/%u006detrics?model=a",
           b"/slots?model=a&model=b", b"/props?model=a&%6dodel=b", b"/props?=x&model=a",
           b"/sl%6fts?action=sa%76e", b"/props?model=%u0062", b"/x%FFy", b"/slots%00",
           b"/a%2Fb?q=1+2%2B3", b"/%E2%82%AC?m=%E2%82%AC"]


@pytest.mark.parametrize("target", HOSTILE)
def test_every_hostile_spelling_is_refused_or_forwarded_as_it_was_read(target: bytes) -> None:
    assert_read_alike(target)


def test_the_spellings_the_attack_used_are_refused() -> None:
    for target in (b"/%u0073lots", b"/sl%u006Fts", b"/%U0073lots", b"/props?model=%u0062",
                   b"/x%FFy", b"/slots%00", b"/p?m=%FF"):
        refused = RequestContext(scope_for(target)).refused  # type: ignore[arg-type]
        assert isinstance(refused, BadRequest), target


def test_the_raw_target_would_have_read_differently() -> None:
    """The oracle sees the attack: forwarding the target as sent (what the router did) gives
    the child another path than the router decided on."""
    request = RequestContext(scope_for(b"/%u0073lots"))  # type: ignore[arg-type]
    assert request.path == "/%u0073lots"
    assert httplib_path(b"/%u0073lots") == b"/slots"
    params = httplib_params(b"model=a&model=b")
    assert params[b"model"] == b"a"
    assert RequestContext(scope_for(b"/p?model=a&model=b")).params["model"] == "b"  # type: ignore[arg-type]


def test_a_percent_sign_that_escapes_nothing_is_no_percent_u() -> None:
    """``%up`` escapes nothing for either reader (both keep the ``%``): not refused, and
    forwarded as ``%25``, which both read back as ``%``."""
    request = RequestContext(scope_for(b"/props?q=100%uptime"))  # type: ignore[arg-type]
    assert request.refused is None and request.params["q"] == "100%uptime"
    assert_read_alike(b"/props?q=100%uptime")


def test_a_plain_target_is_forwarded_as_it_came() -> None:
    """No percent sign in the path and no query: the bytes as sent (the hot path)."""
    request = RequestContext(scope_for(b"/v1/chat/completions"))  # type: ignore[arg-type]
    assert request.target() == b"/v1/chat/completions"
    request = RequestContext(scope_for(b"/props?model=a%20b"))  # type: ignore[arg-type]
    assert request.target(model="c d") == b"/props?model=c+d"


_PIECES = st.sampled_from(
    ["/", "s", "l", "o", "t", "%", "u", "U", "0", "0073", "%73", "%2F", "%2f", "%00", "%FF",
     "%C3%A9", "%E2%82%AC", "+", "?", "&", "=", "model", "action", "%3D", "%26", "%u", "%4",
     "a", "~", ".", "-", "_", ":", "@", "!", "$", "'", "(", ")", "*", ",", ";", "%20"])
_ASCII = st.text(alphabet=string.ascii_letters + string.digits + "%+&=/?-._~", max_size=8)


@settings(max_examples=600, deadline=None)
@given(st.lists(st.one_of(_PIECES, _ASCII), max_size=24))
def test_any_target_is_refused_or_read_alike(pieces: list[str]) -> None:
    target = ("/" + "".join(pieces)).encode("ascii")
    assert_read_alike(target)
