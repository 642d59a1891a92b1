"""The content of the files a model's KV cache depends on, as sha256 digests (``Digests``),
computed once per file version and kept across restarts.

A saved slot state is valid only in the weights that computed it (``statestore``'s
fingerprint). A file's path, size and mtime do not say which weights it holds: replaced in
place by another model of the same size with its mtime kept (``cp -p``, ``rsync -a``, image
layers with normalised mtimes), it would take the old states, and the answers would silently
change. Its content does. Hashing a model costs about a second per 1.4 GB here, so a digest is
kept per file *version*: the device, inode, size, mtime and ctime of the file (the ctime
changes with every write and no tool can set it back), in memory and in ``digests.json``
under the state directory. A load pays for a file version once, and a restart pays nothing.

A file that changes while it is hashed is hashed again. Nothing here follows a path twice
for one answer: a version is read from one ``stat`` of the resolved path. ``digests.json`` is
read as every file of the state directory is (``statestore.open_regular``): a link, a FIFO or
anything but a regular file there is ignored with a warning (and replaced at the next write),
never followed or waited on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from .statestore import open_regular

log = logging.getLogger("router.digests")

CACHE_NAME = "digests.json"  # under the state directory
MAX_KEPT = 4096  # file versions remembered (the oldest go first)
CACHE_MAX_BYTES = 1 << 20
_CHUNK = 1 << 20


class Version(NamedTuple):
    """One version of a file: what ``stat`` says of it."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int


def version_of(path: Path) -> Version:
    """The version of the file at ``path`` (symbolic links followed); OSError if none."""
    info = os.stat(path)
    return Version(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _sha256(path: Path) -> tuple[Version, str] | None:
    """The file's version and the digest of its content, or None when it changed while it
    was read (a copy still being written)."""
    before = version_of(path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return (before, digest.hexdigest()) if version_of(path) == before else None


class Digests:
    """Content digests of files by version, computed in a thread, one file at a time."""

    def __init__(self, cache_file: Path | None = None) -> None:
        self._cache_file = cache_file
        self._known: dict[Version, str] = {}
        self._running: dict[Version, asyncio.Task[str | None]] = {}
        self._lock = asyncio.Lock()  # one file hashed at a time: the disk is shared
        self._writing = threading.Lock()  # the table and its file, written from a thread
        if cache_file is not None:
            self._load(cache_file)

    def known(self, path: Path) -> str | None:
        """The digest of the file's current version when it is known (one ``stat``); None
        when it is not yet, or the file cannot be read."""
        try:
            return self._known.get(version_of(path))
        except OSError:
            return None

    def known_all(self, paths: Sequence[Path]) -> list[str] | None:
        """The digests of ``paths`` when all are known, else None."""
        found = [self.known(path) for path in paths]
        return None if None in found else found  # type: ignore[return-value]

    async def compute(self, paths: Sequence[Path]) -> list[str] | None:
        """The digests of ``paths``, computing those not known yet; None when a file cannot
        be read or keeps changing. A caller that stops waiting leaves the work going on (the
        next caller gets its result)."""
        found: list[str] = []
        for path in paths:
            try:
                version = version_of(path)
            except OSError:
                return None  # no file to read (the load says why)
            digest = self._known.get(version)
            if digest is None:
                digest = await asyncio.shield(self._task(path, version))
            if digest is None:
                return None
            found.append(digest)
        return found

    def _task(self, path: Path, version: Version) -> asyncio.Task[str | None]:
        """The computation of ``path``'s digest at ``version``: one per version, shared by
        every caller waiting for it."""
        task = self._running.get(version)
        if task is None:
            task = self._running[version] = asyncio.get_running_loop().create_task(
                self._hash(path, version))
        return task

    async def _hash(self, path: Path, version: Version) -> str | None:
        try:
            async with self._lock:
                return await asyncio.to_thread(self.digest_now, path)
        finally:
            self._running.pop(version, None)

    def digest_now(self, path: Path) -> str | None:
        """The digest of ``path``'s content, computed on the calling thread (blocking: a
        thread's work) and remembered; None when it cannot be read or keeps changing."""
        for _ in range(3):  # a file being written: again, a few times
            try:
                done = _sha256(path)
            except OSError as exc:
                log.warning("cannot read %s to fingerprint it: %s", path, exc)
                return None
            if done is not None:
                self._remember(*done)
                return done[1]
        log.warning("%s kept changing while it was read; not fingerprinted", path)
        return None

    def _remember(self, version: Version, digest: str) -> None:
        with self._writing:
            self._known[version] = digest
            while len(self._known) > MAX_KEPT:
                del self._known[next(iter(self._known))]
            if self._cache_file is not None:
                self._save(self._cache_file)

    def _load(self, cache_file: Path) -> None:
        try:
            fd = open_regular(cache_file)  # a FIFO or a link there: refused, never waited on
            with open(fd, "rb") as handle:
                data = json.loads(handle.read(CACHE_MAX_BYTES + 1) or b"{}")
            for row in data.get("digests", [])[-MAX_KEPT:]:
                *fields, digest = row
                if len(fields) == 5 and all(isinstance(f, int) for f in fields) \
                        and isinstance(digest, str) and len(digest) == 64:
                    self._known[Version(*fields)] = digest
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning("ignoring %s: %s", cache_file, exc)

    def _save(self, cache_file: Path) -> None:
        rows = [[*version, digest] for version, digest in self._known.items()]
        temp = cache_file.with_name(f".{cache_file.name}.tmp")
        try:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()  # a leftover, or a link planted there: never followed
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            with open(fd, "w", encoding="ascii") as handle:
                json.dump({"version": 1, "digests": rows}, handle, separators=(",", ":"))
            os.replace(temp, cache_file)
        except OSError as exc:
            log.warning("cannot keep the file digests in %s: %s", cache_file, exc)
            with contextlib.suppress(OSError):
                temp.unlink()
