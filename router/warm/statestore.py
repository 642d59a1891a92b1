"""The router's own directory of saved slot states (llama-server KV caches), for warm swaps.

Before the router stops a model's child it may ask the child to save each slot
(``POST /slots/{id}?action=save``, the child started with ``--slot-save-path``); once a new
child of the same model and configuration is up, it restores them (``action=restore``) so that
the next turn of each conversation comes from the prompt cache. This module is the directory
those files live in: their names, their verification and their budget. Pure filesystem,
synchronous (the core calls it through ``asyncio.to_thread``), thread-safe; no HTTP.

Layout under ``root`` (the router's ``--state-dir``, created 0700)::

    root/<model-dir>/<fingerprint>/            the child's --slot-save-path
                                   tmp-<slot>-<token>.bin    a save under way: the child writes it
                                   slot-<slot>-<token>.bin   a committed state (the temp, renamed)
                                   slot-<slot>-<token>.json  its manifest
                                   tmp-<slot>-<token>.json   a manifest being written

* ``<model-dir>`` (``model_dir_name``): a sanitised readable part of the model id and 128 bits
  of its sha256, so that ids of any characters get distinct, safe directories;
* ``<fingerprint>`` (``fingerprint``): what the states were made with: the content of the
  weight files (``digests``: a model replaced by another of the same size and mtime is
  another fingerprint), the llama-server arguments that shape the KV cache or give it
  meaning (``KV_ARGS``) and the llama-server build. llama.cpp checks only a file's KV
  *layout* on restore, never which model or RoPE settings wrote it
  (tests/test_slot_state_real.py): the directory is what keeps a state from being restored
  into another configuration.

Every name the store makes is ``[A-Za-z0-9_-]`` with single dots, at most 255 bytes, never
starting with a dot or a space: llama-server accepts it as a slot filename.

Trust: a file is handed out for restore only once verified (a regular file, its size what the
child reported writing, its sha256 as at commit), since llama-server aborts on a file truncated
in its KV data and restores garbled bytes silently. The store never follows a symbolic link:
every file of the state directory (the router's others too: ``owners.key``, ``digests.json``)
is opened by ``open_regular``, without following a link, without blocking, and refused unless
it is a regular file (a FIFO there would freeze whoever opens it). It deletes only names of
its own patterns: a symlink or a file found at one of its own names is unlinked (the link,
never its target); anything else under root is left alone. It assumes that nothing but itself
and the children it names files for writes under root.

States are evicted least recently used first (``touch`` marks one used) to keep their total
within ``budget_bytes``; a model keeps at most ``MAX_STATES_PER_MODEL``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import secrets
import stat
import threading
import time
import unicodedata
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, NamedTuple

log = logging.getLogger("router.statestore")

MANIFEST_VERSION: Final = 1
FINGERPRINT_VERSION: Final = 2  # bump when what the fingerprint covers changes
MANIFEST_MAX_BYTES: Final = 64 * 1024  # a manifest read is bounded by this
PREFIX_MAX_BYTES: Final = 32 * 1024  # the caller's opaque prefix, as JSON
MODEL_ID_MAX_BYTES: Final = 4096  # longer ids get no states (their manifest would not fit)
MAX_STATES_PER_MODEL: Final = 256
MAX_SLOT: Final = 65535
READABLE_CHARS: Final = 48  # the readable part of a model directory's name
DIGEST_HEX: Final = 32  # 128 bits of the model id's sha256 in its directory's name

_MODEL_DIR: Final = re.compile(r"(?:[A-Za-z0-9_-]{1,48}\.)?[0-9a-f]{32}")
_FINGERPRINT: Final = re.compile(r"[0-9a-f]{64}")
# kind, slot, token, extension: every file name the store or a child writes for it
_FILE: Final = re.compile(r"(slot|tmp)-(0|[1-9][0-9]{0,4})-([0-9a-f]{16})\.(bin|json)")
# How every file of the state directory is opened (``open_regular``): never through a
# symbolic link, never waiting (a FIFO's open would wait for a writer), never inherited.
_O_SAFE: Final = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


# ---- the fingerprint ---------------------------------------------------------------------

@dataclass(frozen=True)
class KvArg:
    """A llama-server argument the fingerprint counts: its long name (the preset key), its
    other spellings without dashes, its environment name, a boolean's negative spellings, and
    how its value is normalised (``int``, ``float``, ``word``: lower case, ``switch``: on/off/
    auto, ``bool``, ``text``: as given)."""

    name: str
    kind: str
    shorts: tuple[str, ...] = ()
    env: str | None = None
    negatives: tuple[str, ...] = ()


# What shapes the KV cache (its size, layout, slots, streams) or the meaning of its contents
# (which weights and positions computed K and V). Placement (n-gpu-layers, devices, split,
# kv-offload, override-tensor), threads, batch sizes, sampling, the chat template, caching
# policy (cache-ram, cache-reuse, checkpoints) and the draft model do not count: llama-server
# saves the main context's KV only, and refuses a layout a placement change alters with a 400.
# The weight files themselves (model, mmproj, LoRA adapters, control vectors) are counted by
# their content (``fingerprint``'s digests).
KV_ARGS: Final[tuple[KvArg, ...]] = (
    KvArg("ctx-size", "int", ("c",), "LLAMA_ARG_CTX_SIZE"),
    KvArg("parallel", "int", ("np",), "LLAMA_ARG_N_PARALLEL"),
    KvArg("kv-unified", "bool", ("kvu",), "LLAMA_ARG_KV_UNIFIED", ("no-kvu", "no-kv-unified")),
    KvArg("kv-unified-per-slot", "int", (), "LLAMA_ARG_KV_UNIFIED_PER_SLOT"),
    KvArg("cache-type-k", "word", ("ctk",), "LLAMA_ARG_CACHE_TYPE_K"),
    KvArg("cache-type-v", "word", ("ctv",), "LLAMA_ARG_CACHE_TYPE_V"),
    KvArg("flash-attn", "switch", ("fa",), "LLAMA_ARG_FLASH_ATTN"),  # V transposed or not
    KvArg("swa-full", "bool", (), "LLAMA_ARG_SWA_FULL"),
    KvArg("rope-scaling", "word", (), "LLAMA_ARG_ROPE_SCALING_TYPE"),
    KvArg("rope-scale", "float", (), "LLAMA_ARG_ROPE_SCALE"),
    KvArg("rope-freq-base", "float", (), "LLAMA_ARG_ROPE_FREQ_BASE"),
    KvArg("rope-freq-scale", "float", (), "LLAMA_ARG_ROPE_FREQ_SCALE"),
    KvArg("yarn-orig-ctx", "int", (), "LLAMA_ARG_YARN_ORIG_CTX"),
    KvArg("yarn-ext-factor", "float", (), "LLAMA_ARG_YARN_EXT_FACTOR"),
    KvArg("yarn-attn-factor", "float", (), "LLAMA_ARG_YARN_ATTN_FACTOR"),
    KvArg("yarn-beta-slow", "float", (), "LLAMA_ARG_YARN_BETA_SLOW"),
    KvArg("yarn-beta-fast", "float", (), "LLAMA_ARG_YARN_BETA_FAST"),
    KvArg("override-kv", "text"),  # model metadata: may change RoPE, heads, anything
    KvArg("lora", "text"),
    KvArg("lora-scaled", "text"),
    KvArg("lora-init-without-apply", "bool"),
    KvArg("control-vector", "text"),
    KvArg("control-vector-scaled", "text"),
    KvArg("control-vector-layer-range", "text"),
)


def _spellings() -> dict[str, tuple[KvArg, bool]]:
    """Every spelling (no dashes) and environment name → (its KvArg, negated)."""
    table: dict[str, tuple[KvArg, bool]] = {}
    for arg in KV_ARGS:
        for spelling in (arg.name, *arg.shorts, *([arg.env] if arg.env else [])):
            table[spelling] = (arg, False)
        for spelling in arg.negatives:
            table[spelling] = (arg, True)
        if arg.negatives and arg.env:
            table["LLAMA_ARG_NO_" + arg.env.removeprefix("LLAMA_ARG_")] = (arg, True)
    return table


_SPELLINGS: Final = _spellings()
_TRUE: Final = frozenset({"on", "enabled", "true", "1", "yes", ""})  # as flags.TRUTHY, "" set
_FALSE: Final = frozenset({"off", "disabled", "false", "0", "no"})


def _normalised(arg: KvArg, value: str, negated: bool) -> str:
    """One spelling per meaning, so that ``-c 4096`` and ``ctx-size = 4096.`` agree; a value
    that does not parse stays as given (llama-server refuses it anyway)."""
    text = value.strip()
    lowered = text.lower()
    with contextlib.suppress(ValueError):
        if arg.kind == "int":
            return str(int(text, 10))
        if arg.kind == "float":
            return repr(float(text))
    if arg.kind == "bool" and (lowered in _TRUE or lowered in _FALSE):
        return "true" if (lowered in _TRUE) != negated else "false"
    if arg.kind == "switch":
        return "on" if lowered in _TRUE - {""} else "off" if lowered in _FALSE else lowered
    return lowered if arg.kind == "word" else text


def kv_args(args: Mapping[str, str]) -> dict[str, str]:
    """The arguments of ``args`` that the fingerprint counts, by long name, normalised.
    Keys may be long or short spellings, with or without dashes, or ``LLAMA_ARG_*`` names;
    when several spell one argument, the later one wins (as on llama-server's command line:
    pass inherited ``LLAMA_ARG_*`` variables first, the preset's args after)."""
    out: dict[str, str] = {}
    for key, value in args.items():
        bare = key.strip().lstrip("-")
        found = _SPELLINGS.get(bare) or _SPELLINGS.get(bare.replace("_", "-"))
        if found is not None:
            out[found[0].name] = _normalised(found[0], str(value), found[1])
    return dict(sorted(out.items()))


def fingerprint(digests: Sequence[str], args: Mapping[str, str], build: str) -> str:
    """The sha256 (hex) of what a child's KV cache depends on: the content of each weight
    file (``digests``: the model's shards, mmproj, LoRA adapters and control vectors, in the
    caller's order; ``digests.Digests``), ``kv_args(args)``, and the llama-server build (the
    file format may change between builds)."""
    canonical = {"version": FINGERPRINT_VERSION, "files": list(digests),
                 "args": kv_args(args), "build": build}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("ascii")).hexdigest()


