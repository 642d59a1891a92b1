"""Hugging Face models: ``owner/repo[:QUANT]`` resolution, cache lookup, download with progress.

Every Hub interaction goes through huggingface-hub (``HfApi.model_info``, ``hf_hub_download``,
``scan_cache_dir``), so ``HF_HOME``, ``HF_HUB_CACHE``, ``HF_TOKEN``, ``HF_ENDPOINT`` and
``HF_HUB_OFFLINE`` behave as everywhere else, a dropped connection is resumed with a Range
request, and a file is only visible in the cache once complete (huggingface-hub writes a
``*.incomplete`` file, renames it when whole, and deletes it when the download fails).

A download stops promptly when cancelled, whatever the Hub's speed (``download``): the library
runs in a thread of its own that ``download`` waits for, so that ``download`` returns soon after
the cancel whatever the library is doing, and the library's HTTP requests are watched so that
its thread ends too: each request and each piece of body read checks the cancel, and a cancel
shuts the download's connections down, which wakes a read blocked on a Hub that sends nothing.

Resolution follows llama.cpp: the quant tag is matched case-insensitively at the end of the file
name (before ``.gguf`` and any ``-0000k-of-0000N`` split suffix), default ``Q4_K_M``, else the
first GGUF; a split model brings all its shards; an ``mmproj*.gguf`` in the same repo is the
multimodal projector.
"""

from __future__ import annotations

import contextlib
import functools
import re
import shutil
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..host.memory import format_size

DEFAULT_QUANT = "Q4_K_M"
# How often a download checks its ``cancelled()`` while the library works, and how long it then
# gives the library's thread to stop and delete its partial file before returning anyway.
CANCEL_POLL_S = 0.05
CANCEL_CLEANUP_S = 1.0
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")
_TAG = re.compile(r"[-.]([A-Za-z0-9_]+)$")
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_QUANT = re.compile(r"[\w.-]+")
_SKIP_PREFIXES = ("mtp-", "eagle3-", "dflash-", "dspark-")


class ResolveError(ValueError):
    """The repo, quant or file does not exist (or the name is malformed)."""


class HubUnreachable(RuntimeError):
    """The Hub could not be asked (network, DNS, TLS, proxy): not the name's fault."""


@dataclass(frozen=True)
class HfRef:
    repo: str
    tag: str | None

    @classmethod
    def parse(cls, text: str) -> HfRef:
        repo, _, tag = text.strip().partition(":")
        # fullmatch: "$" would let a final newline through
        if not _REPO.fullmatch(repo) or (tag and not _QUANT.fullmatch(tag)):
            raise ResolveError(f"{text!r} is not a Hugging Face model: use owner/repo[:QUANT]")
        return cls(repo, tag.upper() or None)

    def __str__(self) -> str:
        return f"{self.repo}:{self.tag}" if self.tag else self.repo


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int | None


@dataclass(frozen=True)
class Resolution:
    """The concrete files of a model: ``model_files`` (shards in order) and an optional
    projector."""

    repo: str
    tag: str
    model_files: tuple[RemoteFile, ...]
    mmproj: RemoteFile | None

    @property
    def id(self) -> str:
        return f"{self.repo}:{self.tag}"

    @property
    def files(self) -> tuple[RemoteFile, ...]:
        return self.model_files + ((self.mmproj,) if self.mmproj else ())

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


def file_tag(name: str) -> str | None:
    """``Qwen2-7B-Instruct-Q4_K_M-00001-of-00002.gguf`` → ``Q4_K_M`` (llama.cpp's rule)."""
    stem = name.rsplit("/", 1)[-1].removesuffix(".gguf")
    stem = _SPLIT.sub("", stem)
    match = _TAG.search(stem)
    return match.group(1).upper() if match else None


