"""What each model is expected to use and measurably uses, in host RAM and on each GPU.

* Estimates come from the GGUF header (``memory.estimate_for_args``), read in a thread once
  per configuration of a model (again after ``runtime.Unestimated``: its file or arguments
  changed), split between host RAM and GPUs by ``gpus.placement``, and handed to the
  record's owner as ``runtime.Estimated``.
* Measurements are sampled, not taken per request: ``run()`` refreshes every child's resident
  memory (psutil, its whole process tree) every ``RSS_SAMPLE_S`` and per-process GPU memory
  (nvidia-smi) every ``GPU_SAMPLE_S``, in a worker thread, off the event loop. Readers
  (``/models``, ``/metrics``, admission) get the cached figures; a child not sampled yet is
  measured once on first read, so a fresh child is never counted as using nothing.
* With each sample, the CPU time the machine spent outside the router and its children
  (``cpus.OtherWork``, read by the spawner when it decides how a child's threads wait).
* What a model holds against a budget is the larger of its estimate and its measurement.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable, Iterable

from ..host.cpus import OtherWork
from ..host.gpus import (
    GpuDevice,
    holds_gpu_device,
    placement,
    usage_by_pid,
    visible_devices,
)
from ..host.memory import RAM, estimate_for_args, measure_rss
from .runtime import Estimated, ModelRuntime, ModelSnapshot, own_pids

log = logging.getLogger("router.accounting")

RSS_SAMPLE_S = 1.0
GPU_SAMPLE_S = 2.0


# Errors of the moment, not of the file: a header that could not be read for one of these is
# read again next time instead of leaving the model without an estimate for good.
TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN,
                              errno.EINTR})


def _transient(exc: BaseException | None) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
            return True
        exc = exc.__cause__
    return False


def _measure_all(pids: list[int]) -> dict[int, int | None]:
    return {pid: measure_rss(pid) for pid in pids}


class Accounting:
    def __init__(self, gpus: list[GpuDevice], other_work: OtherWork | None = None) -> None:
        self.gpus = gpus
        self.other_work = other_work  # sampled with the children's memory: ``run``
        self._rss: dict[int, int | None] = {}  # per child pid, refreshed by run()
        self._gpu_usage: dict[int, dict[str, int]] = {}  # per child pid, refreshed by run()

    # ----------------------------------------------------------------- estimates

    async def estimate(self, runtime: ModelRuntime) -> Estimated | None:
        """What the model's GGUF header says it needs (``runtime.Estimated``), for its owner to
        record; None when that is known already (read once per configuration: ``Unestimated``
        after its file or arguments change) or its file is not here yet."""
        preset = runtime.preset
        if runtime.estimated or preset.model_path is None:
            return None
        try:
            one = await asyncio.to_thread(estimate_for_args, preset.model_path, preset.args)
        except (OSError, ValueError) as exc:
            if _transient(exc):  # e.g. out of file descriptors: not the file's fault
                log.warning("cannot read the model's header now (%s); the estimate is "
                            "tried again in a moment", exc, extra={"model": runtime.id})
                return Estimated(again=True)
            log.warning("cannot estimate memory: %s", exc, extra={"model": runtime.id})
            return Estimated()
        where = placement(one, preset.args, visible_devices(self.gpus, preset.env))
        if one.prompt_cache_unbounded:
            log.warning("cache-ram = -1: the prompt cache has no limit, so the memory "
                        "estimate leaves it out; only the measured size counts",
                        extra={"model": runtime.id})
        return Estimated(where.pop(RAM) * preset.replicas,
                         {pool: n * preset.replicas for pool, n in where.items()},
                         None if "cache-ram" in preset.args else one.default_cache_ram_mib,
                         one.n_layer)

    # ----------------------------------------------------------------- measurements

    def measured(self, model: ModelSnapshot) -> int | None:
        """Resident memory of the model's serving children (at most ``RSS_SAMPLE_S`` old)."""
        known = [s for s in (self._child_rss(r.child.pid) for r in model.replicas
                             if r.child.pid is not None) if s is not None]
        return sum(known) if known else None

    def _child_rss(self, pid: int) -> int | None:
        if pid not in self._rss:
            self._rss[pid] = measure_rss(pid)
        return self._rss[pid]

    def measured_devices(self, model: ModelSnapshot) -> dict[str, int]:
        """GPU memory its children use per device (nvidia-smi, at most a few seconds old)."""
        total: dict[str, int] = {}
        for replica in model.replicas:
            for pool, used in self._gpu_usage.get(replica.child.pid or -1, {}).items():
                total[pool] = total.get(pool, 0) + used
        return total

    def memory_held(self, model: ModelSnapshot) -> int:
        """What a model holding processes counts against the RAM budget."""
        return max(model.estimate, self.measured(model) or 0)

    def may_hold_gpu(self, model: ModelSnapshot) -> bool:
        """Whether the children a stop is ending may still hold GPU memory, of any vendor:
        one has a GPU device open, or that cannot be told (not Linux; a GPU nvidia-smi does
        not see has no budget to check it by)."""
        return any(holds_gpu_device(r.child.pid) is not False for r in model.state.stopping
                   if r.child.pid is not None)

    def devices_held(self, model: ModelSnapshot) -> dict[str, int]:
        """Per GPU, the larger of its estimate and its measured use."""
        measured = self.measured_devices(model)
        pools = model.estimate_devices.keys() | measured.keys()
        return {p: max(model.estimate_devices.get(p, 0), measured.get(p, 0)) for p in pools}

    async def run(self, models: Callable[[], Iterable[ModelRuntime]],
                  record: Callable[[ModelRuntime, Estimated], None]) -> None:
        """Sample the children of ``models()`` until cancelled (see the module docstring);
        read again the headers that could not be read just now, each estimate given to
        ``record`` (the record's owner)."""
        gpu_due = 0.0
        loop = asyncio.get_running_loop()
        while True:
            for runtime in [m for m in models() if m.estimate_due]:
                estimated = await self.estimate(runtime)
                if estimated is not None:
                    record(runtime, estimated)
            pids = [r.child.pid for m in models() for r in m.replicas if r.child.pid is not None]
            if self.other_work is not None:  # a few small reads: on the loop
                self.other_work.sample(own_pids(models()))
            if pids:
                self._rss = await asyncio.to_thread(_measure_all, pids)
                if self.gpus and loop.time() >= gpu_due:
                    self._gpu_usage = await asyncio.to_thread(usage_by_pid, self.gpus)
                    gpu_due = loop.time() + GPU_SAMPLE_S
            else:
                self._rss = {}
            await asyncio.sleep(RSS_SAMPLE_S)