# ---- names -------------------------------------------------------------------------------

def model_dir_name(model_id: str) -> str:
    """The directory of ``model_id`` under root: ``<readable>.<digest>`` (``<digest>`` alone
    when nothing of the id is readable ASCII). The digest makes it collision-free; the
    readable part is only for people listing the directory."""
    digest = hashlib.sha256(model_id.encode("utf-8", "surrogatepass")).hexdigest()[:DIGEST_HEX]
    ascii_id = unicodedata.normalize("NFKD", model_id).encode("ascii", "ignore").decode()
    readable = re.sub(r"[^A-Za-z0-9_-]+", "_", ascii_id).strip("_-")
    readable = readable[:READABLE_CHARS].strip("_-")
    return f"{readable}.{digest}" if readable else digest


def _check_names(model_id: str, fingerprint: str, slot: int = 0) -> None:
    if len(model_id.encode("utf-8", "surrogatepass")) > MODEL_ID_MAX_BYTES:
        raise ValueError(f"model id longer than {MODEL_ID_MAX_BYTES} bytes: no saved states")
    if not _FINGERPRINT.fullmatch(fingerprint):
        raise ValueError(f"not a fingerprint (64 hex digits): {fingerprint!r}")
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot <= MAX_SLOT:
        raise ValueError(f"slot must be an integer from 0 to {MAX_SLOT}: {slot!r}")


