"""Live configuration: re-read presets, models directories and the API key file, and apply
the difference.

Triggers: a change to a watched file (watchfiles, debounced; the parent directories are
watched so editors' rename-on-save and Kubernetes/docker symlink swaps are seen), SIGHUP,
``POST /models/reload`` and ``GET /models?reload=1``. Reloads are serialised. An invalid
configuration is rejected whole: the last good one stays in effect and the error (every
``file:line`` problem) is logged, sent on ``/models/sse`` and shown by ``GET /props`` until a
valid configuration replaces it. A configuration that defines no model while the running one
defines some (an emptied or truncated preset file, one left with only ``[*]`` or comments, an
emptied models directory) is rejected the same way, unless the reload is explicitly asked to
``allow_empty`` (``POST /models/reload {"allow_empty": true}``): a half-written file must never
stop every model. Router settings (flags and environment) are not re-read.

The ``--api-key-file`` is watched and re-read by the same triggers (``KeyFile``), and applied
on its own: a broken preset never holds back a key's removal, nor a broken key file a preset
change. Its keys are read as at start (``settings.read_api_keys``, with the ``--api-key``
keys, which stay) and put in force whole (``keys.Keys.swap``): removed keys are refused from
their next request and their requests in flight end; changed scopes and policies apply to
new requests. A key file with problems is rejected whole, each problem logged as
``file:line: problem`` (never a key), and so is one that gives no key at all: the last good
keys stay in force (a router started with keys never serves without them).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import watchfiles

from ..config.presets import PresetsInvalid
from ..config.settings import ApiKeysInvalid, Settings
from ..config.sources import Catalogue, build_catalogue
from ..core.view import Models
from ..events import MODELS_RELOADED, EventBus
from ..llama.flags import FlagTable, Option
from . import defaults
from .keys import Keys

log = logging.getLogger("router.reload")

DEBOUNCE_MS = 150
# How often the watcher's thread wakes to look at what changed (and whether to stop): each
# wake takes the GIL from the event loop, so this is what an idle router spends on watching
# (20 wakes a second at watchfiles' default of 50 ms cost ~1.5 ms of CPU a second). A change
# is applied within about two steps of the last write to it.
WATCH_STEP_MS = 500
NOT_RELOADED = ("router settings (command-line flags and LLAMA_ROUTER_* environment) are "
                "read only at start; restart the router to change them")


def configured_models(catalogue: Catalogue) -> int:
    """How many models the preset files and models directories define. Models found only in
    the Hugging Face cache do not count: they are not configuration, and they stay listed
    whatever the files say."""
    return sum(1 for model in catalogue.models.values() if model.source != "cache")


def fingerprint(paths: list[Path]) -> str:
    """A hash of every file's bytes and every directory's listing of GGUF files (what a
    reading error was, for a path that cannot be read)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.fsencode(path))  # bytes: a name need not be UTF-8
        try:
            if path.is_dir():
                for entry in sorted(path.rglob("*.gguf")):
                    digest.update(os.fsencode(entry))
            else:
                digest.update(path.read_bytes())
        except OSError as exc:
            digest.update(repr(exc).encode())
    return digest.hexdigest()


def report_rejected(events: EventBus, problems: list[str], trigger: str) -> None:
    """Log and publish why a reload applied nothing of a file (its previous state stays)."""
    for problem in problems:
        log.error("reload rejected: %s", problem, extra={"event": "reload_failed"})
    events.publish("*", "models_reload_failed", {"errors": problems, "trigger": trigger})


