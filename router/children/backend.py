"""What serves one replica of a model: the one interface the core sees.

Two kinds stand behind it: ``process.ChildProcess`` (a llama-server the router starts) and
``remote.RemoteUpstream`` (a server somewhere else, ``upstream = http://host:port``). The
loader, executor, liveness probes, leases, CPU gate, proxy and routes use only this, so they
handle both alike; the scheduler simulation (``tests/simulation.py``) stands a fake behind it.

The backend carries only what it is: how to start it, reach it, probe it and stop it. What
other parts know about it lives with them: missed health checks with ``liveness``, why the
router killed it with its ``runtime.Replica``, load progress with the ``spawner``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..host.cpus import CpuShare
    from ..http.upstream import ChildConnections


class Backend(Protocol):
    model_id: str
    base_url: str  # http://host:port, where requests go
    port: int
    argv: list[str]  # what runs it (``["upstream", url]`` for a remote upstream)
    cpu: CpuShare | None  # the cores it computes on, when the router placed it (``cpus``)
    started_at: float | None  # ``clock.now()`` at start
    ready_info: dict[str, Any] | None  # its own /v1/models entry, once known

    @property
    def pid(self) -> int | None: ...  # None: no local process

    @property
    def returncode(self) -> int | None: ...  # None while it runs

    @property
    def connections(self) -> ChildConnections: ...  # the pool proxied requests use

    async def start(self) -> None: ...

    async def wait_ready(self, timeout: float, total: float | None = None) -> None:
        """Until it answers its health check; raises ``process.ChildError`` if it cannot."""

    async def wait_exit(self) -> int:
        """Until it has exited (a remote upstream: until marked gone); the exit code."""

    async def stop(self, timeout: float) -> int | None:
        """Stop it (SIGTERM, SIGKILL after ``timeout``); the exit code."""

    async def probe(self, timeout: float) -> str | None:
        """A liveness check: None if healthy within ``timeout``, else what went wrong."""

    def kill_now(self) -> None:
        """End it without waiting (SIGKILL; a remote upstream: mark it gone)."""

    def pause(self) -> bool:
        """Stop it computing (``cpugate``); False if it cannot be paused."""

    def resume(self) -> None: ...

    async def close_pool(self) -> None:
        """Close the idle proxied connections."""