# ---- records -----------------------------------------------------------------------------

@dataclass(frozen=True)
class SavedState:
    """A committed state. ``filename`` is what the child's ``action=restore`` takes: relative
    to its ``--slot-save-path``, the fingerprint directory ``path.parent``. ``prefix`` is the
    caller's opaque JSON value (for prefix routing), as JSON gives it back."""

    model_id: str
    fingerprint: str
    slot: int
    path: Path
    n_saved: int  # tokens
    n_written: int  # bytes
    sha256: str
    saved_at: float  # wall-clock seconds
    last_used: float
    prefix: Any = field(default=None, hash=False)

    @property
    def filename(self) -> str:
        return self.path.name

    @property
    def manifest(self) -> Path:
        return self.path.with_suffix(".json")


@dataclass(frozen=True)
class PendingSave:
    """A save under way: send ``filename`` to the child, whose ``--slot-save-path`` is
    ``directory``; then ``commit`` (or ``abandon``) it."""

    model_id: str
    fingerprint: str
    slot: int
    path: Path  # directory / filename: the temporary file the child writes

    @property
    def filename(self) -> str:
        return self.path.name

    @property
    def directory(self) -> Path:
        return self.path.parent


@dataclass(frozen=True)
class Commit:
    """What ``commit`` did: the state kept, or None and why not (``problem``), and the other
    states it removed (the same slot's older state, the model's or the budget's excess)."""

    state: SavedState | None
    problem: str | None = None
    dropped: tuple[SavedState, ...] = ()


class Problem(NamedTuple):
    """Something removed because it could not be trusted: its path relative to root, why,
    and its model when known. Never the file's contents."""

    file: str
    reason: str
    model_id: str | None = None


class _Invalid(Exception):
    """A file or an answer that cannot be trusted; the message says why."""


def _report(problems: Sequence[Problem]) -> None:
    for problem in problems:
        extra = {"event": "state_removed"}
        if problem.model_id is not None:
            extra["model"] = problem.model_id
        log.warning("slot state %s removed: %s", problem.file, problem.reason, extra=extra)


# ---- manifests ---------------------------------------------------------------------------

def _manifest_bytes(state: SavedState) -> bytes:
    document = {"version": MANIFEST_VERSION, "model_id": state.model_id,
                "fingerprint": state.fingerprint, "slot": state.slot, "file": state.filename,
                "n_saved": state.n_saved, "n_written": state.n_written,
                "sha256": state.sha256, "saved_at": state.saved_at,
                "last_used": state.last_used, "prefix": state.prefix}
    return json.dumps(document, sort_keys=True, allow_nan=False).encode("ascii")


