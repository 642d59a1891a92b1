"""A model's way from unloaded to loaded: fetch its files, wait its turn, spawn its children.

``Loader.load`` is the body of a model's one load task (``Supervisor``): download an hf-repo
model not in the cache yet, wait for an old child of the model to be gone, sit out the crash
backoff, queue for admission (``admission``), then spawn every replica until healthy
(``spawner``). Each step reports to the lifecycle through ``Executor.apply``. A cancelled
load (an unload, a reconfiguration, nobody waiting any more) stops what it started.
A remote upstream (``remote``) downloads nothing and skips admission: it holds no local
memory, cores or ``--models-max`` slot.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace
from types import MappingProxyType

from .. import clock, otel
from ..changes import Changes
from ..children.backend import Backend
from ..config.downloads import DownloadCancelled, HfRef, download, resolve_remote
from ..config.settings import Settings
from ..errors import LoadFailed
from ..serving.load import book_of, new_replica
from ..warm.swaps import SlotHolder, WarmSwaps
from .accounting import Accounting
from .admission import Admission
from .executor import Executor, failure_from, to_the_end
from .lifecycle import (
    UNLOADED,
    Admitted,
    Download,
    Downloaded,
    DownloadFailed,
    DownloadProgress,
    Failure,
    Ready,
    SpawnFailed,
    Status,
)
from .runtime import LoadTimed, ModelRuntime, Unestimated
from .spawner import Spawner, SpawnReports

log = logging.getLogger("router.supervisor")

DOWNLOAD_EVENT_INTERVAL_S = 0.25


class Loader:
    def __init__(self, settings: Settings, executor: Executor, spawner: Spawner,
                 admission: Admission, accounting: Accounting, changes: Changes, *,
                 warm: WarmSwaps | None = None) -> None:
        self.settings = settings
        self._warm = warm  # restores the saved slots before the model serves (``warm``)
        self._executor = executor
        self._spawner = spawner
        self.admission = admission  # the queue each load waits its turn in
        self._accounting = accounting
        self._changes = changes
        self._spans: dict[str, object | None] = {}  # model: its load's span (``span_of``)

    async def load(self, runtime: ModelRuntime) -> None:
        """Load the model; raises LoadFailed (the reason is also the state's ``failure``).
        Cancelled by an unload (``CancelLoad(UNLOADED)``), it ends with LoadFailed saying so,
        which is what the requests waiting for it answer; cancelled for any other reason (a
        reconfiguration, the shutdown, nobody waiting) it ends cancelled.

        With OpenTelemetry on, the whole load is a span (``load {model}``: its files, its
        turn in admission, the spawn), a child of the span current where its task was made:
        the wait of the request that started it (``wait``), none for a load nobody waits
        for. A load is shared: every request that waits for it links its span
        (``span_of``)."""
        with otel.span(f"load {runtime.id}", attributes={"llama_router.model": runtime.id}):
            self._spans[runtime.id] = otel.current()
            try:
                await self._load(runtime)
            except asyncio.CancelledError as exc:
                if exc.args and exc.args[0] == UNLOADED:
                    raise LoadFailed(f"model '{runtime.id}' was unloaded while this request "
                                     "waited for it") from None
                raise
            finally:
                self._spans.pop(runtime.id, None)

    def span_of(self, model_id: str) -> object | None:
        """The span context of the model's load under way (None: none, or OpenTelemetry
        off), for its waits to link."""
        return self._spans.get(model_id)

    async def _load(self, runtime: ModelRuntime) -> None:
        remote = runtime.preset.upstream is not None  # served elsewhere (``remote``)
        if runtime.preset.model_path is None and not remote:  # an hf-repo model to download
            await asyncio.shield(self._executor.start_download(runtime))
        while runtime.status is not Status.UNLOADED:  # an old child is draining or stopping
            if runtime.serving:
                return  # its drain was lifted: the old child serves the waiters
            await self._changes.wait()
        delay = self._executor.backoff_left(runtime)
        if delay > 0:
            log.info("waiting %.1f s before restarting after %d failures", delay,
                     runtime.state.failures_in_row, extra={"model": runtime.id})
            await asyncio.sleep(delay)
        if not remote:  # a remote upstream holds no local memory, cores or model slot
            await self.admission.admit(runtime)
        self._executor.apply(runtime, Admitted())
        children: list[Backend] = []  # this load's, until they serve (``starting``)
        try:
            await self._spawn(runtime, children)
        except BaseException as exc:
            cancelled_again = False
            try:  # a second cancel (an unload, then the shutdown) waits for this too
                await to_the_end(self._executor.stop_started(runtime, children))
            except asyncio.CancelledError:
                cancelled_again = True
            if cancelled_again or isinstance(exc, asyncio.CancelledError):
                self._executor.apply(runtime, SpawnFailed(cancelled=True))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise asyncio.CancelledError from exc
            failure = failure_from(exc)
            log.error("load failed: %s", failure.message,
                      extra={"event": "load_failed", "model": runtime.id})
            self._executor.apply(runtime, SpawnFailed(failure.exit_code, failure=failure))
            raise LoadFailed(load_failed_message(runtime.id, failure)) from exc
        for replica in runtime.replicas:
            self._executor.watch_exit(runtime, replica)

    async def _spawn(self, runtime: ModelRuntime, children: list[Backend]) -> None:
        """Start every replica into ``children`` until healthy, fetch the model's info, and
        switch to loaded."""
        started = clock.now()
        preset = runtime.preset
        timeout = preset.load_timeout or self.settings.load_timeout
        if self._warm is not None:  # the weights' content, once per file version (bounded)
            await self._warm.prepare(preset)
        # The saved states are verified while the children start; this load owns the check.
        restorable = asyncio.ensure_future(self._warm.restorable(preset)) \
            if self._warm is not None else None
        reports = SpawnReports(self._executor.apply)  # this load's
        try:
            with otel.span("spawn", attributes={"llama_router.model": runtime.id,
                                                "llama_router.replicas": preset.replicas}):
                results = await asyncio.gather(  # spawn → healthy
                    *(self._spawner.spawn_ready(runtime, children, timeout, started, share,
                                                reports)
                      for share in self._spawner.cpu_shares(runtime, preset.replicas)),
                    return_exceptions=True)
                errors = [r for r in results if isinstance(r, BaseException)]
                if errors:
                    raise errors[0]
            own_info = await self._spawner.model_info(children[0])
            restored = None
            if self._warm is not None and restorable is not None:  # bounded; a refused
                with otel.span("warm restore", attributes={"llama_router.model": runtime.id}
                               ) as span:  # one is dropped
                    restored = await self._warm.restore(
                        preset, [SlotHolder(child) for child in children], restorable)
                    if span is not None:
                        span.set_attribute("llama_router.warm.states", restored.count)
            replicas = tuple(
                new_replica(child, restored.learned[i] if restored else (),
                            book_of(runtime.preset, self._warm,
                                    restored.held[i] if restored else ()))
                for i, child in enumerate(children))
        finally:
            if restorable is not None:  # not needed after all (a failed start): stopped
                restorable.cancel()
        loaded_at = clock.now()
        duration = round(loaded_at - started, 4)
        self._executor.apply(runtime, LoadTimed(duration))
        info = {**own_info, "id": runtime.id} if own_info else None
        children.clear()  # they serve now: the model's stop owns them
        self._executor.apply(runtime, Ready(
            replicas, loaded_at, MappingProxyType(own_info) if own_info else None,
            {"duration": duration, **({"info": info} if info else {})}))
        log.info("loaded", extra={"event": "loaded", "model": runtime.id,
                                  "pid": replicas[0].child.pid,
                                  "port": replicas[0].child.port,
                                  "duration": duration})

    # ----------------------------------------------------------------- downloading

    async def fetch_files(self, runtime: ModelRuntime, cancel: threading.Event) -> None:
        """Download an hf-repo model into the HF cache: the body of the model's download task
        (``Executor.start_download``, which owns it and its ``cancel`` flag, read by the worker
        thread)."""
        preset = runtime.preset
        assert preset.hf_repo is not None
        loop = asyncio.get_running_loop()
        last_event = 0.0
        files: dict[str, dict[str, int | None]] = {}  # file: done/total

        def on_progress(name: str, done: int, total: int | None) -> None:  # event loop
            nonlocal last_event
            files[name] = {"done": done, "total": total}
            now = clock.now()
            if now - last_event >= DOWNLOAD_EVENT_INTERVAL_S or done == total:
                last_event = now
                # A fresh copy per event (JSON-ready for the events it is published in):
                # nobody changes it afterwards.
                self._executor.apply(runtime, DownloadProgress(
                    {name: dict(counts) for name, counts in files.items()}))

        def progress(name: str, done: int, total: int | None) -> None:  # worker thread
            loop.call_soon_threadsafe(on_progress, name, done, total)

        self._executor.apply(runtime, Download())
        log.info("downloading %s", preset.hf_repo, extra={"event": "download",
                                                          "model": runtime.id})
        try:
            ref = HfRef.parse(preset.hf_repo)
            resolution = await asyncio.to_thread(resolve_remote, ref, preset.args.get("hf-file"))
            paths = await asyncio.to_thread(download, resolution, progress,
                                            cancel.is_set)
        except (asyncio.CancelledError, DownloadCancelled) as exc:
            cancel.set()  # the worker thread stops at its next chunk
            self._executor.apply(runtime, DownloadFailed(cancelled=True))
            if isinstance(exc, DownloadCancelled):
                raise LoadFailed(f"model '{runtime.id}': download cancelled") from exc
            raise
        except Exception as exc:
            message = f"download of {preset.hf_repo} failed: {exc}"
            log.error("%s", message, extra={"event": "download_failed", "model": runtime.id})
            failure = Failure(message, None, (), clock.now())
            self._executor.apply(runtime, DownloadFailed(error=str(exc), failure=failure))
            raise LoadFailed(f"model '{runtime.id}': {message}") from exc
        if runtime.preset is preset:  # else reconfigured meanwhile: the new preset stands
            args = {**preset.args, "model": str(paths[0])}
            if resolution.mmproj is not None:
                args["mmproj"] = str(paths[-1])
            self._executor.set_preset(runtime, replace(preset, args=MappingProxyType(args)))
        self._executor.apply(runtime, Unestimated())
        log.info("downloaded %s", resolution.id, extra={"event": "downloaded",
                                                       "model": runtime.id})
        self._executor.apply(runtime, Downloaded())


def load_failed_message(model_id: str, failure: Failure) -> str:
    last = next((line for line in reversed(failure.last_lines) if line.strip()), "")
    detail = f"; last log line: {last}" if last else ""
    return f"model '{model_id}' failed to load: {failure.message}{detail}"
