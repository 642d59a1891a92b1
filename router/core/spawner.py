"""Starting a model's children: their argv, where they compute, spawn until healthy.

* ``child_argv``: ``llama-server --host 127.0.0.1 --port P --alias ID --metrics`` plus the
  router's choices (CPU placement, HTTP threads, prompt cache) and the preset's arguments.
* ``cpu_shares``: where new children compute (``cpus``): a model's replicas split the
  machine's cores; a child that runs every layer on a GPU gets one thread on the least used
  core; nothing when CPU sharing is off or the preset places its children itself.
  ``at_spawn`` marks a share ``shared`` (its threads wait briefly) when, at the spawn,
  another model's child holds one of its cores or other processes keep the machine busy.
* ``spawn_ready``: one child, spawned (a port taken meanwhile is retried with another) and
  waited for until healthy, with the environment ``launch_env`` makes (the preset's
  ``env`` over the router's). While it loads, its own progress reports (child mode, see
  ``process``) are reported as the lifecycle's ``LoadProgress`` (published as
  llama.cpp's router does: ``status_change`` with ``progress``), the least advanced of the
  model's children being started.
* A model with ``upstream`` (``remote``) gets a ``RemoteUpstream`` instead of a child: no
  process, no port of its own, no CPU placement.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

from .. import clock
from ..children.backend import Backend
from ..children.childenv import child_environment
from ..children.process import (
    ChildExited,
    ChildProcess,
    free_port,
    load_progress,
    progress_rank,
)
from ..children.remote import RemoteUpstream
from ..config.presets import ModelPreset
from ..config.settings import DEFAULT_UPSTREAM_TIMEOUT_S
from ..errors import LoadFailed
from ..events import EventBus
from ..host.cpus import (
    CpuShare,
    OtherWork,
    all_layers_offloaded,
    places_itself,
    plan_shares,
    shares_with,
    spin_environment,
)
from ..host.gpus import GpuDevice, devices_used, visible_devices
from ..llama.flags import FlagTable
from .accounting import TRANSIENT_ERRNOS
from .lifecycle import ChildGone, ChildStarted, Event, LoadProgress, Status
from .runtime import ModelRuntime, http_threads, own_pids

log = logging.getLogger("router.spawner")

PORT_RETRIES = 3
START_RETRY_S = 0.25
INFO_TIMEOUT_S = 5.0

# Where a spawn reports what happens to the model's children (``Executor.apply``).
Report = Callable[[ModelRuntime, Event], object]


class SpawnReports:
    """Where the spawns of one load (or one replacement) report, and the last load progress
    each of its children reported (``load_progress``): it lives as long as that load."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self.progress: dict[Backend, dict[str, Any]] = {}


