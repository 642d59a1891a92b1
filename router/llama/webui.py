"""llama.cpp's web UI: the static files of its build, served at ``/`` in plain ASGI.

The UI is a SvelteKit static build (hash router, relative asset paths, ``index.html`` as the
fallback page) that ``install.py`` builds from the same llama.cpp source as the binary. The
app (``app.py``) asks ``answer()`` only for GET and HEAD requests without a model, before it
would answer 404; everything else never reaches this module.

Security: only the regular files found under the root when it was indexed are served. A
request path is looked up in that index, never joined to the root, so ``..``, encoded
separators, NUL bytes and symlinks leading out of the root cannot reach a file outside it
(symlinks are resolved when indexing, and kept only if they stay inside; files are opened with
``O_NOFOLLOW``). Dot files are not served.

Caching, as llama-server serves its own UI: ``/`` and ``index.html``, and the files a PWA
checks for updates (``sw.js``, ``manifest.webmanifest``, ``build.json``,
``_app/version.json``), are ``no-cache`` with an ETag; the content-hashed files under
``/_app/immutable/`` are cached for a year; every other file for ``SHORT_MAX_AGE_S``, with an
ETag. ``If-None-Match`` answers 304. The index is rebuilt when ``index.html`` changes (a new
build installed under a running router), so a rebuild is served without a restart.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from starlette.types import Scope, Send

from ..errors import NotFound

log = logging.getLogger("router.webui")

SHORT_MAX_AGE_S = 3600
CACHE_IMMUTABLE = b"public, max-age=31536000, immutable"
CACHE_REVALIDATE = b"no-cache"
CACHE_SHORT = f"public, max-age={SHORT_MAX_AGE_S}".encode()
IMMUTABLE_PREFIX = "_app/immutable/"
INDEX = "index.html"
NO_CACHE_FILES = frozenset({INDEX, "sw.js", "manifest.webmanifest", "build.json",
                            "_app/version.json"})
CHUNK_BYTES = 256 * 1024
TEXT = "; charset=utf-8"
CONTENT_TYPES = {
    ".html": "text/html" + TEXT, ".js": "text/javascript" + TEXT,
    ".mjs": "text/javascript" + TEXT, ".css": "text/css" + TEXT, ".txt": "text/plain" + TEXT,
    ".json": "application/json", ".map": "application/json",
    ".webmanifest": "application/manifest+json", ".xml": "application/xml",
    ".wasm": "application/wasm", ".pdf": "application/pdf",
    ".svg": "image/svg+xml", ".png": "image/png", ".ico": "image/x-icon",
    ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".gif": "image/gif", ".webp": "image/webp",
    ".avif": "image/avif", ".woff": "font/woff", ".woff2": "font/woff2", ".ttf": "font/ttf",
    ".otf": "font/otf", ".mp3": "audio/mpeg", ".wav": "audio/wav", ".mp4": "video/mp4",
}
DEFAULT_TYPE = "application/octet-stream"
# A path the SPA fallback may answer with index.html: plain segments, none starting with a
# dot (so no "." or ".." and no dot files), no percent sign, backslash or NUL left after
# decoding.
FALLBACK_PATH = re.compile(r"(/[A-Za-z0-9_~\-][A-Za-z0-9_.~\-]*)*/?")
# Sent with the page itself, as llama-server does: the UI expects a cross-origin isolated page.
ISOLATION = [(b"cross-origin-embedder-policy", b"require-corp"),
             (b"cross-origin-opener-policy", b"same-origin")]


class StaticUI(Protocol):
    """What ``app.py`` needs from a web UI (or from its absence)."""

    def is_public(self, path: str) -> bool:
        """True for ``/`` and the UI's own files, which need no API key."""

    async def answer(self, scope: Scope, send: Send, *, fallback: bool) -> bool:
        """Answer a GET/HEAD without a model if it is the UI's; False if it is not.
        ``fallback``: the path may get ``index.html`` (it is not an API path)."""


@dataclass(frozen=True, slots=True)
class Asset:
    """One servable file: where it really is and how it is served."""

    file: str  # resolved real path, inside the root
    content_type: bytes
    cache_control: bytes
    isolation: bool


