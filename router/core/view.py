"""A read-only view of a model's run state: what everything outside the scheduling core reads.

Routes (``/models``, ``/props``, streams), metrics, keys and nodes read a model through a
``ModelView`` from ``Supervisor.view``/``views``/``find``: its status, counters, replicas,
memory, queue place and failure, and its ``/models`` entry, computed where the state lives. A
view has no setters and hands out no task, child or lifecycle state to change: the supervisor
and its parts (loader, executor, leases) stay the only writers of a model's run state.

A view is cheap (two references) and live: it reads the model's state when asked, so hold one
only for the request at hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import clock
from ..config.sources import safe_id
from .lifecycle import Status

if TYPE_CHECKING:
    from ..config.presets import ModelPreset
    from ..logs import LogRing
    from .runtime import Failure, ModelRuntime
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
    __slots__ = ("_runtime", "_sup")

    def __init__(self, runtime: ModelRuntime, core: Core) -> None:
        self._runtime = runtime
        self._sup = core  # the core's parts it reads through (``wiring.wire`` made them)

    def __repr__(self) -> str:
        return f"<ModelView {self._runtime!r}>"

    # -- identity and configuration ----------------------------------------------------------

    @property
    def id(self) -> str:
        return self._runtime.id

    @property
    def preset(self) -> ModelPreset:
        return self._runtime.preset  # frozen

    @property
    def aliases(self) -> tuple[str, ...]:
        return self._runtime.preset.aliases

    @property
    def logs(self) -> LogRing:
        """Its llama-server's recent output (``/logs``), to read or follow."""
        return self._runtime.logs

    # -- state -------------------------------------------------------------------------------

    @property
    def status(self) -> Status:
        return self._runtime.status

    @property
    def serving(self) -> bool:
        """Loaded, not draining: a request gets a replica at once."""
        return self._runtime.serving

    @property
    def loading(self) -> bool:
        return self._runtime.status in (Status.LOADING, Status.DOWNLOADING)

    @property
    def draining(self) -> bool:
        return self._runtime.draining

    @property
    def failed(self) -> bool:
        return self._runtime.failed

    @property
    def crash_loop(self) -> bool:
        return self._runtime.crash_loop

    @property
    def failure(self) -> Failure | None:
        return self._runtime.failure

    @property
    def in_flight(self) -> int:
        return self._runtime.in_flight

    @property
    def waiting(self) -> int:
        return self._runtime.waiting

    @property
    def processes(self) -> int:
        """Local processes it holds (serving and starting); a remote upstream holds none."""
        runtime = self._runtime
        if runtime.preset.upstream is not None:
            return 0
        return len(runtime.replicas) + len(runtime.starting)

    def replicas(self) -> list[ReplicaView]:
        missed = self._sup.liveness.missed
        routed = self._runtime.preset.prefix_routing
        now = clock.now()
        return [ReplicaView(r.child.pid, r.child.port, r.in_flight, r.child.base_url,
                            missed(r.child), r.child.cpu.describe() if r.child.cpu else None,
                            {**r.pace.describe(), "backlog_s": round(r.backlog.remaining(now), 3)}
                            if routed else None)
                for r in self._runtime.replicas]

    def serves_through(self, child: object) -> bool:
        """Whether ``child`` is one of its serving replicas' backends now."""
        return any(r.child is child for r in self._runtime.replicas)

    # -- memory ------------------------------------------------------------------------------

    def measured(self) -> int | None:
        """Resident memory of its serving children (sampled), None when unknown."""
        return self._sup.accounting.measured(self._runtime)

    def measured_devices(self) -> dict[str, int]:
        return self._sup.accounting.measured_devices(self._runtime)

    # -- the /models entry -------------------------------------------------------------------

    def entry(self, created: int) -> dict[str, Any]:
        """Its ``/models`` entry, in llama.cpp's shape plus the router's status fields."""
        runtime = self._runtime
        preset = runtime.preset
        entry: dict[str, Any] = {
            "id": preset.id, "aliases": sorted(preset.aliases), "tags": list(preset.tags),
            "object": "model", "owned_by": "llamacpp", "created": created,
            "status": self._status(), "source": preset.source,
            "can_remove": preset.source == "cache",
        }
        if preset.upstream is not None:  # a remote upstream (its key is never shown)
            entry["upstream"] = preset.upstream
        if runtime.info and runtime.status is not Status.UNLOADED:
            for key, value in runtime.info.items():
                entry.setdefault(key, value)
        return entry

    def _status(self) -> dict[str, Any]:
        """The entry's ``status``: its state, command line and counters, then the parts."""
        runtime, sup = self._runtime, self._sup
        child = runtime.child
        status: dict[str, Any] = {
            "value": runtime.status.public,
            # A path need not be UTF-8; the answer must be (``sources.safe_id``).
            "args": [safe_id(arg) for arg in
                     (child.argv if child else sup.spawner.display_argv(runtime))],
            "in_flight": runtime.in_flight,
            "waiting": runtime.waiting,
        }
        status.update(self._process_status())
        if runtime.preset.replicas > 1 or len(runtime.replicas) > 1:
            status["replicas"] = [{"pid": r.pid, "port": r.port, "in_flight": r.in_flight,
                                   **({"cpu": r.cpu} if r.cpu else {}),
                                   **({"pace": r.pace} if r.pace is not None else {})}
                                  for r in self.replicas()]
        status.update(self._progress_status())
        status["memory"] = self._memory_status()
        status.update(self._trouble_status())
        warm = sup.warm
        if warm is not None and warm.covers(runtime.preset):  # a listing reads no file
            count, size = warm.usage(runtime.id)
            status["states"] = {"count": count, "bytes": size}  # saved slots (warm swaps)
        return status

    def _process_status(self) -> dict[str, Any]:
        """Its child process: pid, port, uptime and, for a local model, its CPU placement."""
        runtime, sup = self._runtime, self._sup
        preset, child = runtime.preset, runtime.child
        fields: dict[str, Any] = {}
        if child is not None:
            fields.update(pid=child.pid, port=child.port)
        if runtime.loaded_at is not None:
            fields["uptime_s"] = round(clock.now() - runtime.loaded_at, 1)
        if child is not None and preset.upstream is None:
            fields["cpu"] = child.cpu.describe() if child.cpu is not None else {
                "threads": preset.args.get("threads"), "cores": None,
                "placed_by": "preset" if sup.cores else "llama-server"}
            if sup.cpu_gate.is_paused(child):
                fields["cpu"]["paused"] = True  # waiting for its turn on the CPU
        return fields

    def _progress_status(self) -> dict[str, Any]:
        """Where it is on its way: stopping, draining, loading progress, place in the queue."""
        runtime, admission = self._runtime, self._sup.admission
        fields: dict[str, Any] = {}
        if runtime.status is Status.STOPPING:
            fields["stopping"] = True
        if runtime.draining:
            fields["draining"] = True
        if runtime.status is Status.LOADING and runtime.progress is not None:
            fields["progress"] = dict(runtime.progress)
        position = admission.position(runtime)
        if position is not None:
            fields["queue_position"] = position
            fields["expected_wait_s"] = admission.expected_wait_s(runtime)
        return fields

    def _memory_status(self) -> dict[str, Any]:
        """Its memory, estimated and (while it serves) measured: host RAM, then each GPU."""
        runtime = self._runtime
        memory: dict[str, Any] = {"estimate": runtime.estimate or None}
        if runtime.replicas:
            memory["measured"] = self.measured()
        if self._sup.gpus:
            measured = self.measured_devices() if runtime.replicas else {}
            memory["gpus"] = {
                pool: {"estimate": runtime.estimate_devices.get(pool),
                       **({"measured": measured.get(pool, 0)} if runtime.replicas else {})}
                for pool in sorted(runtime.estimate_devices.keys() | measured.keys())}
        return memory

    def _trouble_status(self) -> dict[str, Any]:
        """What keeps it from serving: not downloaded yet, downloading, failed, crash loop."""
        runtime = self._runtime
        preset = runtime.preset
        fields: dict[str, Any] = {}
        if preset.model_path is None and preset.hf_repo:
            fields.update(downloaded=False,
                          message=f"not downloaded yet: hf-repo = {preset.hf_repo}")
        if runtime.download and runtime.status is Status.DOWNLOADING:
            fields["download"] = dict(runtime.download)
        if runtime.status is Status.UNLOADED and runtime.failed and runtime.failure is not None:
            fields.update(failed=True, exit_code=runtime.failure.exit_code,
                          message=runtime.failure.message,
                          last_lines=list(runtime.failure.last_lines))
        if runtime.crash_loop:
            fields["crash_loop"] = True
        return fields
