"""A model as the rest of the router reads it: its published snapshot, with what the core's
parts measure of it now.

Routes (``/models``, ``/props``, streams), metrics, keys and nodes read a model through a
``ModelView`` from ``Supervisor.view``/``views``/``find``: its status, counters, replicas,
memory, queue place and failure, and its ``/models`` entry. The view reads the snapshot its
record's owner last published (``runtime.ModelSnapshot``), never the record, plus what other
parts know of it now (its measured memory, its place in the admission queue, a paused child,
its saved states). A view has no setters and hands out nothing to change.

A view is cheap (two references); hold one only for the request at hand. It is also the
request's handle on its model (``route.decide``): the core leases by the snapshot's id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .. import clock
from ..config.sources import safe_id
from .lifecycle import Status

if TYPE_CHECKING:
    import asyncio

    from ..children.backend import Backend
    from ..config.presets import ModelPreset
    from ..config.settings import Settings
    from ..config.sources import Catalogue
    from ..events import EventBus
    from ..logs import LogRing
    from ..serving.affinity import Prefix
    from ..serving.leases import Lease, RoutedCallback
    from ..teams.fairshare import Turn
    from ..warm.swaps import WarmSwaps
    from .lifecycle import Failure
    from .runtime import ModelSnapshot
    from .wait import Ends
    from .wiring import Core


@dataclass(frozen=True, slots=True)
class ReplicaView:
    pid: int | None
    port: int
    in_flight: int
    base_url: str
    missed_checks: int  # health checks missed in a row (``liveness``)
    cpu: dict[str, Any] | None  # its CPU placement, when the router placed it
    # What prefix routing measured of it (``pace.Pace.describe``, and its queued work); None
    # for a model not routed by prefix
    pace: dict[str, Any] | None = None


class ModelView:
    __slots__ = ("_model", "_sup")

    def __init__(self, snapshot: ModelSnapshot, core: Core) -> None:
        self._model = snapshot  # the model as its owner last published it
        self._sup = core  # the core's parts it reads through (``wiring.wire`` made them)

    def __repr__(self) -> str:
        return f"<ModelView {self._model!r}>"

    @property
    def snapshot(self) -> ModelSnapshot:
        return self._model

    # -- identity and configuration ----------------------------------------------------------

    @property
    def id(self) -> str:
        return self._model.id

    @property
    def preset(self) -> ModelPreset:
        return self._model.preset  # frozen

    @property
    def aliases(self) -> tuple[str, ...]:
        return self._model.preset.aliases

    @property
    def logs(self) -> LogRing:
        """Its llama-server's recent output (``/logs``), to read or follow."""
        return self._model.logs

    # -- state -------------------------------------------------------------------------------

    @property
    def status(self) -> Status:
        return self._model.status

    @property
    def serving(self) -> bool:
        """Loaded, not draining: a request gets a replica at once."""
        return self._model.serving

    @property
    def loading(self) -> bool:
        return self._model.loading

    @property
    def draining(self) -> bool:
        return self._model.draining

    @property
    def failed(self) -> bool:
        return self._model.failed

    @property
    def crash_loop(self) -> bool:
        return self._model.crash_loop

    @property
    def failure(self) -> Failure | None:
        return self._model.failure

    @property
    def in_flight(self) -> int:
        return self._model.in_flight

    @property
    def idle_ttl(self) -> float:
        """Its idle TTL in force, seconds (0: none): a request's ``keep_alive`` for this load,
        else its preset's ``ttl``, else ``--idle-timeout`` (``liveness.idle_ttl``)."""
        return self._model.idle_ttl(self._sup.settings.idle_timeout)

    @property
    def waiting(self) -> int:
        return self._model.waiting

    @property
    def processes(self) -> int:
        """Local processes it holds (serving and starting); a remote upstream holds none."""
        return self._model.processes

    def replicas(self) -> list[ReplicaView]:
        missed = self._sup.liveness.missed
        routed = self._model.preset.prefix_routing
        now = clock.now()
        return [ReplicaView(r.child.pid, r.child.port, r.in_flight, r.child.base_url,
                            missed(r.child), r.child.cpu.describe() if r.child.cpu else None,
                            {**r.pace.describe(), "backlog_s": round(r.backlog.remaining(now), 3)}
                            if routed else None)
                for r in self._model.replicas]

    @property
    def prompt_s_per_char(self) -> float | None:
        """How fast its fastest serving replica computes a prompt (measured where it is
        routed by prefix), None while unknown."""
        rates = [r.pace.prompt_s_per_char for r in self._model.replicas
                 if r.pace.prompt_s_per_char is not None]
        return min(rates, default=None)

    @property
    def keeps_states(self) -> bool:
        """Whether its conversations are kept on disk (warm swaps cover it): a load restores
        them."""
        warm = self._sup.warm
        return warm is not None and warm.covers(self._model.preset)

    def serves_through(self, child: object) -> bool:
        """Whether ``child`` is one of its serving replicas' backends now."""
        return any(r.child is child for r in self._model.replicas)

    # -- memory ------------------------------------------------------------------------------

    def measured(self) -> int | None:
        """Resident memory of its serving children (sampled), None when unknown."""
        return self._sup.accounting.measured(self._model)

    def measured_devices(self) -> dict[str, int]:
        return self._sup.accounting.measured_devices(self._model)

    # -- the /models entry -------------------------------------------------------------------

    def entry(self, created: int) -> dict[str, Any]:
        """Its ``/models`` entry, in llama.cpp's shape plus the router's status fields."""
        model = self._model
        preset = model.preset
        entry: dict[str, Any] = {
            "id": preset.id, "aliases": sorted(preset.aliases), "tags": list(preset.tags),
            "object": "model", "owned_by": "llamacpp", "created": created,
            "status": self._status(), "source": preset.source,
            "can_remove": preset.source == "cache",
        }
        if preset.upstream is not None:  # a remote upstream (its key is never shown)
            entry["upstream"] = preset.upstream
        if preset.policy:
            entry["policy"] = preset.policy.describe()
        if preset.pin:  # its residency, when its preset sets one
            entry["pin"] = True
        if preset.min_resident:  # seconds, as the preset wrote them (30, not 30.0)
            seconds = preset.min_resident
            entry["min_resident"] = _as_written(seconds)
        if model.keep_alive is not None:  # a request's, for this load: -1 for none, as sent
            kept = model.keep_alive
            entry["keep_alive"] = -1 if kept == math.inf else _as_written(kept)
        if model.info and model.status is not Status.UNLOADED:
            for key, value in model.info.items():
                entry.setdefault(key, value)
        return entry

    def _status(self) -> dict[str, Any]:
        """The entry's ``status``: its state, command line and counters, then the parts."""
        model, sup = self._model, self._sup
        child = model.child
        status: dict[str, Any] = {
            "value": model.status.public,
            # A path need not be UTF-8; the answer must be (``sources.safe_id``).
            "args": [safe_id(arg) for arg in
                     (child.argv if child else
                      sup.spawner.display_argv(model.preset, model.cache_ram_mib))],
            "in_flight": model.in_flight,
            "waiting": model.waiting,
        }
        if model.preset.env:  # a secret-looking name's value as "***" (``envvars``)
            status["env"] = model.preset.env.shown()
        status.update(self._process_status())
        if model.preset.replicas > 1 or len(model.replicas) > 1:
            status["replicas"] = [{"pid": r.pid, "port": r.port, "in_flight": r.in_flight,
                                   **({"cpu": r.cpu} if r.cpu else {}),
                                   **({"pace": r.pace} if r.pace is not None else {})}
                                  for r in self.replicas()]
        status.update(self._progress_status())
        status["memory"] = self._memory_status()
        status.update(self._trouble_status())
        if model.last_load_s is not None:
            status["load_s"] = round(model.last_load_s, 3)
        if self.keeps_states:  # a listing reads no file
            status["states"] = self._states_status()
        return status

    def _states_status(self) -> dict[str, Any]:
        """Its saved states (warm swaps, its conversations kept): how many and their bytes,
        what the saves and restores did, and why it keeps none, if so."""
        warm = self._sup.warm
        assert warm is not None  # ``keeps_states``
        model_id = self._model.id
        count, size = warm.usage(model_id)
        states: dict[str, Any] = {"count": count, "bytes": size}
        counts = warm.ledger.counts.get(model_id)
        if counts is not None:
            states.update(saved=counts.saved, displaced=counts.displaced,
                          restored=counts.restored, on_demand=counts.on_demand,
                          hits=counts.hits, misses=counts.misses,
                          displace_wait_ms=counts.wait_ms_p50())
        off = warm.ledger.unrestorable(model_id)
        if off is not None:
            states["off"] = off
        return states

    def _process_status(self) -> dict[str, Any]:
        """Its child process: pid, port, uptime and, for a local model, its CPU placement."""
        model, sup = self._model, self._sup
        preset, child = model.preset, model.child
        fields: dict[str, Any] = {}
        if child is not None:
            fields.update(pid=child.pid, port=child.port)
        if model.loaded_at is not None:
            fields["uptime_s"] = round(clock.now() - model.loaded_at, 1)
        if child is not None and preset.upstream is None:
            fields["cpu"] = child.cpu.describe() if child.cpu is not None else {
                "threads": preset.args.get("threads"), "cores": None,
                "placed_by": "preset" if sup.cores else "llama-server"}
            if sup.cpu_gate.is_paused(child):
                fields["cpu"]["paused"] = True  # waiting for its turn on the CPU
        return fields

    def _progress_status(self) -> dict[str, Any]:
        """Where it is on its way: stopping, draining, loading progress, place in the queue."""
        model, admission = self._model, self._sup.admission
        fields: dict[str, Any] = {}
        if model.status is Status.STOPPING:
            fields["stopping"] = True
        if model.draining:
            fields["draining"] = True
        if model.status is Status.LOADING and model.progress is not None:
            fields["progress"] = dict(model.progress)
        position = admission.position(model.id)
        if position is not None:
            fields["queue_position"] = position
            fields["expected_wait_s"] = admission.expected_wait_s(model.id)
        return fields

    def _memory_status(self) -> dict[str, Any]:
        """Its memory, estimated and (while it serves) measured: host RAM, then each GPU."""
        model = self._model
        memory: dict[str, Any] = {"estimate": model.estimate or None}
        if model.replicas:
            memory["measured"] = self.measured()
        if self._sup.gpus:
            measured = self.measured_devices() if model.replicas else {}
            memory["gpus"] = {
                pool: {"estimate": model.estimate_devices.get(pool),
                       **({"measured": measured.get(pool, 0)} if model.replicas else {})}
                for pool in sorted(model.estimate_devices.keys() | measured.keys())}
        return memory

    def _trouble_status(self) -> dict[str, Any]:
        """What keeps it from serving: not downloaded yet, downloading, failed, crash loop."""
        model = self._model
        preset = model.preset
        fields: dict[str, Any] = {}
        if preset.model_path is None and preset.hf_repo:
            fields.update(downloaded=False,
                          message=f"not downloaded yet: hf-repo = {preset.hf_repo}")
        if model.download and model.status is Status.DOWNLOADING:
            fields["download"] = dict(model.download)
        if model.status is Status.UNLOADED and model.failed and model.failure is not None:
            fields.update(failed=True, exit_code=model.failure.exit_code,
                          message=model.failure.message,
                          last_lines=list(model.failure.last_lines))
        if model.crash_loop:
            fields["crash_loop"] = True
        return fields