class KeyFile:
    """The ``--api-key-file`` as reloads see it: re-read as at start and put in force whole
    (``keys``), or rejected whole with the last good keys staying (see the module
    docstring); ``error``: the problems of the last rejected reading, None once one is
    applied."""

    def __init__(self, settings: Settings, keys: Keys, events: EventBus) -> None:
        assert settings.api_key_file is not None
        self.settings = settings
        self.path = settings.api_key_file.expanduser().absolute()
        self.keys = keys
        self.events = events
        self.error: list[str] | None = None
        self.fingerprint = fingerprint([self.path])

    def changed(self) -> bool:
        """Whether the file's bytes changed since the last look (now noted)."""
        now = fingerprint([self.path])
        changed, self.fingerprint = now != self.fingerprint, now
        return changed

    async def reload(self, trigger: str) -> dict[str, int] | None:
        """Read the keys and put them in force: what changed, or None when rejected (then
        ``error`` says why)."""
        problems: list[str] = []
        try:  # the file read stays off the event loop
            keys = await asyncio.to_thread(self.settings.read_api_keys)
        except ApiKeysInvalid as exc:
            keys, problems = [], exc.problems
        if not problems and not keys:
            problems = [f"{self.settings.no_keys()}; keeping the last good keys: a router "
                        "started with keys never serves without them (restart it without "
                        "--api-key-file to serve without keys)"]
        if problems:
            self.error = problems
            report_rejected(self.events, problems, trigger)
            return None
        self.error = None
        changed = self.keys.swap(keys)
        log.info("API keys reloaded (%s): %s", trigger, changed.describe(),
                 extra={"event": "keys_reloaded"})
        return {"added": changed.added, "removed": changed.removed,
                "changed": changed.changed, "ended": changed.ended}


