"""Assemble and run the router: validate config, then serve with uvicorn.

Everything that can be wrong with the configuration (no binary, a bad preset, a bad
pass-through arg) is found by ``prepare()`` before a socket is opened or a child started.
The lifespan owns the HTTP client and the supervisor; on shutdown every child is stopped.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import logging
import math
import signal
import socket
import sqlite3
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx
import uvicorn
from starlette.applications import Starlette

from . import otel
from .children import childenv, spawn
from .config.listen import bind
from .config.origins import CorsPolicy
from .config.settings import ConfigurationError, Settings
from .config.sources import Catalogue, build_catalogue
from .core.supervisor import Supervisor
from .core.wiring import wire
from .edge import defaults
from .edge.app import State, create_app
from .edge.keys import Keys
from .edge.reload import Reloader
from .events import EventBus
from .host import gpus
from .host.fdlimit import connection_cap, raise_soft_limit
from .host.gpus import GpuDevice
from .host.memory import format_size
from .host.systemd import Notifier
from .http.http11 import KEEP_ALIVE_IDLE_S, EnvelopeHttpToolsProtocol, Refusals
from .llama.flags import FlagTable, Option, load_build, load_flag_table
from .llama.install import (
    WEBUI_MISSING,
    InstallError,
    cache_root,
    find_llama_server,
    find_webui,
)
from .llama.webui import MissingWebUI, StaticUI, WebUI
from .logs import FORMAT, KeyValueFormatter, LogRing, RingHandler
from .observe.metrics import RouterMetrics
from .peers.registry import PeerError, Peers, default_node_name, dns_target, peer_url, read_peer_key
from .teams.usage import FILE_NAME as USAGE_FILE
from .teams.usage import Usage, UsageStore
from .warm.statestore import StateStore, claim_root

log = logging.getLogger("router.server")

CHILD_CONNECT_TIMEOUT_S = 10.0
# After the grace period: how long the requests still held get to send their last bytes (the
# 503, a stream's error event) before uvicorn cancels whatever is left (``RouterServer``).
GRACE_DRAIN_S = 2.0
# How often the idle server wakes: to refresh the Date header (uvicorn's ``on_tick``, which
# wants a second's resolution) and to notice a ``should_exit`` set other than by a signal.
TICK_S = 1.0


@dataclass
class Prepared:
    settings: Settings
    binary: Path
    table: FlagTable
    overrides: list[tuple[Option, str]]
    catalogue: Catalogue
    api_keys: list[str]
    build_info: str
    gpus: list[GpuDevice] = field(default_factory=list)
    gpu_budgets: dict[str, int] = field(default_factory=dict)
    webui: Path | None = None  # the web UI folder to serve; None: none (see settings.webui)
    peer_key: str | None = None  # sent to peers (--peer-api-key-file); never logged
    states: StateStore | None = None  # warm swaps' saved slot states (--state-dir); None: off
    usage: Usage = field(default_factory=Usage)  # the teams' usage, in --state-dir if given


def _check_peers(settings: Settings) -> str | None:
    """Every --peer and --peer-dns well-formed; the peer key, if any."""
    try:
        for url in settings.peer:
            peer_url(url)
        for spec in settings.peer_dns:
            dns_target(spec)
        return read_peer_key(settings.peer_api_key_file)
    except PeerError as exc:
        raise ConfigurationError(str(exc)) from None


def prepare(settings: Settings) -> Prepared:
    """Resolve the binary, learn its flags, load and validate every model source."""
    api_keys = settings.all_api_keys()  # first: a bad key setting stops everything
    try:  # OpenTelemetry when the environment asks (without the otel extra: said now)
        otel.setup()
    except otel.Unavailable as exc:
        raise ConfigurationError(str(exc)) from None
    peer_key = _check_peers(settings)
    binary = find_llama_server(settings.llama_server)
    table = load_flag_table(binary, cache_root() / "flags")
    try:
        overrides = table.parse_argv(settings.child_args)
    except ValueError as exc:
        raise ConfigurationError(f"pass-through args after --: {exc}") from None
    catalogue = build_catalogue(settings.presets, settings.models_dir, table, overrides)
    for warning in catalogue.warnings:
        log.warning("%s", warning)
    ignored = childenv.ignored()
    if ignored:
        log.warning("not passed to llama-server children: %s (options come from presets: the "
                    "same LLAMA_ARG_* names are preset keys, in [*] for every model)",
                    ", ".join(ignored))
    if (problem := defaults.check(settings.default_model, catalogue)) is not None:
        raise ConfigurationError(problem)
    if settings.unknown_model_to_default and settings.default_model is None:
        log.warning("--unknown-model-to-default without --default-model: unknown names go to "
                    "the router's only model, and get a 404 once it has several")
    if spawn.death_wrapper() is None:  # probed now, not at the first load
        log.info("children start with a preexec_fn (no setpriv --pdeathsig or pidfd here): "
                 "each spawn forks the router")
    devices = gpus.detect()
    try:
        gpu_budgets = gpus.budgets(settings.gpu_memory_budget, devices)
    except ValueError as exc:
        raise ConfigurationError(f"--gpu-memory-budget: {exc}") from None
    for device in devices:
        budget = gpu_budgets.get(device.pool)
        log.info("GPU %d: %s, %s, budget %s", device.index, device.name,
                 format_size(device.total_bytes),
                 format_size(budget) if budget is not None else "off")
    return Prepared(settings, binary, table, overrides, catalogue, api_keys,
                    load_build(binary, cache_root() / "flags"), devices, gpu_budgets,
                    _webui_folder(settings), peer_key, _state_store(settings),
                    _usage(settings.state_dir))


def _state_store(settings: Settings) -> StateStore | None:
    """The saved slot states of ``--state-dir`` (scanned: leftovers removed), or None."""
    if settings.state_dir is None:
        return None
    try:
        claim_root(settings.state_dir)  # held until the router exits: one router per directory
        store = StateStore(settings.state_dir, settings.state_budget_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"--state-dir {settings.state_dir}: {exc}") from None
    usage = store.usage()
    log.info("warm swaps: slot states in %s (%d kept, %s of %s)", store.root,
             sum(n for n, _ in usage.values()),
             format_size(sum(b for _, b in usage.values())), format_size(store.budget_bytes))
    return store


def _webui_folder(settings: Settings) -> Path | None:
    """The web UI to serve; a --webui-path without index.html is an InstallError."""
    if not settings.webui:
        return None
    folder = find_webui(settings.webui_path)
    if folder is None:
        log.warning("%s", WEBUI_MISSING)
    else:
        log.info("web UI: %s", folder)
    return folder


def _webui(prepared: Prepared) -> StaticUI | None:
    if not prepared.settings.webui:
        return None
    if prepared.webui is None:
        return MissingWebUI(WEBUI_MISSING)
    try:
        return WebUI(prepared.webui)
    except ValueError as exc:  # index.html gone since prepare() looked
        raise InstallError(f"web UI: {exc}") from None


def build_app(prepared: Prepared, notifier: Notifier | None = None,
              refusals: Refusals | None = None) -> Starlette:
    """The app; ``refusals``: what the HTTP/1.1 edge refused, for ``/metrics``."""
    metrics = RouterMetrics()  # the edge counts into it from the first request
    keys = Keys(prepared.api_keys)  # in force: the key check reads them, a reload swaps them

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256,
                              keepalive_expiry=30.0)
        timeout = httpx.Timeout(None, connect=CHILD_CONNECT_TIMEOUT_S)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False,
                                     verify=False) as client:  # children: plain HTTP
            events = EventBus()
            supervisor = Supervisor(wire(prepared.settings, prepared.catalogue, prepared.table,
                                         prepared.binary, client, events, gpus=prepared.gpus,
                                         gpu_budgets=prepared.gpu_budgets,
                                         states=prepared.states, build=prepared.build_info))
            supervisor.start()
            metrics.attach(supervisor)
            metrics.attach_edge(refusals or Refusals())
            router_log = LogRing(prepared.settings.log_lines)
            ring_handler = RingHandler(router_log, asyncio.get_running_loop())
            ring_handler.setFormatter(KeyValueFormatter(FORMAT))
            ring_handler.addFilter(lambda record: record.name != "router.child.output")
            logging.getLogger().addHandler(ring_handler)
            reloader = _reloader(prepared, supervisor, events, notifier, keys)
            settings = prepared.settings
            peers = Peers(client=client, events=events,
                          own_node=settings.node_name or default_node_name(),
                          static=settings.peer, dns=settings.peer_dns,
                          dns_interval=settings.peer_dns_interval, api_key=prepared.peer_key,
                          prefix=settings.peer_prefix,
                          interval=settings.liveness_interval or 2.0,
                          timeout=settings.liveness_timeout, misses=settings.liveness_misses,
                          head_timeout=settings.upstream_timeout)
            peers.start()
            usage = prepared.usage
            metrics.attach_teams(usage)
            app.state.router = state = State(supervisor, client, events, prepared.build_info,
                                             metrics, router_log, reloader, peers, usage)
            usage_writer = asyncio.create_task(state.meter.run(), name="usage-writer")
            app.state.supervisor = supervisor  # the server's own: startup models, a kill
            watcher = asyncio.create_task(reloader.watch(), name="config-watch")
            atexit.register(supervisor.kill_all_now)
            startup = asyncio.create_task(supervisor.load_startup_models())
            startup.add_done_callback(_log_startup_failure)
            try:
                yield
            finally:
                watcher.cancel()
                startup.cancel()
                usage_writer.cancel()
                await peers.close()
                await supervisor.close()
                atexit.unregister(supervisor.kill_all_now)
                logging.getLogger().removeHandler(ring_handler)

    return create_app(lifespan, keys, metrics, webui=_webui(prepared),
                      cors=CorsPolicy.parse(prepared.settings.cors_origins))


def _reloader(prepared: Prepared, supervisor: Supervisor, events: EventBus,
              notifier: Notifier | None, keys: Keys) -> Reloader:
    """What re-reads the presets, the models directories and the key file (``reload``): a
    new catalogue goes to the supervisor, new keys into ``keys``."""
    return Reloader(prepared.settings, prepared.table, prepared.overrides, supervisor, events,
                    (notifier or Notifier({})).notify, keys=keys)


def _usage(state_dir: Path | None) -> Usage:
    """The teams' usage ledger: kept in the state directory's SQLite file when there is one
    (read back from it now), else in memory only."""
    if state_dir is None:
        return Usage()
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        return Usage(UsageStore(state_dir / USAGE_FILE))
    except (OSError, sqlite3.Error) as exc:
        raise ConfigurationError(f"--state-dir {state_dir}: cannot keep the usage in "
                                 f"{USAGE_FILE}: {exc}") from None


def _log_startup_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("a load-on-startup model failed: %s", task.exception())


class RouterServer(uvicorn.Server):
    """uvicorn's server plus the router's process duties.

    * systemd: ``READY=1`` once listening and the load-on-startup models are loaded,
      ``WATCHDOG=1`` every half ``WATCHDOG_USEC`` while the event loop runs, ``STOPPING=1`` on
      the first SIGTERM/SIGINT.
    * Shutdown: the first signal stops accepting, ends endless streams (events, log follow)
      and lets in-flight requests finish within the grace period; children are then stopped.
      A second signal kills the children and exits at once.
    * The end of the grace period is the router's own (``State.shutdown.end()``): every
      request still held ends with the envelope (a 503 if its response has not started, an
      error event ending an event stream; any other body started is aborted). uvicorn's own
      ``timeout_graceful_shutdown`` is only a backstop, ``GRACE_DRAIN_S`` later, for what
      cannot end by itself (a client that reads nothing); a request it cancels before its
      response started still gets the 503 (``middleware.RequestMetricsMiddleware``).
    """

    def __init__(self, config: uvicorn.Config, app: Starlette, notifier: Notifier) -> None:
        super().__init__(config)
        self.router_app = app
        self.notifier = notifier
        self._background: set[asyncio.Task[None]] = set()
        self._exit_requested = asyncio.Event()  # set by ``handle_exit``: ``main_loop`` ends

    def _state(self) -> State | None:
        state: State | None = getattr(self.router_app.state, "router", None)
        return state

    def _supervisor(self) -> Supervisor | None:
        supervisor: Supervisor | None = getattr(self.router_app.state, "supervisor", None)
        return supervisor

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.should_exit:
            return
        # The start is over (``cli.main`` ran it without collections): what it built lives
        # as long as the process, so it moves out of the collector's way for good.
        gc.freeze()
        gc.enable()
        for work in (self._ready(), self._watchdog()):
            task = asyncio.create_task(work)
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def main_loop(self) -> None:
        """uvicorn's, but waking once a second, or at once when a signal asks to exit, rather
        than polling ``should_exit`` ten times a second: an idle router spends nothing."""
        counter = 0
        while not await self.on_tick(counter):
            counter += 10  # ``on_tick`` refreshes the Date header when ``counter % 10 == 0``
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await self._exit_requested.wait()

    async def _ready(self) -> None:
        supervisor = self._supervisor()
        failed: list[str] = []
        if supervisor is not None:
            failed = await supervisor.wait_startup_models()
        status = f"STATUS=serving; startup models failed: {', '.join(failed)}" if failed \
            else "STATUS=serving"
        self.notifier.notify("READY=1", status)
        log.info("ready", extra={"event": "ready"})

    async def _watchdog(self) -> None:
        interval = self.notifier.watchdog_s
        if interval is None:
            return
        while True:
            self.notifier.notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for task in self._background:
            task.cancel()
        state = self._state()
        if state is None:
            await super().shutdown(sockets)
            return
        grace_over = asyncio.get_running_loop().call_later(
            state.shutdown.grace_s, self._end_grace, state)
        try:
            await super().shutdown(sockets)
        finally:
            grace_over.cancel()

    def _end_grace(self, state: State) -> None:
        if self.server_state.tasks:
            log.warning("the %g s grace period is over: ending %d requests still running",
                        state.shutdown.grace_s, len(self.server_state.tasks),
                        extra={"event": "grace_over"})
        state.shutdown.end()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Like uvicorn's, but a graceful shutdown exits 0 instead of re-raising the signal,
        and SIGHUP reloads the configuration."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = {sig: self.handle_exit for sig in (signal.SIGINT, signal.SIGTERM)}
        handled[signal.SIGHUP] = self.handle_reload
        original = {sig: signal.signal(sig, handler) for sig, handler in handled.items()}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_reload(self, sig: int, frame: FrameType | None) -> None:
        state = self._state()
        if state is not None:
            asyncio.get_event_loop().call_soon_threadsafe(state.request_reload)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = self._state()
        if self.should_exit:  # second signal: no more waiting
            log.warning("second signal: killing children and exiting now")
            if (supervisor := self._supervisor()) is not None:
                supervisor.kill_all_now()
            self.force_exit = True
            return
        self.notifier.notify("STOPPING=1")
        log.info("shutting down: finishing in-flight requests", extra={"event": "stopping"})
        if state is not None:
            asyncio.get_event_loop().call_soon_threadsafe(state.closing.set)
        super().handle_exit(sig, frame)
        asyncio.get_event_loop().call_soon_threadsafe(self._exit_requested.set)


def serve(settings: Settings) -> None:
    """Prepare, bind every listen address (``listen``: a ``ListenError`` before any child
    starts), then serve until a signal ends it."""
    prepared = prepare(settings)
    open_files = raise_soft_limit()
    listeners = bind(settings.hosts(), settings.port)
    log.info("listening on %s", ", ".join(listeners.urls), extra={"event": "listening"})
    if settings.port == 0:  # children are told the port the router got
        prepared.settings = settings = settings.model_copy(update={"port": listeners.port})
    notifier = Notifier()
    refusals = Refusals()
    app = build_app(prepared, notifier, refusals)
    cap = connection_cap(open_files, settings.models_max)
    log.info("up to %d client connections at once (%d file descriptors)", cap, open_files)
    config = uvicorn.Config(app, host=settings.hosts()[0], port=settings.port,
                            log_level=settings.log_level, access_log=False,
                            # Nothing reads the client's address or scheme: no rewriting
                            # them from X-Forwarded-* (a layer on every request).
                            proxy_headers=False,
                            # HTTP/1.1 only: the protocol refuses every upgrade.
                            ws="none",
                            http=EnvelopeHttpToolsProtocol.configured(
                                cap=cap, body_timeout_s=settings.body_timeout,
                                refusals=refusals),
                            timeout_keep_alive=KEEP_ALIVE_IDLE_S,
                            timeout_graceful_shutdown=math.ceil(
                                settings.shutdown_grace + GRACE_DRAIN_S),
                            log_config=None)
    try:
        RouterServer(config, app, notifier).run(sockets=listeners.sockets)
    finally:
        listeners.close()
        otel.shutdown()  # the last spans and metrics out (bounded)
