"""The grammar of ``--cors-origins`` and of origins as browsers send them.

Configuration-level: ``settings`` validates ``--cors-origins`` with ``CorsPolicy.parse``, and
``cors`` (the edge's policy) decides with the same ``CorsPolicy``; nothing here knows a
request. The rules themselves are described in ``cors.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ANY, LOCALHOST, NONE = "*", "localhost", "none"
DEFAULT = ANY  # llama-server's default --cors-origins
ORIGIN, HOST, FETCH_SITE = b"origin", b"host", b"sec-fetch-site"
REQUEST_METHOD = b"access-control-request-method"
OTHER_SITES = frozenset({b"cross-site", b"same-site"})  # Sec-Fetch-Site values: not this origin
# The answer's CORS headers, their names as llama-server writes them (``cors`` keeps the case
# on the wire). A preflight's: llama-server's methods; its "*" headers, plus Authorization,
# which a wildcard does not cover (Fetch standard), so that a page can send its API key.
PREFLIGHT_HEADERS = ((b"Access-Control-Allow-Methods", b"GET, POST, DELETE, OPTIONS"),
                     (b"Access-Control-Allow-Headers", b"Authorization, *"))
ALLOW_ORIGIN = b"Access-Control-Allow-Origin"
VARY_ORIGIN = (b"Vary", b"Origin")

_HOSTNAME = rb"([a-z0-9_.-]+|\[[0-9a-f:.]+\])(?::([0-9]{1,5}))?"
# An origin as browsers serialise it: lower case, no path, no user info.
_ORIGIN = re.compile(rb"([a-z][a-z0-9+.-]*)://" + _HOSTNAME)
_HOST = re.compile(_HOSTNAME)
_DEFAULT_PORTS = {b"http": 80, b"https": 443}
_LOCAL_HOSTS = frozenset({b"localhost", b"127.0.0.1", b"[::1]"})
_WEB_SCHEMES = frozenset({b"http", b"https"})


@dataclass(frozen=True)
class CorsPolicy:
    """What pages of other origins may use: ``any_origin`` (``*``) and ``localhost`` the
    inference routes, ``origins`` (serialised as browsers send them) every route."""

    any_origin: bool = True
    localhost: bool = False
    origins: frozenset[bytes] = frozenset()

    @classmethod
    def parse(cls, value: str) -> CorsPolicy:
        """``--cors-origins``; ValueError saying what is wrong with an entry."""
        entries = [entry.strip() for entry in value.split(",") if entry.strip()]
        if not entries:
            raise ValueError("give *, localhost, origins such as https://app.example, or none")
        if NONE in (e.lower() for e in entries):
            if len(entries) > 1:
                raise ValueError("none cannot be combined with other entries")
            return cls(any_origin=False)
        return cls(any_origin=ANY in entries, localhost=LOCALHOST in (e.lower() for e in entries),
                   origins=frozenset(_origin(e) for e in entries
                                     if e != ANY and e.lower() != LOCALHOST))

    def describe(self) -> str:
        parts = [ANY] * self.any_origin + [LOCALHOST] * self.localhost
        parts += sorted(o.decode() for o in self.origins)
        return ",".join(parts) or NONE

    def grant(self, origin: bytes | None, sensitive: bool) -> bytes | None:
        """For a cross-origin request: the ``Access-Control-Allow-Origin`` its answer gets
        (empty: the request goes on without one), or None: refused."""
        if origin is None:  # a link or an image: nothing the page can read
            return None if sensitive else b""
        if origin in self.origins:
            return origin
        if sensitive:
            return None
        if self.any_origin:
            return b"*"
        if self.localhost and is_localhost(origin):
            return origin
        return None


def _origin(entry: str) -> bytes:
    """An origin of ``--cors-origins`` as browsers send it (lower case, no default port)."""
    text = entry.lower().removesuffix("/")
    if text == "null":
        raise ValueError("null is the origin of sandboxed frames and local files, which any "
                         "site can open: it cannot be allowed")
    match = _ORIGIN.fullmatch(text.encode("utf-8", "replace"))
    if match is None:
        raise ValueError(f"{entry!r} is not an origin: give scheme://host or "
                         "scheme://host:port (no path, no wildcard), *, localhost or none")
    scheme, host, port = match.groups()
    if port is not None and not 0 < int(port) <= 65535:
        raise ValueError(f"{entry!r}: the port must be from 1 to 65535")
    if port is not None and int(port) == _DEFAULT_PORTS.get(scheme):
        port = None  # browsers leave the default port out
    return scheme + b"://" + host + (b":" + str(int(port)).encode() if port else b"")


def is_localhost(origin: bytes) -> bool:
    """A page of this machine's web servers: ``http`` or ``https`` on ``localhost``,
    ``127.0.0.1`` or ``[::1]``, as browsers serialise it (``file:`` pages send ``null``)."""
    match = _ORIGIN.fullmatch(origin)
    return match is not None and match[1] in _WEB_SCHEMES and match[2] in _LOCAL_HOSTS


def same_origin(origin: bytes, host: bytes | None) -> bool:
    """Whether ``origin`` is the router's own: its host and port are the ``Host`` header's
    (a port left out is the origin scheme's default)."""
    theirs = _ORIGIN.fullmatch(origin)
    ours = _HOST.fullmatch(host.lower()) if host else None
    if theirs is None or ours is None:
        return False
    default = _DEFAULT_PORTS.get(theirs[1], -1)
    return theirs[2] == ours[1] and \
        int(theirs[3] or default) == int(ours[2] or default)