class Reloader:
    def __init__(self, settings: Settings, table: FlagTable, overrides: list[tuple[Option, str]],
                 models: Models, events: EventBus,
                 notify: Callable[..., None] = lambda *fields: None,
                 keys: Keys | None = None) -> None:
        """``keys``: the keys in force, which a reload of ``--api-key-file`` swaps (None, or
        no key file: only the presets and models directories are reloaded)."""
        self.settings = settings
        self.table = table
        self.overrides = overrides
        self.models = models
        self.events = events
        self.notify = notify
        self._preset_error: list[str] | None = None  # of the last rejected configuration
        self.key_file = KeyFile(settings, keys, events) \
            if keys is not None and settings.api_key_file is not None else None
        self._lock = asyncio.Lock()
        self._fingerprint = self._read_fingerprint()

    @property
    def error(self) -> list[str] | None:
        """Every problem of the last rejected presets and key file (``/props``'s
        ``config_error``); None while both are in force as the files say."""
        key_error = self.key_file.error if self.key_file is not None else None
        if self._preset_error is None and key_error is None:
            return None
        return [*(self._preset_error or ()), *(key_error or ())]

    def _sources(self) -> list[Path]:
        return [p.expanduser().absolute() for p in [*self.settings.presets,
                                                    *self.settings.models_dir]]

    def _read_fingerprint(self) -> str:
        """A hash of every preset file's bytes and every models-dir listing."""
        return fingerprint(self._sources())

    async def reload(self, trigger: str, *, force: bool = True,
                     allow_empty: bool = False) -> dict[str, Any]:
        """Re-read everything and apply the difference; the outcome as a dict: the presets'
        (``_apply``), with ``keys`` (what changed) when the key file was applied, and its
        problems added to ``errors`` when it was rejected.

        ``force``: re-read even if no watched file changed (else only what changed).
        ``allow_empty``: accept a configuration with no models although the running one has
        some (otherwise rejected).
        """
        async with self._lock:
            now = self._read_fingerprint()
            presets = force or now != self._fingerprint
            keys = self.key_file is not None and (self.key_file.changed() or force)
            if not presets and not keys:
                return {"success": True, "unchanged": True}
            self._fingerprint = now
            self.notify("RELOADING=1")
            try:
                return await self._reload(trigger, presets=presets, keys=keys,
                                          allow_empty=allow_empty)
            finally:
                self.notify("READY=1")

    async def _reload(self, trigger: str, *, presets: bool, keys: bool,
                      allow_empty: bool) -> dict[str, Any]:
        """The key file first (a removal takes effect at once), then the presets."""
        changed = await self.key_file.reload(trigger) if keys and self.key_file else None
        outcome: dict[str, Any] = {"success": True}
        if presets:
            outcome = await self._apply(trigger, allow_empty=allow_empty)
        if changed is not None:
            outcome["keys"] = changed
        elif keys and self.key_file is not None and self.key_file.error is not None:
            outcome["success"] = False
            outcome["errors"] = [*outcome.get("errors", ()), *self.key_file.error]
        return outcome

    async def _apply(self, trigger: str, *, allow_empty: bool) -> dict[str, Any]:
        try:  # file reads and the HF cache scan stay off the event loop
            catalogue = await asyncio.to_thread(build_catalogue, self.settings.presets,
                                                self.settings.models_dir, self.table,
                                                self.overrides)
        except PresetsInvalid as exc:
            return self._reject([str(p) for p in exc.problems], trigger)
        emptied = None if allow_empty else self._emptied(catalogue)
        if emptied is not None:
            return self._reject([emptied], trigger)
        if (no_default := defaults.check(self.settings.default_model, catalogue)) is not None:
            return self._reject([f"{no_default}; keeping the previous configuration"],
                                trigger)
        self._preset_error = None
        for warning in catalogue.warnings:
            log.warning("%s", warning)
        diff = self.models.reconfigure(catalogue)
        log.info("configuration reloaded (%s): added %s, removed %s, changed %s", trigger,
                 diff["added"] or "none", diff["removed"] or "none", diff["changed"] or "none",
                 extra={"event": "reloaded"})
        self.events.publish("*", MODELS_RELOADED, {**diff, "trigger": trigger})
        return {"success": True, **diff, "not_reloaded": NOT_RELOADED}

    def _reject(self, problems: list[str], trigger: str) -> dict[str, Any]:
        """Keep the running configuration: record, log and publish why the new one is not
        applied (shown by ``GET /props`` as ``config_error`` until a reload succeeds)."""
        self._preset_error = problems
        report_rejected(self.events, problems, trigger)
        return {"success": False, "errors": problems}

    def _emptied(self, catalogue: Catalogue) -> str | None:
        """Why ``catalogue`` may not replace the running one without ``allow_empty``: it
        configures no model while the running one configures some; None if it may."""
        before = configured_models(self.models.catalogue)
        if configured_models(catalogue) or not before:
            return None
        where = ", ".join(str(p) for p in self._sources())
        plural = "" if before == 1 else "s"
        return (f"{where}: no models defined; keeping the previous configuration ({before} "
                f"model{plural}); to remove every model, reload with allow_empty "
                '(POST /models/reload {"allow_empty": true})')

    async def watch(self) -> None:
        """Reload when a watched file changes (content, not just mtime): the directories
        holding preset files and the key file (not recursively) and the models directories
        (recursively)."""
        logging.getLogger("watchfiles").setLevel(logging.WARNING)
        files = {p for p in self._sources() if not p.is_dir()}
        if self.key_file is not None:
            files.add(self.key_file.path)
        dirs = {p for p in self._sources() if p.is_dir()}
        watchers = []
        if files:
            names = {str(p) for p in files}

            def watched_files_only(change: watchfiles.Change, path: str) -> bool:
                # The file itself (edits, rename-on-save), or a Kubernetes/docker ConfigMap
                # or Secret swap of the hidden ``..data`` symlink next to it.
                return path in names or Path(path).name.startswith("..")

            watchers.append(self._watch({p.parent for p in files}, recursive=False,
                                        only=watched_files_only))
        if dirs:
            watchers.append(self._watch(dirs, recursive=True, only=None))
        await asyncio.gather(*watchers)

    async def _watch(self, paths: set[Path], *, recursive: bool,
                     only: Callable[[watchfiles.Change, str], bool] | None) -> None:
        async for _ in watchfiles.awatch(*paths, watch_filter=only, debounce=DEBOUNCE_MS,
                                         step=WATCH_STEP_MS,
                                         recursive=recursive):
            try:
                await self.reload("file change", force=False)
            except Exception:  # a reload must never kill the watcher
                log.exception("reload failed")
