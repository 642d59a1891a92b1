#!/usr/bin/env python3
"""A fake Hugging Face Hub: the slice of the Hub HTTP API that ``huggingface_hub`` downloads use.

Point ``huggingface_hub`` at it (``HfApi(endpoint=hub.url)``, ``hf_hub_download(...,
endpoint=hub.url)``, or ``HF_ENDPOINT`` in a *fresh* process: the library reads that variable once,
at import) and nothing reaches huggingface.co::

    with FakeHub.running() as hub:
        hub.add_file("test-org/tiny", "tiny-Q8_0.gguf", b"GGUF" + bytes(1000))
        path = hf_hub_download("test-org/tiny", "tiny-Q8_0.gguf", endpoint=hub.url,
                               cache_dir=tmp_path / "hub")

Or by hand: ``python tests/fake_hub.py --port 8099 --repo test-org/tiny=/path/a.gguf,/path/b.gguf``.

Endpoints (model repos only, each repo has one fixed 40-hex commit; revisions ``main`` and that
commit are known, any other revision is ``RevisionNotFound``):

  GET       /api/models/{owner}/{name}[/revision/{rev}]   model info; ``siblings`` carry size,
            blobId and lfs only with ``?blobs=true`` (``files_metadata=True``); ``?expand=``
            keeps only the listed properties
  GET       /api/models/{owner}/{name}/tree/{rev}[/{path}]  tree listing, ``?recursive=true``
  HEAD/GET  /{owner}/{name}/resolve/{rev}/{filename}       the file, with Range (206/416)
  HEAD/GET  /cdn-lfs/{sha256}                              the "CDN" (``redirect_to_cdn=True``)

Every file is served like an LFS file: ``ETag`` and ``X-Linked-Etag`` are the quoted sha256 of
the content, ``X-Linked-Size`` and ``Content-Length`` its size, ``X-Repo-Commit`` the commit. No
``X-Xet-*`` header is ever sent, so the library always takes the plain-HTTP path. Errors carry
``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``) and
``X-Error-Message`` like the Hub, so ``huggingface_hub`` raises the matching exceptions.

With ``redirect_to_cdn=True`` a resolve answers 302 to ``http://localhost:{port}/cdn-lfs/{sha}``,
a different origin for the client, as the real Hub redirects LFS files to its CDN: the metadata
then comes from the redirect's headers and the GET goes to the CDN url.

Fault knobs: ``drop_after(filename, nbytes)`` makes the next GET of the file send ``nbytes`` body
bytes and then close the connection; ``stall_after(filename, nbytes)`` makes it send ``nbytes``
and then nothing more, the connection left open, until the client goes away or the hub stops (a
stalled Hub); ``delay_per_chunk(seconds)`` sleeps after every body chunk (``chunk_size``, 64 KiB:
a slow Hub trickles bytes). ``requests`` logs ``(method, path, range_header)`` of every request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

import uvicorn

CHUNK_SIZE = 64 * 1024
LAST_MODIFIED = "2024-01-01T00:00:00.000Z"
LFS_SPEC = "https://git-lfs.github.com/spec/v1"

Headers = list[tuple[bytes, bytes]]


def _git_blob_sha1(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class HubFile:
    """One file of a repo; its content is in memory (``data``) or on disk (``source``)."""

    path: str
    size: int
    sha256: str
    data: bytes | None = None
    source: Path | None = None

    @classmethod
    def from_bytes(cls, path: str, data: bytes) -> HubFile:
        return cls(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest(), data=data)

    @classmethod
    def from_path(cls, path: str, source: Path) -> HubFile:
        digest = hashlib.sha256()
        with source.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        return cls(path=path, size=source.stat().st_size, sha256=digest.hexdigest(),
                   source=source)

    @property
    def pointer(self) -> bytes:
        """The git-lfs pointer file that git stores in place of the content."""
        return f"version {LFS_SPEC}\noid sha256:{self.sha256}\nsize {self.size}\n".encode()

    @property
    def blob_id(self) -> str:
        return _git_blob_sha1(self.pointer)

    def read(self, start: int, length: int) -> bytes:
        if self.data is not None:
            return self.data[start:start + length]
        assert self.source is not None
        with self.source.open("rb") as f:
            f.seek(start)
            return f.read(length)


@dataclass
class HubRepo:
    repo_id: str
    sha: str
    files: dict[str, HubFile] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # extra model-info properties


@dataclass
class _Fault:
    nbytes: int
    times: int
    stall: bool = False  # after nbytes: keep the connection open and send nothing


class _DropFilter(logging.Filter):
    """Hides uvicorn's complaint about the responses the fake cuts short on purpose; installed on
    the ``uvicorn.error`` logger while at least one hub runs."""

    def __init__(self) -> None:
        super().__init__()
        self._users = 0
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "ASGI callable returned without completing response."

    def acquire(self) -> None:
        with self._lock:
            self._users += 1
            logging.getLogger("uvicorn.error").addFilter(self)

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                logging.getLogger("uvicorn.error").removeFilter(self)


_DROP_FILTER = _DropFilter()

_MODEL_INFO = re.compile(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?")
_TREE = re.compile(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?")
_RESOLVE = re.compile(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)")
_CDN = re.compile(r"/cdn-lfs/([0-9a-f]{64})")
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


class FakeHub:
    """An ASGI app serving in-memory repos, plus a background uvicorn to run it on 127.0.0.1."""

    def __init__(self, *, redirect_to_cdn: bool = False, chunk_size: int = CHUNK_SIZE) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.redirect_to_cdn = redirect_to_cdn
        self.chunk_size = chunk_size
        self.port: int | None = None
        self._delay = 0.0
        self._faults: dict[str, _Fault] = {}
        self._lock = threading.Lock()
        self._active = 0
        self._closing = False
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ content

    def add_repo(self, repo_id: str, *, sha: str | None = None, **info: Any) -> HubRepo:
        """Create (or return) a repo. ``sha`` defaults to a fixed hash of the repo id; ``info``
        adds model-info properties (e.g. ``gguf={"total": 1000, "architecture": "llama"}``)."""
        repo = self.repos.get(repo_id)
        if repo is None:
            if "/" not in repo_id:
                raise ValueError(f"repo id must be owner/name, got {repo_id!r}")
            commit = sha or hashlib.sha1(f"fake-hub:{repo_id}".encode()).hexdigest()
            if not re.fullmatch(r"[0-9a-f]{40}", commit):
                raise ValueError(f"commit sha must be 40 hex digits, got {commit!r}")
            repo = self.repos[repo_id] = HubRepo(repo_id=repo_id, sha=commit)
        repo.info.update(info)
        return repo

    def add_file(self, repo_id: str, filename: str,
                 data: bytes | str | os.PathLike[str]) -> HubFile:
        """Add a file (bytes, or the path of a local file served from disk) to a repo."""
        repo = self.add_repo(repo_id)
        filename = filename.strip("/")
        if isinstance(data, bytes):
            entry = HubFile.from_bytes(filename, data)
        else:
            entry = HubFile.from_path(filename, Path(data))
        repo.files[filename] = entry
        return entry

    # ------------------------------------------------------------------ fault knobs

    def drop_after(self, filename: str, nbytes: int, *, times: int = 1) -> None:
        """The next ``times`` GETs of ``filename`` (in any repo, ranged or not) send ``nbytes``
        body bytes, then close the connection. A body no longer than ``nbytes`` is sent whole."""
        with self._lock:
            self._faults[filename.strip("/")] = _Fault(nbytes=nbytes, times=times)

    def stall_after(self, filename: str, nbytes: int, *, times: int = 1) -> None:
        """The next ``times`` GETs of ``filename`` send ``nbytes`` body bytes, then nothing more:
        the response stays open, unfinished, until the client closes its connection or the hub
        stops (``active_downloads`` counts it meanwhile)."""
        with self._lock:
            self._faults[filename.strip("/")] = _Fault(nbytes=nbytes, times=times, stall=True)

    def delay_per_chunk(self, seconds: float) -> None:
        """Sleep ``seconds`` after every ``chunk_size`` bytes of file body (0 turns it off)."""
        self._delay = seconds

    def _take_fault(self, filename: str) -> _Fault | None:
        with self._lock:
            fault = self._faults.get(filename)
            if fault is None:
                return None
            fault.times -= 1
            if fault.times <= 0:
                del self._faults[filename]
            return fault

    # ------------------------------------------------------------------ observation

    def file_requests(self, filename: str, method: str = "GET") -> list[str | None]:
        """Range headers (None: no Range) of the ``method`` requests that fetched ``filename``,
        through /resolve or through the CDN."""
        shas = {f.sha256 for r in self.repos.values() for f in r.files.values()
                if f.path == filename}
        ranges = []
        for verb, path, rng in list(self.requests):
            if verb != method:
                continue
            match = _RESOLVE.fullmatch(path)
            if (match and match[3] == filename) or (
                    path.startswith("/cdn-lfs/") and path.rsplit("/", 1)[1] in shas):
                ranges.append(rng)
        return ranges

    @property
    def active_downloads(self) -> int:
        """File bodies being sent right now."""
        return self._active

    def wait_idle(self, timeout: float = 5.0) -> bool:
        """Wait until no file body is being sent (e.g. after a client cancelled)."""
        deadline = time.monotonic() + timeout
        while self._active:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    # ------------------------------------------------------------------ running

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("FakeHub is not running")
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn_url(self) -> str:
        """Same server, other origin (``localhost``), like the Hub's CDN."""
        if self.port is None:
            raise RuntimeError("FakeHub is not running")
        return f"http://localhost:{self.port}"

    def config(self, host: str = "127.0.0.1", port: int = 0) -> uvicorn.Config:
        return uvicorn.Config(self, host=host, port=port, log_config=None, log_level=None,
                              access_log=False, lifespan="off", ws="none", loop="asyncio",
                              timeout_graceful_shutdown=2)

    def start(self, timeout: float = 10.0) -> None:
        """Serve on 127.0.0.1 and a free port, from a background thread."""
        if self._thread is not None:
            raise RuntimeError("FakeHub already started")
        _DROP_FILTER.acquire()
        self._closing = False
        server = self._server = uvicorn.Server(self.config())
        thread = self._thread = threading.Thread(target=server.run, name="fake-hub", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("FakeHub did not start")
            time.sleep(0.01)
        self.port = int(server.servers[0].sockets[0].getsockname()[1])

    def stop(self) -> None:
        """Stop serving (cutting off downloads in progress) and join the server thread."""
        self._closing = True
        if self._server is None:
            return
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
            if self._thread.is_alive():
                raise RuntimeError("FakeHub server thread did not stop")
        self._server = self._thread = None
        self.port = None
        _DROP_FILTER.release()

    def __enter__(self) -> FakeHub:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @classmethod
    @contextlib.contextmanager
    def running(cls, **kwargs: Any) -> Iterator[FakeHub]:
        """``with FakeHub.running() as hub:`` a new hub, served for the duration."""
        with cls(**kwargs) as hub:
            yield hub

    # ------------------------------------------------------------------ ASGI

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        method: str = scope["method"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        self.requests.append((method, scope["path"], headers.get("range")))
        query = parse_qs(scope["query_string"].decode("latin-1"))
        raw_path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        raw_path = raw_path.split("?", 1)[0]

        if method == "GET" and (m := _MODEL_INFO.fullmatch(raw_path)):
            await self._model_info(send, unquote(m[1]), unquote(m[2] or "main"), query)
        elif method == "GET" and (m := _TREE.fullmatch(raw_path)):
            await self._tree(send, unquote(m[1]), unquote(m[2]), unquote(m[3] or ""), query)
        elif method in ("GET", "HEAD") and (m := _RESOLVE.fullmatch(raw_path)):
            await self._resolve(send, receive, method, headers, unquote(m[1]), unquote(m[2]),
                                unquote(m[3]))
        elif method in ("GET", "HEAD") and (m := _CDN.fullmatch(raw_path)):
            found = [f for r in self.repos.values() for f in r.files.values() if f.sha256 == m[1]]
            if not found:
                await self._error(send, method, 404, None, "Not Found")
            else:
                await self._file(send, receive, method, headers, found[0], {})
        else:
            await self._error(send, method, 404, None, "Sorry, we can't find the page you are "
                              "looking for.")

    async def _respond(self, send: Any, method: str, status: int, body: bytes,
                       headers: Headers) -> None:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(body)).encode()), *headers]})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})

    async def _json(self, send: Any, data: Any) -> None:
        await self._respond(send, "GET", 200, json.dumps(data).encode(),
                            [(b"content-type", b"application/json; charset=utf-8")])

    async def _error(self, send: Any, method: str, status: int, code: str | None, message: str,
                     extra: Headers | None = None) -> None:
        headers: Headers = [(b"content-type", b"application/json; charset=utf-8"),
                            (b"x-error-message", message.encode()), *(extra or [])]
        if code is not None:
            headers.append((b"x-error-code", code.encode()))
        await self._respond(send, method, status, json.dumps({"error": message}).encode(), headers)

    async def _lookup(self, send: Any, method: str, repo_id: str, rev: str) -> HubRepo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            await self._error(send, method, 404, "RepoNotFound", "Repository not found")
            return None
        if rev not in ("main", repo.sha):
            await self._error(send, method, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return repo

    async def _model_info(self, send: Any, repo_id: str, rev: str,
                          query: dict[str, list[str]]) -> None:
        repo = await self._lookup(send, "GET", repo_id, rev)
        if repo is None:
            return
        blobs = query.get("blobs", ["false"])[-1].lower() in ("1", "true")
        siblings = []
        for f in sorted(repo.files.values(), key=lambda f: f.path):
            sibling: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                sibling.update(size=f.size, blobId=f.blob_id, lfs={
                    "sha256": f.sha256, "size": f.size, "pointerSize": len(f.pointer)})
            siblings.append(sibling)
        owner = repo_id.split("/", 1)[0]
        is_gguf = any(p.endswith(".gguf") for p in repo.files)
        info: dict[str, Any] = {
            "_id": repo.sha[:24], "id": repo_id, "modelId": repo_id, "author": owner,
            "sha": repo.sha, "lastModified": LAST_MODIFIED, "createdAt": LAST_MODIFIED,
            "private": False, "gated": False, "disabled": False, "downloads": 0, "likes": 0,
            "tags": ["gguf"] if is_gguf else [], "library_name": "gguf" if is_gguf else None,
            "usedStorage": sum(f.size for f in repo.files.values()), "siblings": siblings,
            "spaces": [],
        }
        info.update(repo.info)
        expand = query.get("expand")
        if expand:
            info = {k: v for k, v in info.items() if k in ("_id", "id", *expand)}
        await self._json(send, info)

    async def _tree(self, send: Any, repo_id: str, rev: str, path: str,
                    query: dict[str, list[str]]) -> None:
        repo = await self._lookup(send, "GET", repo_id, rev)
        if repo is None:
            return
        recursive = query.get("recursive", ["false"])[-1].lower() in ("1", "true")
        prefix = f"{path.strip('/')}/" if path.strip("/") else ""
        entries: dict[str, dict[str, Any]] = {}
        for f in repo.files.values():
            if not f.path.startswith(prefix):
                continue
            parts = f.path[len(prefix):].split("/")
            depth = len(parts) if recursive else 1
            for i in range(1, min(depth, len(parts) - 1) + 1):  # the folders on the way
                folder = prefix + "/".join(parts[:i])
                entries[folder] = {"type": "directory", "path": folder, "size": 0,
                                   "oid": _git_blob_sha1(folder.encode())}
            if recursive or len(parts) == 1:
                entries[f.path] = {"type": "file", "path": f.path, "size": f.size,
                                   "oid": f.blob_id, "lfs": {"oid": f.sha256, "size": f.size,
                                                             "pointerSize": len(f.pointer)}}
        if prefix and not entries:
            await self._error(send, "GET", 404, "EntryNotFound",
                              f"{path} does not exist on \"{rev}\"")
            return
        await self._json(send, [entries[k] for k in sorted(entries)])

    async def _resolve(self, send: Any, receive: Any, method: str, headers: dict[str, str],
                       repo_id: str, rev: str, filename: str) -> None:
        repo = await self._lookup(send, method, repo_id, rev)
        if repo is None:
            return
        commit = [(b"x-repo-commit", repo.sha.encode())]
        entry = repo.files.get(filename)
        if entry is None:
            await self._error(send, method, 404, "EntryNotFound", "Entry not found", commit)
            return
        lfs = [*commit, (b"x-linked-etag", f'"{entry.sha256}"'.encode()),
               (b"x-linked-size", str(entry.size).encode())]
        if self.redirect_to_cdn:
            location = f"{self.cdn_url}/cdn-lfs/{entry.sha256}".encode()
            await self._respond(send, method, 302, f"Found. Redirecting to {location.decode()}"
                                .encode(), [(b"location", location),
                                            (b"etag", f'"{entry.blob_id}"'.encode()),
                                            (b"content-type", b"text/plain; charset=utf-8"),
                                            *lfs])
            return
        await self._file(send, receive, method, headers, entry, dict(lfs))

    async def _file(self, send: Any, receive: Any, method: str, headers: dict[str, str],
                    entry: HubFile, extra: dict[bytes, bytes]) -> None:
        start, end, status = 0, entry.size, 200
        base: Headers = [(b"etag", f'"{entry.sha256}"'.encode()), (b"accept-ranges", b"bytes"),
                         (b"content-type", b"application/octet-stream"),
                         (b"content-disposition",
                          f'inline; filename="{entry.path.rsplit("/", 1)[-1]}";'.encode()),
                         *extra.items()]
        if rng := headers.get("range"):
            parsed = self._parse_range(rng, entry.size)
            if parsed is None:
                await self._respond(send, method, 416, b"",
                                    [*base, (b"content-range", f"bytes */{entry.size}".encode())])
                return
            start, end = parsed
            status = 206
            base.append((b"content-range", f"bytes {start}-{end - 1}/{entry.size}".encode()))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(end - start).encode()), *base]})
        if method == "HEAD":
            await send({"type": "http.response.body", "body": b""})
            return
        await self._stream(send, receive, entry, start, end, self._take_fault(entry.path))

    @staticmethod
    def _parse_range(header: str, size: int) -> tuple[int, int] | None:
        """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` as a half-open [start, end), or None."""
        m = _RANGE.fullmatch(header.strip())
        if m is None or (not m[1] and not m[2]):
            return None
        if not m[1]:
            start, end = max(size - int(m[2]), 0), size
        else:
            start = int(m[1])
            end = min(int(m[2]) + 1, size) if m[2] else size
        if start >= size or start >= end:
            return None
        return start, end

    async def _until_gone(self, disconnected: asyncio.Event) -> None:
        """Until the client has closed its connection, or the hub stops."""
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(disconnected.wait(), 0.05)
                return

    async def _stream(self, send: Any, receive: Any, entry: HubFile, start: int, end: int,
                      fault: _Fault | None) -> None:
        disconnected = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected.set()

        watcher = asyncio.create_task(watch())
        with self._lock:
            self._active += 1
        try:
            pos = start
            while pos < end:
                if disconnected.is_set() or self._closing:
                    return
                n = min(self.chunk_size, end - pos)
                if fault is not None:
                    n = min(n, start + fault.nbytes - pos)
                    if n <= 0:
                        if fault.stall:
                            await self._until_gone(disconnected)
                        return  # unfinished response: uvicorn closes the connection
                await send({"type": "http.response.body", "body": entry.read(pos, n),
                            "more_body": True})
                pos += n
                if self._delay and pos < end:
                    await asyncio.sleep(self._delay)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            with self._lock:
                self._active -= 1