class WebUI:
    """Serves the built UI in ``root`` (see the module docstring for the contract)."""

    def __init__(self, root: Path) -> None:
        """Checks that ``root`` holds the UI; its files are indexed at the first request for
        one (not while the router starts)."""
        self.root = Path(os.path.realpath(root))
        self._signature: tuple[int, int, int] | None = None
        self._assets: dict[str, Asset] = {}
        if self._index_signature() is None or not os.path.isfile(self.root / INDEX):
            raise ValueError(f"{root} has no {INDEX}")

    def __repr__(self) -> str:
        return f"<WebUI {self.root} files={len(self._assets)}>"

    # ------------------------------------------------------------------ index

    def _index_signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(os.path.join(self.root, INDEX))
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _refresh(self) -> None:
        """Re-index if ``index.html`` changed since the last scan (one stat when it has not)."""
        signature = self._index_signature()
        if signature == self._signature and self._assets:
            return
        self._signature = signature
        self._assets = self._scan() if signature is not None else {}
        log.debug("indexed %d web UI files in %s", len(self._assets), self.root)

    def _scan(self) -> dict[str, Asset]:
        root = str(self.root)
        assets: dict[str, Asset] = {}
        for folder, dirs, files in os.walk(root):  # does not follow symlinked folders
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in files:
                if name.startswith("."):
                    continue
                real = os.path.realpath(os.path.join(folder, name))
                if not real.startswith(root + os.sep) or not os.path.isfile(real):
                    log.debug("not serving %s: it leads out of %s", name, root)
                    continue
                key = os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                assets[key] = _describe(key, real)
        return assets

    # ------------------------------------------------------------------ serving

    def is_public(self, path: str) -> bool:
        if not self._assets:
            self._refresh()
        return path == "/" or path[1:] in self._assets

    def _lookup(self, path: str, accept_html: bool, fallback: bool) -> Asset | None:
        self._refresh()
        key = path[1:] or INDEX
        asset = self._assets.get(key)
        if asset is None and fallback and accept_html and "." not in path.rsplit("/", 1)[-1] \
                and FALLBACK_PATH.fullmatch(path):
            asset = self._assets.get(INDEX)
        return asset

    async def answer(self, scope: Scope, send: Send, *, fallback: bool) -> bool:
        path: str = scope["path"]
        accept = _header(scope, b"accept")
        asset = self._lookup(path, b"text/html" in accept, fallback)
        if asset is None:
            return False
        try:
            handle = await asyncio.to_thread(_open, asset.file)
        except OSError:  # gone since it was indexed (a rebuild being swapped in)
            return False
        try:
            await _send_file(handle, asset, scope, send)
        finally:
            handle.close()
        return True


class MissingWebUI:
    """Stands in when no UI is installed: ``/`` answers 404 with how to get one."""

    def __init__(self, message: str) -> None:
        self.message = message

    def is_public(self, path: str) -> bool:
        return False

    async def answer(self, scope: Scope, send: Send, *, fallback: bool) -> bool:
        if scope["path"] in ("/", "/" + INDEX):
            raise NotFound(self.message)
        return False


def _describe(key: str, real: str) -> Asset:
    extension = os.path.splitext(key)[1].lower()
    if key in NO_CACHE_FILES:
        cache = CACHE_REVALIDATE
    elif key.startswith(IMMUTABLE_PREFIX):
        cache = CACHE_IMMUTABLE
    else:
        cache = CACHE_SHORT
    return Asset(real, CONTENT_TYPES.get(extension, DEFAULT_TYPE).encode(), cache,
                 isolation=key == INDEX)


def _header(scope: Scope, name: bytes) -> bytes:
    return b", ".join(value for key, value in scope["headers"] if key == name)


def _open(file: str) -> io.FileIO:
    return io.FileIO(os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")


def etag_matches(if_none_match: bytes, etag: bytes) -> bool:
    """``If-None-Match`` (a list, ``*``, weak tags) against ``etag``: weak comparison."""
    for tag in if_none_match.split(b","):
        tag = tag.strip()
        if tag == b"*" or tag.removeprefix(b"W/") == etag:
            return True
    return False


async def _send_file(handle: io.FileIO, asset: Asset, scope: Scope, send: Send) -> None:
    st = os.fstat(handle.fileno())
    etag = f'"{st.st_size:x}-{st.st_mtime_ns:x}"'.encode()
    headers = [(b"etag", etag), (b"cache-control", asset.cache_control)]
    if etag_matches(_header(scope, b"if-none-match"), etag):
        await send({"type": "http.response.start", "status": 304, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
        return
    headers += [(b"content-type", asset.content_type),
                (b"content-length", str(st.st_size).encode()),
                (b"x-content-type-options", b"nosniff")]
    if asset.isolation:
        headers += ISOLATION
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if scope["method"] == "HEAD" or st.st_size == 0:
        await send({"type": "http.response.body", "body": b""})
        return
    left = st.st_size
    while left > 0:
        chunk = await asyncio.to_thread(handle.read, min(CHUNK_BYTES, left))
        if not chunk:  # shrank since fstat: the server drops the short response
            log.warning("%s shrank while being sent", asset.file)
            return
        left -= len(chunk)
        await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