def _field(document: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = document.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise _Invalid(f"manifest field {key!r} missing or of the wrong type")
    return value


def _parse_manifest(data: bytes, directory: Path) -> SavedState:
    """The state a manifest in ``root/<model-dir>/<fingerprint>/`` describes; _Invalid unless
    it is well formed and belongs there: its model's directory, its fingerprint, its file's
    name (the manifest's own stem)."""
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise _Invalid(f"manifest is not JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("version") != MANIFEST_VERSION:
        raise _Invalid("manifest of an unknown version")
    model_id = _field(document, "model_id", str)
    if model_dir_name(model_id) != directory.parent.name:
        raise _Invalid("manifest of another model")
    if _field(document, "fingerprint", str) != directory.name:
        raise _Invalid("manifest of another fingerprint")
    name, slot = _field(document, "file", str), _field(document, "slot", int)
    match = _FILE.fullmatch(name)
    if not match or match[1] != "slot" or match[4] != "bin" or int(match[2]) != slot:
        raise _Invalid("manifest names another file")
    times = [_field(document, key, (int, float)) for key in ("saved_at", "last_used")]
    sha256 = _field(document, "sha256", str)
    if not all(math.isfinite(t) for t in times) or not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise _Invalid("manifest holds a bad time or checksum")
    n_saved, n_written = _field(document, "n_saved", int), _field(document, "n_written", int)
    if n_saved <= 0 or n_written <= 0:
        raise _Invalid("manifest of an empty state")
    return SavedState(model_id, directory.name, slot, directory / name, n_saved, n_written,
                      sha256, float(times[0]), float(times[1]), document.get("prefix"))


def _read_manifest(path: Path) -> bytes:
    """A manifest's bytes, at most MANIFEST_MAX_BYTES, never through a symlink or a FIFO."""
    try:
        fd = open_regular(path)
    except NotRegularFile:
        raise _Invalid("manifest is not a regular file of at most 64 KiB") from None
    try:
        if os.fstat(fd).st_size > MANIFEST_MAX_BYTES:
            raise _Invalid("manifest is not a regular file of at most 64 KiB")
        return os.read(fd, MANIFEST_MAX_BYTES + 1)
    finally:
        os.close(fd)


def _write_atomically(target: Path, data: bytes, slot: int) -> None:
    """``target`` holds ``data`` or what it held before: a temp file beside it, renamed."""
    temp = target.with_name(f"tmp-{slot}-{secrets.token_hex(8)}.json")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(temp, target)
    except BaseException:
        _unlink(temp)
        raise


# ---- files -------------------------------------------------------------------------------

class NotRegularFile(OSError):
    """A file of the state directory that is a symbolic link or not a regular file (a FIFO,
    a socket, a device, a directory): refused, never read or written through."""

    def __str__(self) -> str:
        return f"{self.filename} is {self.strerror}"


def _kind(mode: int) -> str:
    return ("a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode)
            else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")


def open_regular(path: Path, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor of the regular file at ``path``, opened with ``flags`` (``O_RDONLY``,
    ``O_RDWR | O_CREAT``...) and never through a symbolic link, never blocking, then checked
    (``fstat``): a link, a FIFO or anything else but a regular file is ``NotRegularFile``
    (which says what it is), other failures as ``os.open`` raises them. The one way every
    file of the state directory is opened to be read (``owners.key``, ``digests.json``,
    manifests, states, the lock): a FIFO planted there never freezes the router."""
    try:
        fd = os.open(path, flags | _O_SAFE, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW: the last part of the path is a link
            raise NotRegularFile(errno.ELOOP, "a symbolic link (never followed)",
                                 str(path)) from None
        raise
    found = os.fstat(fd).st_mode
    if not stat.S_ISREG(found):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, f"not a regular file ({_kind(found)})", str(path))
    return fd


def _unlink(path: Path) -> bool:
    """Remove a file or a symlink (never what it points to); False when there was none or it
    is a directory."""
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def _sha256(path: Path, size: int) -> str:
    """The sha256 of a regular file of ``size`` bytes; _Invalid if it is something else."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise _Invalid("file missing") from None
    except NotRegularFile:
        raise _Invalid("not a regular file") from None
    except OSError as exc:
        raise _Invalid(f"cannot open the file ({exc.strerror})") from None
    with os.fdopen(fd, "rb", buffering=0) as handle:
        info = os.fstat(fd)
        if info.st_size != size:
            raise _Invalid(f"{info.st_size} bytes where {size} were written")
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
        if os.fstat(fd).st_size != size:
            raise _Invalid("the file changed while it was read")
    return digest


def _entries(directory: Path, pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    """(name, kind) of the entries of ``directory`` whose names match ``pattern``; kind is
    ``dir``, ``file`` (regular) or ``other`` (a symlink, a FIFO...), read without following
    links; nothing when ``directory`` is not a real directory."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []
    found: list[tuple[str, str]] = []
    try:
        with os.scandir(fd) as scan:
            for entry in scan:
                if pattern.fullmatch(entry.name):
                    kind = ("dir" if entry.is_dir(follow_symlinks=False) else
                            "file" if entry.is_file(follow_symlinks=False) else "other")
                    found.append((entry.name, kind))
    finally:
        os.close(fd)
    return found


def _ensure_dir(path: Path) -> None:
    """``path`` is a real directory (0700): anything else at its name is unlinked first."""
    for _ in range(2):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return
        _unlink(path)
    raise OSError(f"cannot make the directory {path}")


def _clear_dir(directory: Path) -> int:
    """Remove the store's files from ``directory``, then the directory if empty; the number
    of files removed."""
    removed = sum(_unlink(directory / name) for name, kind in _entries(directory, _FILE)
                  if kind != "dir")
    with contextlib.suppress(OSError):
        os.rmdir(directory)
    return removed


def _prepare_root(root: Path) -> Path:
    path = Path(os.path.abspath(root))
    try:
        if not os.path.lexists(path):
            path.mkdir(mode=0o700, parents=True)
            os.chmod(path, 0o700)
        info = os.lstat(path)
    except OSError as exc:
        raise ValueError(f"state directory {path}: cannot create it ({exc.strerror})") from None
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(f"state directory {path} is a symbolic link: give the directory it "
                         "points to")
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"state directory {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"state directory {path} is not writable")
    return path


LOCK_NAME: Final = ".lock"  # held (flock) by the one store that owns root


def claim_root(root: Path) -> int:
    """An exclusive lock on ``root`` (created if missing) for this process, to hold for its
    life (the descriptor returned): a second router on the same directory is refused with
    ValueError, since a store removes what it did not write."""
    root = _prepare_root(root)
    fd = open_regular(root / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise ValueError(f"state directory {root} is in use by another router: give each "
                         "router a --state-dir of its own") from None
    return fd


# ---- scanning ----------------------------------------------------------------------------

def _scan_fingerprint(directory: Path, root: Path) -> tuple[list[SavedState], list[Problem]]:
    """The states of one fingerprint directory that look whole (manifest parses and belongs
    here, its file is regular and of its size); every other file of the store's is removed.
    Checksums are left to ``states`` (reading every file at startup would take minutes)."""
    problems: list[Problem] = []
    found: dict[tuple[str, str], dict[str, str]] = {}
    for name, kind in _entries(directory, _FILE):
        match = _FILE.fullmatch(name)
        assert match is not None
        if kind == "dir":
            continue
        if match[1] == "tmp" or kind != "file":
            _unlink(directory / name)
            why = "an unfinished save" if kind == "file" else "not a regular file"
            problems.append(Problem(str((directory / name).relative_to(root)), why))
            continue
        found.setdefault((match[2], match[3]), {})[match[4]] = name
    states: list[SavedState] = []
    for pair in found.values():
        try:
            if set(pair) != {"bin", "json"}:
                raise _Invalid("a file without its manifest" if "bin" in pair
                               else "a manifest without its file")
            state = _parse_manifest(_read_manifest(directory / pair["json"]), directory)
            info = os.lstat(state.path)
            if not stat.S_ISREG(info.st_mode) or info.st_size != state.n_written:
                raise _Invalid("file of another size than its manifest says")
            states.append(state)
        except (OSError, _Invalid) as exc:
            for name in pair.values():
                _unlink(directory / name)
                problems.append(Problem(str((directory / name).relative_to(root)), str(exc)))
    return states, problems


def _scan_root(root: Path) -> tuple[list[SavedState], list[Problem]]:
    states: list[SavedState] = []
    problems: list[Problem] = []
    for model_name, kind in _entries(root, _MODEL_DIR):
        model_dir = root / model_name
        if kind != "dir":
            _unlink(model_dir)
            problems.append(Problem(model_name, "not a directory"))
            continue
        for fp_name, fp_kind in _entries(model_dir, _FINGERPRINT):
            if fp_kind != "dir":
                _unlink(model_dir / fp_name)
                problems.append(Problem(f"{model_name}/{fp_name}", "not a directory"))
                continue
            more, trouble = _scan_fingerprint(model_dir / fp_name, root)
            states += more
            problems += trouble
            if not more:
                with contextlib.suppress(OSError):
                    os.rmdir(model_dir / fp_name)
        with contextlib.suppress(OSError):
            os.rmdir(model_dir)
    return states, problems


def _verify(state: SavedState) -> str | None:
    """Why ``state`` cannot be restored now, or None: its manifest still says what the index
    does, and its file is regular, of its size, with its checksum."""
    try:
        on_disk = _parse_manifest(_read_manifest(state.manifest), state.path.parent)
    except FileNotFoundError:
        return "its manifest is missing"
    except (OSError, _Invalid) as exc:
        return str(exc)
    if replace(on_disk, last_used=state.last_used, prefix=None) != replace(state, prefix=None):
        return "its manifest changed"
    try:
        digest = _sha256(state.path, state.n_written)
    except _Invalid as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot read the file ({exc.strerror})"
    return None if digest == state.sha256 else "checksum mismatch (garbled)"


def _answer(pending: PendingSave, answer: Mapping[str, Any]) -> tuple[int, int]:
    """(n_saved, n_written) of a child's answer to ``action=save``; _Invalid if malformed."""
    n_saved, n_written = answer.get("n_saved"), answer.get("n_written")
    if (isinstance(n_saved, bool) or isinstance(n_written, bool)
            or not isinstance(n_saved, int) or not isinstance(n_written, int)
            or n_saved < 0 or n_written < 0):
        raise _Invalid("the child's answer lacks n_saved or n_written")
    if answer.get("filename", pending.filename) != pending.filename:
        raise _Invalid("the child's answer names another file")
    return n_saved, n_written


def _lru(state: SavedState) -> tuple[float, float, str]:
    return state.last_used, state.saved_at, str(state.path)


def _newest(state: SavedState) -> tuple[float, str]:
    return -state.saved_at, str(state.path)


class _Index:
    """The states the store holds, by file path; no I/O. The one record of what is on disk
    (rebuilt by ``scan``), read for budgets, usage and restores."""

    def __init__(self, states: Sequence[SavedState] = ()) -> None:
        self.by_path: dict[Path, SavedState] = {}
        self.total = 0
        self.version = 0  # changes with every add and remove
        for state in states:
            self.add(state)

    def add(self, state: SavedState) -> None:
        self.remove(state.path)
        self.by_path[state.path] = state
        self.total += state.n_written
        self.version += 1

    def remove(self, path: Path) -> SavedState | None:
        state = self.by_path.pop(path, None)
        if state is not None:
            self.total -= state.n_written
            self.version += 1
        return state

    def of(self, model_id: str) -> list[SavedState]:
        return [s for s in self.by_path.values() if s.model_id == model_id]

    def usage(self) -> dict[str, tuple[int, int]]:
        usage: dict[str, tuple[int, int]] = {}
        for state in self.by_path.values():
            count, size = usage.get(state.model_id, (0, 0))
            usage[state.model_id] = (count + 1, size + state.n_written)
        return usage

    def surplus(self, budget: int, keep: Path | None) -> list[SavedState]:
        """The states to drop, least recently used first, never ``keep``: those beyond
        MAX_STATES_PER_MODEL of their model, then those beyond ``budget`` bytes in all."""
        lru = sorted((s for s in self.by_path.values() if s.path != keep), key=_lru)
        counts = {model: count for model, (count, _) in self.usage().items()}
        chosen: dict[Path, SavedState] = {}
        for state in lru:
            if counts[state.model_id] > MAX_STATES_PER_MODEL:
                counts[state.model_id] -= 1
                chosen[state.path] = state
        total = self.total - sum(s.n_written for s in chosen.values())
        for state in lru:
            if total <= budget:
                break
            if state.path not in chosen:
                chosen[state.path] = state
                total -= state.n_written
        return list(chosen.values())


class StateStore:
    """The directory of saved slot states (module docstring). Every method is synchronous
    and thread-safe; those that read whole state files (``commit``, ``states``) do so outside
    the lock. The constructor runs ``scan``."""

    def __init__(self, root: Path, budget_bytes: int, *,
                 clock: Callable[[], float] = time.time) -> None:
        """``root`` (``--state-dir``) is created 0700 if missing; a symlink, a non-directory
        or an unwritable one is refused with ValueError. (One router per root: ``claim_root``
        first.) ``clock``: wall-clock seconds."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) \
                or budget_bytes < 0:
            raise ValueError(f"state budget must be a number of bytes ≥ 0: {budget_bytes!r}")
        self.root = _prepare_root(root)
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._lock = threading.Lock()
        self._index = _Index()
        self._scans = 0
        self.scan()

    def scan(self) -> list[Problem]:
        """Rebuild the index from disk, removing leftovers (temp files, files without their
        manifest and the reverse, manifests that do not parse or belong elsewhere) and what
        exceeds the budget. For startup: a save under way loses its temp file (its commit
        then fails cleanly). A slot may have several states (one per conversation saved from
        it): which supersede which was decided at each commit."""
        with self._lock:
            states, problems = _scan_root(self.root)
            self._index = _Index(states)
            self._scans += 1
            self._enforce(keep=None)
        _report(problems)
        return problems

    def directory(self, model_id: str, fingerprint: str) -> Path:
        """The fingerprint directory, created: the child's ``--slot-save-path``. ValueError
        for a fingerprint that is not 64 hex digits or a model id over MODEL_ID_MAX_BYTES."""
        _check_names(model_id, fingerprint)
        model_dir = self.root / model_dir_name(model_id)
        _ensure_dir(model_dir)
        _ensure_dir(model_dir / fingerprint)
        return model_dir / fingerprint

    def begin_save(self, model_id: str, fingerprint: str, slot: int) -> PendingSave:
        """A fresh temporary file name for the child to save ``slot`` to (nothing is there)."""
        _check_names(model_id, fingerprint, slot)
        directory = self.directory(model_id, fingerprint)
        return PendingSave(model_id, fingerprint, slot,
                           directory / f"tmp-{slot}-{secrets.token_hex(8)}.bin")

    def abandon(self, pending: PendingSave) -> None:
        """Remove a save's temp file (the save failed or took too long); a child that still
        writes it later leaves a leftover for the next ``scan``."""
        _unlink(pending.path)

    def commit(self, pending: PendingSave, answer: Mapping[str, Any],
               prefix: Any = None, replaces: Callable[[SavedState], bool] | None = None
               ) -> Commit:
        """Keep the file the child wrote for ``pending``, given its answer to ``action=save``:
        a regular file of ``n_written`` bytes with ``n_saved`` > 0 tokens, checksummed,
        renamed to its final name, its manifest written beside it; the older states it
        supersedes are dropped (``replaces``, asked of each state of its model and
        fingerprint; default: the slot's older states), and the least recently used others
        while over the budget. Not kept (temp removed, ``problem`` says why): an empty slot, a
        state over the whole budget, a file that does not match the answer. ``prefix``: any
        JSON value of at most PREFIX_MAX_BYTES, kept in the manifest (else ValueError, the
        save abandoned)."""
        try:
            encoded = json.dumps(prefix, allow_nan=False)
            if len(encoded) > PREFIX_MAX_BYTES:
                raise ValueError(f"prefix over {PREFIX_MAX_BYTES} bytes as JSON")
        except (TypeError, ValueError) as exc:
            self.abandon(pending)
            raise ValueError(f"prefix: {exc}") from None
        try:
            n_saved, n_written = _answer(pending, answer)
            if n_saved == 0:
                self.abandon(pending)
                return Commit(None, "the slot was empty (n_saved 0)")
            if n_written == 0:
                raise _Invalid("the child wrote nothing (n_written 0)")
            if n_written > self.budget_bytes:
                raise _Invalid(f"{n_written} bytes, over the whole state budget "
                               f"({self.budget_bytes} bytes)")
            info = os.lstat(pending.path)
            if not stat.S_ISREG(info.st_mode):
                raise _Invalid("not a regular file")
            sha256 = _sha256(pending.path, n_written)
        except (OSError, _Invalid) as exc:
            reason = "file missing" if isinstance(exc, FileNotFoundError) else str(exc)
            self.abandon(pending)
            _report([Problem(self._relative(pending.path), reason, pending.model_id)])
            return Commit(None, reason)
        now = float(self._clock())
        state = SavedState(pending.model_id, pending.fingerprint, pending.slot,
                           pending.path.with_name("slot" + pending.filename[3:]), n_saved,
                           n_written, sha256, now, now, json.loads(encoded))
        return self._keep(pending, state, replaces)

    def _keep(self, pending: PendingSave, state: SavedState,
              replaces: Callable[[SavedState], bool] | None) -> Commit:
        with self._lock:
            try:
                os.rename(pending.path, state.path)
                _write_atomically(state.manifest, _manifest_bytes(state), state.slot)
            except OSError as exc:
                self.abandon(pending)
                _unlink(state.path)
                return Commit(None, f"cannot keep the file ({exc.strerror})")
            dropped = [s for s in self._index.of(state.model_id)
                       if s.fingerprint == state.fingerprint and s.path != state.path
                       and (s.slot == state.slot if replaces is None else replaces(s))]
            for older in dropped:
                self._delete(older)
            self._index.add(state)
            dropped += self._enforce(keep=state.path)
        return Commit(state, None, tuple(dropped))

    def states(self, model_id: str, fingerprint: str) -> list[SavedState]:
        """The states to restore into a new child of this configuration, newest first, one
        per slot (the slot's newest whole one), each verified just now; those that fail are
        removed and logged. The model's states of other fingerprints are removed too: the
        model's configuration (preset, files or build) changed, and a child of this one can
        never restore them."""
        _check_names(model_id, fingerprint)
        with self._lock:
            self._drop_stale(model_id, fingerprint)
            candidates = sorted((s for s in self._index.of(model_id)
                                 if s.fingerprint == fingerprint), key=_newest)
        chosen: dict[int, SavedState] = {}
        for state in candidates:  # a damaged one gives way to the slot's next newest
            if state.slot not in chosen and self.verify(state):
                chosen[state.slot] = state
        return sorted(chosen.values(), key=_newest)

    @property
    def version(self) -> tuple[int, int]:
        """What changes whenever a state is kept, touched or removed, or the store scanned:
        a caller's view of the states is current while it holds."""
        return self._scans, self._index.version

    def listed(self, model_id: str, fingerprint: str) -> list[SavedState]:
        """The model's states of this configuration as the index holds them, unverified
        (``verify`` one before it is restored)."""
        with self._lock:
            return [s for s in self._index.of(model_id) if s.fingerprint == fingerprint]

    def verify(self, state: SavedState) -> bool:
        """Whether ``state`` is whole now (read and checksummed); one that is not is removed
        and logged."""
        reason = _verify(state)
        if reason is None:
            return True
        with self._lock:
            if self._index.by_path.get(state.path) == state:
                self._delete(state)
        _report([Problem(self._relative(state.path), reason, state.model_id)])
        return False

    def drop_stale(self, model_id: str, fingerprint: str) -> int:
        """Remove the model's states of every other fingerprint (another configuration, or
        other weights: a child of this one can never take them); how many there were."""
        _check_names(model_id, fingerprint)
        with self._lock:
            return self._drop_stale(model_id, fingerprint)

    def _drop_stale(self, model_id: str, fingerprint: str) -> int:
        model_dir = self.root / model_dir_name(model_id)
        stale = [s for s in self._index.of(model_id) if s.fingerprint != fingerprint]
        for state in stale:
            self._delete(state)
        removed = 0
        for name, kind in _entries(model_dir, _FINGERPRINT):
            if name != fingerprint:
                removed += _clear_dir(model_dir / name) if kind == "dir" \
                    else _unlink(model_dir / name)
        if stale or removed:
            log.info("removed %d saved slot states of an earlier configuration or other "
                     "weights", len(stale), extra={"event": "state_stale", "model": model_id})
        return len(stale)

    def touch(self, state: SavedState) -> SavedState | None:
        """Mark ``state`` used now (its manifest's ``last_used``), so that the budget drops it
        last; the updated record, or None when the store no longer holds it."""
        with self._lock:
            current = self._index.by_path.get(state.path)
            if current is None:
                return None
            updated = replace(current, last_used=max(float(self._clock()), current.last_used))
            try:
                _write_atomically(updated.manifest, _manifest_bytes(updated), updated.slot)
            except OSError as exc:
                log.warning("cannot mark slot state %s used (%s)", self._relative(state.path),
                            exc.strerror, extra={"model": state.model_id})
                return current
            self._index.add(updated)
            return updated

    def discard(self, state: SavedState) -> None:
        """Remove ``state``'s file and manifest (e.g. its restore failed)."""
        with self._lock:
            self._delete(state)

    def remove_model(self, model_id: str) -> int:
        """Remove every state of ``model_id`` and its directory (its preset is gone); the
        number of states removed. Call it once its child has stopped."""
        model_dir = self.root / model_dir_name(model_id)
        with self._lock:
            states = self._index.of(model_id)
            for state in states:
                self._delete(state)
            for name, kind in _entries(model_dir, _FINGERPRINT):
                _clear_dir(model_dir / name) if kind == "dir" else _unlink(model_dir / name)
            with contextlib.suppress(OSError):
                os.rmdir(model_dir)
            if os.path.islink(model_dir):
                _unlink(model_dir)
        return len(states)

    def usage(self) -> dict[str, tuple[int, int]]:
        """Per model id with states: (how many, their bytes)."""
        with self._lock:
            return self._index.usage()

    def _delete(self, state: SavedState) -> None:
        """(Lock held.) The manifest first: a crash in between leaves a file ``scan`` drops."""
        self._index.remove(state.path)
        _unlink(state.manifest)
        _unlink(state.path)

    def _enforce(self, keep: Path | None) -> list[SavedState]:
        """(Lock held.) Drop what exceeds the per-model count and the budget."""
        dropped = self._index.surplus(self.budget_bytes, keep)
        for state in dropped:
            self._delete(state)
            log.info("dropped saved slot state %s (least recently used, over the budget)",
                     self._relative(state.path),
                     extra={"event": "state_evicted", "model": state.model_id})
        return dropped

    def _relative(self, path: Path) -> str:
        return str(path.relative_to(self.root))