def _as_written(seconds: float) -> float | int:
    """Seconds as a preset or a request wrote them: 30, not 30.0."""
    return int(seconds) if seconds.is_integer() else seconds


class Models(Protocol):
    """What the parts outside the core (the HTTP edge, observability, peers) may ask of the
    models; ``supervisor.Supervisor`` answers. They read each model as a ``ModelView`` of its
    published snapshot, and act on one through the view ``find`` gave: the handle by which
    the core takes its lease, loads or unloads it, without resolving its name again."""

    settings: Settings
    events: EventBus
    warm: WarmSwaps | None  # saved slot states (``--state-dir``); None: off

    @property
    def catalogue(self) -> Catalogue: ...

    def view(self, model_id: str) -> ModelView | None: ...

    def views(self) -> list[ModelView]: ...

    def find(self, name: str) -> ModelView: ...

    def model_id(self, name: str) -> str | None: ...

    def budgets(self) -> dict[str, Any]: ...

    @property
    def cpu_turns(self) -> int: ...

    @property
    def children_paused(self) -> int: ...

    @property
    def cpu_other_work(self) -> float | None: ...

    def on_routed(self, callback: RoutedCallback) -> None: ...

    def lease_now(self, model: ModelView, prefix: Prefix | None = None,
                  turn: Turn | None = None) -> Lease | None: ...

    async def acquire(self, model: ModelView, *, autoload: bool = True,
                      budget: float | None = None, prefix: Prefix | None = None,
                      ends: Ends = ..., turn: Turn | None = None) -> Lease: ...

    def keeps_conversations(self, model: ModelView) -> bool: ...

    async def place(self, lease: Lease, prefix: Prefix, credential: bytes,
                    wanted: int | None = None, pinned: bool = True) -> int | None: ...

    def lease_child(self, model: str, child: Backend) -> Lease | None: ...

    async def load(self, model: ModelView) -> None: ...

    async def unload(self, model: ModelView, *, explicit: bool = True) -> None: ...

    def keep_alive(self, model: ModelView, seconds: float) -> None: ...

    def add_model(self, preset: ModelPreset) -> ModelView: ...

    def start_download(self, model: ModelView) -> asyncio.Task[None]: ...

    def remove_model(self, model_id: str) -> None: ...

    def reconfigure(self, catalogue: Catalogue) -> dict[str, list[str]]: ...