@contextlib.contextmanager
def local_only_hf_client(hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Iterator[None]:
    """Give ``huggingface_hub`` a fresh shared client that refuses any host but ``hosts``.

    A safety net for tests: a call that forgot ``endpoint=`` (``HF_ENDPOINT`` is read at import)
    fails with RuntimeError instead of reaching huggingface.co. On exit the client is closed and
    the default factory is back.
    """
    import huggingface_hub
    from huggingface_hub.utils import _http

    def refuse_remote(request: Any) -> None:
        if request.url.host not in hosts:
            raise RuntimeError(f"test tried to reach {request.url} (only {hosts} allowed)")

    def factory() -> Any:
        client = _http.default_client_factory()
        hooks = client.event_hooks
        client.event_hooks = {"request": [refuse_remote, *hooks["request"]],
                              "response": list(hooks["response"])}
        return client

    huggingface_hub.set_client_factory(factory)  # closes the shared client of before
    try:
        yield
    finally:
        huggingface_hub.set_client_factory(_http.default_client_factory)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A fake Hugging Face Hub for offline tests.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--repo", action="append", default=[], metavar="OWNER/NAME=FILE[,FILE]",
                        help="serve these local files in this repo (repeatable)")
    parser.add_argument("--delay-per-chunk", type=float, default=0.0, metavar="S")
    parser.add_argument("--redirect-to-cdn", action="store_true")
    args = parser.parse_args(argv)
    hub = FakeHub(redirect_to_cdn=args.redirect_to_cdn)
    hub.delay_per_chunk(args.delay_per_chunk)
    for spec in args.repo:
        repo_id, _, files = spec.partition("=")
        hub.add_repo(repo_id)
        for name in filter(None, files.split(",")):
            hub.add_file(repo_id, Path(name).name, Path(name))
    hub.port = args.port
    for repo in hub.repos.values():
        print(f"{repo.repo_id}@{repo.sha}: {', '.join(sorted(repo.files)) or '(empty)'}",
              flush=True)
    print(f"HF_ENDPOINT=http://{args.host}:{args.port}", flush=True)
    logging.basicConfig(level=logging.INFO)
    _DROP_FILTER.acquire()
    uvicorn.Server(hub.config(args.host, args.port)).run()


if __name__ == "__main__":
    main()