def _is_model_file(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return (base.endswith(".gguf") and "mmproj" not in base.lower()
            and not base.startswith(_SKIP_PREFIXES))


def choose_files(repo: str, names: Iterable[tuple[str, int | None]], tag: str | None,
                 hf_file: str | None = None) -> Resolution:
    """Pick the files of ``repo`` for ``tag`` (or ``hf_file``) from its file list (pure)."""
    files = sorted((RemoteFile(n, s) for n, s in names), key=lambda f: f.name)
    ggufs = [f for f in files if _is_model_file(f.name)]
    if not ggufs:
        raise ResolveError(f"repo {repo} has no GGUF model files")
    if hf_file is not None:
        chosen = [f for f in ggufs if f.name == hf_file]
        if not chosen:
            raise ResolveError(f"repo {repo} has no file {hf_file!r}; GGUF files: "
                               + ", ".join(f.name for f in ggufs))
    else:
        wanted = tag or DEFAULT_QUANT
        chosen = [f for f in ggufs if file_tag(f.name) == wanted]
        if not chosen and tag is not None:
            tags = sorted({t for f in ggufs if (t := file_tag(f.name))})
            raise ResolveError(f"repo {repo} has no {tag} file; available quants: "
                               + ", ".join(tags))
        if not chosen:
            chosen = [ggufs[0]]
    first = chosen[0]
    split = _SPLIT.search(first.name.removesuffix(".gguf"))
    if split:
        prefix = first.name.removesuffix(".gguf")[:split.start()]
        shards = [f for f in ggufs if f.name.startswith(prefix + "-")
                  and _SPLIT.search(f.name.removesuffix(".gguf"))]
        count = int(split.group(2))
        if len(shards) != count:
            raise ResolveError(f"repo {repo}: {first.name} is 1 of {count} shards but only "
                               f"{len(shards)} are in the repo")
        model_files = tuple(shards)
    else:
        model_files = (first,)
    projectors = [f for f in files if "mmproj" in f.name.rsplit("/", 1)[-1].lower()
                  and f.name.endswith(".gguf")]
    resolved_tag = file_tag(first.name) or (tag or DEFAULT_QUANT)
    return Resolution(repo, resolved_tag, model_files, projectors[0] if projectors else None)


# --------------------------------------------------------------------------- Hub and cache

def hub_cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_remote(ref: HfRef, hf_file: str | None = None) -> Resolution:
    """Ask the Hub which files ``ref`` means; ResolveError if the repo/quant does not exist."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        info = HfApi().model_info(ref.repo, files_metadata=True)
    except HFValidationError as exc:
        raise ResolveError(f"{ref.repo!r} is not a valid Hugging Face repo id: {exc}") from exc
    except GatedRepoError as exc:
        raise ResolveError(f"repo {ref.repo} is gated: accept its terms on the Hub and set "
                           "HF_TOKEN") from exc
    except (RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ResolveError(f"repo {ref.repo} does not exist on the Hub (or is private: set "
                           "HF_TOKEN)") from exc
    except HfHubHTTPError as exc:
        raise ResolveError(f"cannot query the Hub for {ref.repo}: {exc}") from exc
    except Exception as exc:  # anything else: the Hub could not be asked
        # (network, DNS, TLS, proxy; the HTTP client's own exception types vary by version)
        raise HubUnreachable(f"cannot reach the Hugging Face Hub ({type(exc).__name__}: "
                             f"{exc}); check the network, HF_ENDPOINT and proxies") from exc
    names = [(s.rfilename, s.size) for s in info.siblings or []]
    return choose_files(ref.repo, names, ref.tag, hf_file)


def _snapshot_files(repo: str, cache: Path) -> dict[str, Path]:
    """Files of the newest cached snapshot of ``repo``: relative name → path."""
    snapshots = cache / ("models--" + repo.replace("/", "--")) / "snapshots"
    if not snapshots.is_dir():
        return {}
    newest = max(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, default=None)
    if newest is None:
        return {}
    return {str(p.relative_to(newest)): p for p in newest.rglob("*.gguf") if p.is_file()}


def resolve_cached(ref: HfRef, hf_file: str | None = None,
                   cache: Path | None = None) -> tuple[Resolution, list[Path]] | None:
    """The local files of ``ref`` if every one of them is complete in the cache, without
    touching the network; else None."""
    files = _snapshot_files(ref.repo, cache or hub_cache_dir())
    if not files:
        return None
    try:
        resolution = choose_files(ref.repo, [(n, p.stat().st_size) for n, p in files.items()],
                                  ref.tag, hf_file)
    except ResolveError:
        return None
    return resolution, [files[f.name] for f in resolution.files]


def cached_models(cache: Path | None = None) -> list[tuple[str, list[Path], int]]:
    """Every model in the HF cache as ``(repo:TAG, [model path, projector path?], bytes)``."""
    root = cache or hub_cache_dir()
    found: list[tuple[str, list[Path], int]] = []
    if not root.is_dir():
        return found
    for repo_dir in sorted(root.glob("models--*--*")):
        repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        files = _snapshot_files(repo, root)
        tags = sorted({t for n in files if _is_model_file(n) and (t := file_tag(n))})
        for tag in tags:
            hit = resolve_cached(HfRef(repo, tag), cache=root)
            if hit is not None:
                resolution, paths = hit
                found.append((resolution.id, paths, sum(p.stat().st_size for p in paths)))
    return found


ProgressCallback = Callable[[str, int, int | None], None]


class DownloadCancelled(Exception):
    pass


def download(resolution: Resolution, progress: ProgressCallback,
             cancelled: Callable[[], bool] = lambda: False, *, endpoint: str | None = None,
             cache: Path | None = None) -> list[Path]:
    """Download every file of ``resolution`` into the HF cache (blocking; run it in a thread).

    Checks free disk space first. ``progress(file, done, total)`` is called as bytes arrive.
    ``cancelled()`` is polled every ``CANCEL_POLL_S``; once true, this raises DownloadCancelled.
    A plain-HTTP download (reading a body, or blocked on a Hub that sends nothing) is
    interrupted at once and its partial ``*.incomplete`` file deleted before this returns; what
    cannot be interrupted (a sleep before a retry, a Xet download, another process's file lock)
    is given ``CANCEL_CLEANUP_S`` and then left to end in its daemon thread, which deletes the
    partial file when it does. A partial file is never renamed into place. ``endpoint`` and
    ``cache`` default to ``HF_ENDPOINT`` and ``HF_HUB_CACHE``.
    """
    cache = cache or hub_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    missing = sum(f.size or 0 for f in resolution.files
                  if _cached_path(resolution.repo, f.name, cache) is None)
    free = shutil.disk_usage(cache).free
    if missing > free:
        raise ResolveError(f"not enough disk space in {cache} for {resolution.id}: needs "
                           f"{format_size(missing)}, {format_size(free)} free")
    transfer = _Transfer(cancelled, resolution.id)
    outcome: list[Any] = []

    def fetch_all() -> None:  # the library's thread
        _local.transfer = transfer
        try:
            outcome.append(_fetch(resolution, progress, transfer, endpoint, cache))
        except BaseException as exc:  # handed over to the waiting thread
            outcome.append(exc)
        finally:
            _local.transfer = None

    worker = threading.Thread(target=fetch_all, name=f"hf-download:{resolution.id}",
                              daemon=True)  # never holds up the router's exit
    worker.start()
    try:
        while worker.is_alive():
            worker.join(CANCEL_POLL_S)
            if worker.is_alive() and transfer.cancelled():
                raise DownloadCancelled(f"download of {resolution.id} cancelled")
    except BaseException:  # cancelled, or interrupted here (Ctrl-C in ``llama-router pull``)
        transfer.abort()
        worker.join(CANCEL_CLEANUP_S)  # usually at once: its reads were interrupted
        raise
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    paths: list[Path] = result
    return paths


def _fetch(resolution: Resolution, progress: ProgressCallback, transfer: _Transfer,
           endpoint: str | None, cache: Path) -> list[Path]:
    from huggingface_hub import get_session, hf_hub_download

    paths: list[Path] = []
    for remote in resolution.files:
        transfer.check()
        _watch_requests(get_session())  # the shared client may be new (set_client_factory)
        reporter = _progress_class(remote, progress, transfer.cancelled, resolution.id)
        path = hf_hub_download(resolution.repo, remote.name, tqdm_class=reporter,
                               endpoint=endpoint, cache_dir=cache)
        progress(remote.name, remote.size or Path(path).stat().st_size, remote.size)
        paths.append(Path(path))
    return paths


# ----------------------------------------------------------------- interrupting a download
#
# huggingface-hub streams a file through its shared httpx2 client (``get_session``) in reads of
# ``DOWNLOAD_CHUNK_SIZE`` (10 MiB), with a read timeout of ``HF_HUB_DOWNLOAD_TIMEOUT`` (10 s)
# and up to 5 resumes after a timeout, each after a sleep: its progress bar alone is called too
# rarely to stop a slow download, and not at all while a read is blocked. So the client gets
# two event hooks (public httpx2 API), which act only in a thread that runs a download: a
# request is refused once the download is cancelled, and a response body is wrapped so that each
# piece read from the socket checks the cancel, its socket (httpcore's ``network_stream``
# extension) being registered so that a cancel can shut it down from the waiting thread.

_local = threading.local()
_hooks_lock = threading.Lock()


class _Transfer:
    """The cancel state and open connections of one ``download``."""

    def __init__(self, cancelled: Callable[[], bool], model_id: str) -> None:
        self._cancelled = cancelled
        self._model_id = model_id
        self._aborted = False
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()

    def cancelled(self) -> bool:
        return self._aborted or self._cancelled()

    def check(self) -> None:
        if self.cancelled():
            raise DownloadCancelled(f"download of {self._model_id} cancelled")

    def abort(self) -> None:
        """Cancel, and wake any read blocked on one of the download's connections."""
        with self._lock:
            self._aborted = True
            for sock in self._sockets:
                _shut_down(sock)

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.add(sock)
            if self._aborted:
                _shut_down(sock)

    def detach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)


def _shut_down(sock: socket.socket) -> None:
    # socket.socket's own shutdown, also for an SSLSocket (whose override would drop its SSL
    # state under the reading thread): the blocked read returns, the connection is not reused.
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


def _watch_requests(session: Any) -> bool:
    """Add the download hooks to huggingface-hub's shared client (once); False if it is not an
    httpx2 client (an older huggingface-hub): downloads then stop at the progress bar's checks
    and ``download`` still returns at once."""
    try:
        import httpx2
    except ImportError:
        return False
    if not isinstance(session, httpx2.Client):
        return False
    with _hooks_lock:
        hooks = session.event_hooks
        if _on_response not in hooks["response"]:
            session.event_hooks = {"request": [*hooks["request"], _on_request],
                                   "response": [*hooks["response"], _on_response]}
    return True


def _on_request(request: Any) -> None:
    transfer: _Transfer | None = getattr(_local, "transfer", None)
    if transfer is not None:
        transfer.check()


def _on_response(response: Any) -> None:
    transfer: _Transfer | None = getattr(_local, "transfer", None)
    if transfer is None:
        return
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    response.stream = _checked_stream(response.stream, transfer,
                                      sock if isinstance(sock, socket.socket) else None)


def _checked_stream(inner: Any, transfer: _Transfer, sock: socket.socket | None) -> Any:
    return _checked_stream_class()(inner, transfer, sock)


@functools.cache
def _checked_stream_class() -> type[Any]:
    import httpx2

    class CheckedStream(httpx2.SyncByteStream):
        """A response body that stops at a cancel, even in the middle of a read."""

        def __init__(self, inner: Any, transfer: _Transfer, sock: socket.socket | None) -> None:
            self._inner = inner
            self._transfer = transfer
            self._sock = sock
            if sock is not None:
                transfer.attach(sock)

        def __iter__(self) -> Iterator[bytes]:
            try:
                for piece in self._inner:
                    self._transfer.check()
                    yield piece
            except DownloadCancelled:
                raise
            except Exception:  # the read a cancel interrupted, or a real error
                self._transfer.check()
                raise

        def close(self) -> None:
            if self._sock is not None:
                self._transfer.detach(self._sock)
            self._inner.close()

    return CheckedStream


def _progress_class(remote: RemoteFile, progress: ProgressCallback,
                    cancelled: Callable[[], bool], model_id: str) -> type[Any]:
    """A silent tqdm that forwards byte counts to ``progress`` and aborts when cancelled."""
    from tqdm.auto import tqdm

    class Progress(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.done = 0
            progress(remote.name, 0, remote.size)

        def update(self, n: float | None = 1) -> bool | None:
            if cancelled():
                raise DownloadCancelled(f"download of {model_id} cancelled")
            self.done += int(n or 0)
            progress(remote.name, self.done, remote.size)
            return None

    return Progress


def _cached_path(repo: str, filename: str, cache: Path | None = None) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, cache_dir=cache)
    return found if isinstance(found, str) else None


def delete_cached(paths: Iterable[Path], cache: Path | None = None) -> int:
    """Delete cached files (snapshot links and their blobs) of one model; bytes freed.

    Only paths inside the HF cache are touched; anything else raises ValueError.
    """
    root = (cache or hub_cache_dir()).resolve()
    freed = 0
    for path in paths:
        blob = path.resolve()
        for target in (path.absolute(), blob):
            if not target.is_relative_to(root):
                raise ValueError(f"{target} is outside the Hugging Face cache {root}")
        if blob.exists():
            freed += blob.stat().st_size
            blob.unlink()
        path.unlink(missing_ok=True)
    return freed