class Spawner:
    def __init__(self, binary: Path, table: FlagTable, client: httpx.AsyncClient,
                 events: EventBus, *, router_port: int, cores: list[int],
                 gpus: list[GpuDevice], models: Callable[[], Iterable[ModelRuntime]],
                 upstream_timeout: float = DEFAULT_UPSTREAM_TIMEOUT_S,
                 slot_dir: Callable[[ModelPreset], Path | None] | None = None,
                 other_work: OtherWork | None = None, private: bool = False) -> None:
        self.binary = binary
        self.upstream_timeout = upstream_timeout  # each pool's response-head deadline
        self.table = table
        self.cores = cores  # shared among CPU children; empty when CPU sharing is off
        self.gpus = gpus
        self._client = client
        self._events = events
        self._router_port = router_port
        self._models = models
        self._argv_cache: dict[str, tuple[ModelPreset, int | None, list[str]]] = {}
        # The ``--slot-save-path`` of a preset's children, when it has warm swaps (``warm``).
        self.slot_dir = slot_dir
        # With API keys, a child whose conversations are kept (a slot directory) and not shared
        # among keys gets no RAM prompt cache (``--cache-ram 0``, unless its preset sets one):
        # llama-server would serve one key's cached prefix to another (``conversations``).
        self.private = private
        self._other_work = other_work  # the machine's other work (sampled by the accounting)

    # ----------------------------------------------------------------- argv

    def display_argv(self, preset: ModelPreset, cache_ram: int | None) -> list[str]:
        """The argv a model would start with (port 0), cached per preset for ``/models``
        (a cache only: an entry counts for the very preset it was made from)."""
        if preset.upstream is not None:
            return ["upstream", preset.upstream]
        cached = self._argv_cache.get(preset.id)
        if cached is None or cached[0] is not preset or cached[1] != cache_ram:
            cached = (preset, cache_ram, self.child_argv(preset, 0, cache_ram))
            self._argv_cache[preset.id] = cached
        return cached[2]

    def forget(self, model_id: str) -> None:
        """A removed model's cached command line goes with it (``Executor.forget``)."""
        self._argv_cache.pop(model_id, None)

    def launch_of(self, preset: ModelPreset) -> tuple[object, ...]:
        """How a child of ``preset`` starts, as far as its preset decides it (its port, its
        cores and the router's memory estimate aside): its command line, or for a remote
        upstream its address, key and connections. A reconfiguration that leaves it as it is
        keeps the running children (``reconfig.needs_restart``, held to this by a test)."""
        if preset.upstream is not None:
            return ("upstream", preset.upstream, preset.upstream_key,
                    preset.upstream_connections, preset.replicas)
        return (*self.launch_argv(preset, 0, None, None), preset.replicas,
                tuple(sorted(preset.env.items())))

    def launch_env(self, preset: ModelPreset, cpu: CpuShare | None) -> dict[str, str]:
        """A child's whole environment: the router's as children get it (``childenv``), the
        router's CPU placement (its spin, with CPU sharing on), then the preset's ``env``
        entries over both (``envvars`` refuses every name the router sets itself)."""
        placed = (cpu.environment() if cpu is not None else spin_environment()) \
            if self.cores else {}
        return {**child_environment(), **placed, **preset.env}

    def launch_argv(self, preset: ModelPreset, port: int, cache_ram_mib: int | None,
                    cpu: CpuShare | None) -> list[str]:
        """A child's whole command line: ``child_argv`` with the router's own choices for the
        preset: its slot directory (warm swaps), and no RAM prompt cache where its
        conversations are private (``private``)."""
        slot_dir = self.slot_dir(preset) if self.slot_dir else None
        private = slot_dir is not None and preset.private_to(self.private)
        argv = self.child_argv(preset, port, 0 if private else cache_ram_mib, cpu)
        if slot_dir is not None:
            argv += ["--slot-save-path", str(slot_dir)]
        return argv

    def child_argv(self, preset: ModelPreset, port: int,
                   cache_ram_mib: int | None = None, cpu: CpuShare | None = None) -> list[str]:
        """``cache_ram_mib``: the router's ``--cache-ram`` (see ``memory``), once estimated;
        ``cpu``: the cores the child computes on (``cpus``), when the router places it."""
        argv = [str(self.binary), "--host", "127.0.0.1", "--port", str(port),
                "--alias", preset.id, "--metrics"]
        if cpu is not None and cpu.cores:
            argv += cpu.argv()
        if "threads-http" not in preset.args:  # the proxy pool is sized by it
            argv += ["--threads-http", str(http_threads(preset.args))]
        if cache_ram_mib is not None and "cache-ram" not in preset.args:
            argv += ["--cache-ram", str(cache_ram_mib)]
        for key, value in preset.args.items():
            if key == "hf-repo" and "model" in preset.args:
                continue
            option = self.table.by_canonical(key)
            if option is None:  # unreachable: presets are validated against the same table
                raise LoadFailed(f"model '{preset.id}': unknown llama-server option {key!r}")
            argv += option.render(value)
        return argv

    # ----------------------------------------------------------------- CPU placement

    def _computes_on_cpu(self, runtime: ModelRuntime) -> bool:
        """A model the router places on cores: it does not place itself and does not run
        every layer on a GPU (judged from its arguments until its header has been read)."""
        args = runtime.preset.args
        if places_itself(args):
            return False
        on_gpu = bool(runtime.estimate_devices) if runtime.n_layer is not None \
            else bool(devices_used(args, visible_devices(self.gpus, runtime.preset.env)))
        return not (on_gpu and all_layers_offloaded(args, runtime.n_layer))

    def cpu_shares(self, runtime: ModelRuntime, count: int) -> list[CpuShare | None]:
        """Where ``count`` new children of a model compute (see the module docstring)."""
        if not self.cores or places_itself(runtime.preset.args) or runtime.preset.upstream:
            return [None] * count
        if not self._computes_on_cpu(runtime):
            held = [c.cpu for m in self._models() for c in m.children() if c.cpu]
            return list(plan_shares(self.cores, held, count, fair_share=1, narrow=True))
        own = [c.cpu for c in runtime.children() if c.cpu is not None]
        return list(plan_shares(self.cores, own, count,
                                fair_share=len(self.cores) // max(runtime.preset.replicas, 1)))

    def at_spawn(self, runtime: ModelRuntime, share: CpuShare | None) -> CpuShare | None:
        """``share`` as it stands the moment its child spawns: ``shared`` when a child of
        another model that computes now or soon (serving or starting, not stopping) holds one
        of its cores, or when other processes kept the machine busy over the last sample
        (``OtherWork``). Called in the same loop step as the child's ``ChildStarted``, so two
        models loading at once see each other."""
        if share is None:
            return None
        if self._other_work is not None:
            self._other_work.read(own_pids(self._models()))
            if self._other_work.busy:
                return CpuShare(share.cores, shared=True)
        others = [c.cpu for m in self._models() if m is not runtime
                  for c in (*(r.child for r in m.state.replicas), *m.state.starting)
                  if c.cpu is not None]
        return shares_with(share, others)

    # ----------------------------------------------------------------- spawning

    async def spawn_ready(self, runtime: ModelRuntime, children: list[Backend],
                          timeout: float, started: float, cpu: CpuShare | None,
                          reports: SpawnReports) -> None:
        """Spawn one child into ``children`` (retrying a taken port) and wait until it is
        healthy; raises ``ChildError`` (the caller stops what ``children`` holds and reports
        each as gone). ``reports`` (the record's owner) is told each child that gets a process
        (``ChildStarted``), each one dropped before the caller took it over (``ChildGone``)
        and the model's overall load progress (``LoadProgress``)."""
        for attempt in range(PORT_RETRIES):
            child = await self._start(runtime, children, cpu,
                                      timeout - (clock.now() - started), reports)
            try:
                await child.wait_ready(timeout - (clock.now() - started), timeout)
                return
            except ChildExited as exc:
                if not exc.port_in_use or attempt == PORT_RETRIES - 1:
                    raise
                children.remove(child)
                reports.report(runtime, ChildGone(child))
                log.warning("port %d was taken; retrying", child.port,
                            extra={"model": runtime.id})

    async def _start(self, runtime: ModelRuntime, children: list[Backend],
                     cpu: CpuShare | None, within: float, reports: SpawnReports) -> Backend:
        """Start a child on a free port into ``children``. A failure for a reason of the
        moment (out of file descriptors or memory: a flood of clients) is retried every
        ``START_RETRY_S`` while the load's time lasts, not reported as the model's failure."""
        deadline = clock.now() + within
        while True:
            if runtime.preset.upstream is not None:  # served elsewhere: nothing to spawn
                remote = RemoteUpstream(runtime.id, runtime.preset.upstream, runtime.logs,
                                        self._client, api_key=runtime.preset.upstream_key,
                                        max_connections=runtime.max_connections,
                                        head_timeout_s=self.upstream_timeout)
                children.append(remote)
                reports.report(runtime, ChildStarted(remote))
                await remote.start()
                return remote
            try:
                port = free_port()
                cpu = self.at_spawn(runtime, cpu)  # no await from here to ChildStarted
                argv = self.launch_argv(runtime.preset, port, runtime.cache_ram_mib, cpu)
                env = self.launch_env(runtime.preset, cpu)
                on_state = functools.partial(self._child_state, runtime, reports)
                child = ChildProcess(runtime.id, argv, port, runtime.logs, self._client,
                                     env=env, max_connections=runtime.max_connections,
                                     head_timeout_s=self.upstream_timeout,
                                     cpu=cpu, router_port=self._router_port,
                                     on_state=on_state)
                children.append(child)  # from now on the caller stops it if anything fails
                reports.report(runtime, ChildStarted(child))
                await child.start()
            except OSError as exc:
                if exc.errno not in TRANSIENT_ERRNOS or clock.now() >= deadline:
                    raise
                if children and children[-1].pid is None:
                    reports.report(runtime, ChildGone(children.pop()))  # never started
                log.warning("cannot start llama-server now (%s); retrying", exc.strerror,
                            extra={"model": runtime.id})
                await asyncio.sleep(START_RETRY_S)
                continue
            return child

    def _child_state(self, runtime: ModelRuntime, reports: SpawnReports, child: Backend,
                     state: str, payload: dict[str, Any]) -> None:
        """A state line from a child: load progress is published while the model loads."""
        if state != "loading" or runtime.status is not Status.LOADING:
            return
        known = reports.progress
        progress = load_progress(known.get(child), payload)
        if progress is None:
            return
        for started in [c for c in known if c not in runtime.starting]:  # loaded or gone
            del known[started]
        known[child] = progress
        heard = [known[c] for c in runtime.starting if c in known]
        overall = min(heard, key=progress_rank, default=progress)
        if len(heard) < len(runtime.starting) > 1:
            overall = {**overall, "value": 0.0}  # a replica has not reported yet
        reports.report(runtime, LoadProgress(overall))

    async def model_info(self, child: Backend) -> dict[str, Any] | None:
        """The child's own ``/v1/models`` entry: from its ``ready`` report, else asked."""
        if child.ready_info:
            return child.ready_info
        try:
            response = await self._client.get(child.base_url + "/v1/models",
                                              timeout=INFO_TIMEOUT_S,
                                              headers={"connection": "close"})
            data = response.json().get("data") or []
            return dict(data[0]) if data else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None

