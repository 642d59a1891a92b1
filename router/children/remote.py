"""A remote upstream as a model: any OpenAI-compatible server at ``http://host:port``.

A preset section with ``upstream = http://host:port`` is served by a server the router does
not start (another llama-server, another llama-router, vLLM, ...). ``RemoteUpstream`` is a
``backend.Backend`` as a model's ``ChildProcess`` is, so the core (loader, executor, liveness,
leases, proxy) handles it like a child without knowing the difference:

* ``start()`` spawns nothing; ``wait_ready(timeout)`` probes ``GET /health`` (or
  ``GET /v1/models`` when the upstream answers /health with 404) until it answers 200. An
  upstream that cannot be reached at all (connection refused, unknown host) fails the load at
  once: there is no process to wait for. One that answers something else (llama-server says
  503 while it loads its model) is polled until the load timeout.
* ``wait_exit()`` returns only once the upstream has been marked gone: ``kill_now()``, which
  the liveness check calls after its missed probes (``liveness``), or ``stop()``. The exit
  watcher then handles it as a crash: the model is unloaded, failed, with the reason, and the
  next request loads it again (under the crash backoff).
* ``connections`` is an ``upstream.ChildConnections`` pool to host:port; ``stop()`` closes it.
* The upstream's bearer key (``upstream-api-key-file``) goes with the probes and, through
  ``forward``, with every request to it; it is never logged or shown.

``pid``, ``cpu``, ``ready_info`` before the load, and ``progress`` stay None: it holds no
local process, memory or cores, so accounting, admission and the CPU gate leave it out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any
from urllib.parse import urlsplit

import httpx

from .. import clock
from ..config.settings import HEALTH_POLL_INTERVAL_S
from ..host.cpus import CpuShare
from ..http.upstream import DEFAULT_HEAD_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, ChildConnections
from ..logs import LogRing
from .process import ChildTimeout, ask_health, http_error_text

log = logging.getLogger("router.remote")

REMOTE_POLL_INTERVAL_S = max(HEALTH_POLL_INTERVAL_S, 0.25)  # another machine: poll less often
PROBE_TIMEOUT_S = 2.0
GONE_CODE = -1  # what ``wait_exit`` returns: no process, no exit status


class UpstreamUnreachable(ChildTimeout):
    """Nothing answers at the upstream's address: the load fails at once."""


class RemoteUpstream:
    """The upstream at ``url`` (``http://host:port``) serving model ``model_id``: a
    ``backend.Backend``."""

    cpu: CpuShare | None = None  # no local cores

    def __init__(self, model_id: str, url: str, logs: LogRing, client: httpx.AsyncClient, *,
                 api_key: str | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an http:// upstream: {url!r}")
        self.model_id = model_id
        self.url = url
        self.argv = ["upstream", url]
        self.host = parts.hostname
        self.port = parts.port or 80
        self.base_url = f"http://{parts.netloc}"
        self.logs = logs
        self.started_at: float | None = None
        self.ready_info: dict[str, Any] | None = None
        self._client = client
        self._max_connections = max_connections
        self._head_timeout_s = head_timeout_s
        self._connections: ChildConnections | None = None
        # Sent with the probes and (``forward``) with every proxied request; never logged.
        self.auth_header: tuple[bytes, bytes] | None = (
            (b"authorization", f"Bearer {api_key}".encode("latin-1")) if api_key else None)
        self._probe_headers = {"connection": "close"}
        if api_key:
            self._probe_headers["authorization"] = f"Bearer {api_key}"
        self.health_path = "/health"  # "/v1/models" once /health answered 404
        self._gone = asyncio.Event()
        self._marked_gone = False

    def __repr__(self) -> str:
        return f"<RemoteUpstream {self.model_id} {self.url} gone={self._marked_gone}>"

    @property
    def pid(self) -> int | None:
        return None  # no local process

    @property
    def returncode(self) -> int | None:
        """``GONE_CODE`` once marked gone or stopped, else None."""
        return GONE_CODE if self._gone.is_set() else None

    async def close_pool(self) -> None:
        if self._connections is not None:
            await self._connections.aclose()

    @property
    def connections(self) -> ChildConnections:
        if self._connections is None:
            self._connections = ChildConnections(self.host, self.port, self._max_connections,
                                                 label=f"upstream {self.url}",
                                                 head_timeout_s=self._head_timeout_s)
        return self._connections

    async def start(self) -> None:
        self.started_at = clock.now()
        log.info("using upstream %s", self.url, extra={"event": "upstream",
                                                       "model": self.model_id})

    # ----------------------------------------------------------------- probes

    async def probe(self, timeout: float) -> str | None:
        """None if the upstream answered its health path with 200 within ``timeout``, else
        what went wrong. A 404 on ``/health`` switches to ``/v1/models`` (asked at once)."""
        status, problem = await ask_health(self._client, self.base_url + self.health_path,
                                           timeout, self._probe_headers)
        if status == 404 and self.health_path == "/health":
            self.health_path = "/v1/models"
            status, problem = await ask_health(self._client, self.base_url + self.health_path,
                                               timeout, self._probe_headers)
        if problem is not None:
            return problem
        return None if status == 200 else f"{self.health_path} answered {status}"

    async def wait_ready(self, timeout: float, total: float | None = None) -> None:
        """Probe until 200 within ``timeout`` s (see the module docstring)."""
        deadline = clock.now() + timeout
        last: str | None = None
        while True:
            left = deadline - clock.now()
            if left <= 0:
                raise ChildTimeout(
                    f"upstream {self.url} did not answer {self.health_path} with 200 within "
                    f"{total or timeout:g} s (last: {last})", self.logs.tail(20))
            try:
                reached = await self._client.get(
                    self.base_url + self.health_path, timeout=min(PROBE_TIMEOUT_S, left),
                    headers=self._probe_headers)
            except httpx.ConnectError as exc:
                self._note(f"{self.base_url}{self.health_path}: {exc or type(exc).__name__}")
                raise UpstreamUnreachable(f"upstream {self.url} is unreachable: "
                                          f"{exc or type(exc).__name__}",
                                          self.logs.tail(20)) from None
            except httpx.HTTPError as exc:
                last = http_error_text(exc)
            else:
                if reached.status_code == 404 and self.health_path == "/health":
                    self.health_path = "/v1/models"
                    continue
                if reached.status_code == 200:
                    self.ready_info = await self._model_entry()
                    return
                last = f"{self.health_path} answered {reached.status_code}"
            self._note(f"{self.base_url}{self.health_path}: {last}")
            await asyncio.sleep(min(REMOTE_POLL_INTERVAL_S, max(left, 0.0)))

    async def _model_entry(self) -> dict[str, Any] | None:
        """The upstream's first ``/v1/models`` entry (its model's info), if it lists one."""
        with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError, TypeError):
            response = await self._client.get(self.base_url + "/v1/models",
                                              timeout=PROBE_TIMEOUT_S,
                                              headers=self._probe_headers)
            if response.status_code == 200:
                data = response.json().get("data") or []
                return dict(data[0]) if data else None
        return None

    def _note(self, line: str) -> None:
        """A line in the model's log ring (``/logs``, a failure's last lines), once in a row."""
        if self.logs.tail(1) != [line]:
            self.logs.append(line)

    # ----------------------------------------------------------------- gone

    async def wait_exit(self) -> int:
        """Return once the upstream has been marked gone (``kill_now``, ``stop``)."""
        await self._gone.wait()
        return GONE_CODE

    def kill_now(self) -> None:
        """Mark the upstream gone (the liveness check gave up on it): the exit watcher
        reports it, and requests still waiting on it end at once (their connections are
        aborted: a 502, or a stream's error event)."""
        self._marked_gone = True
        self._gone.set()
        if self._connections is not None:
            self._connections.abort_all()

    async def stop(self, timeout: float) -> int | None:
        """Stop using the upstream: close the pool. Always clean (0)."""
        await self.close_pool()
        self._gone.set()
        return 0

    def pause(self) -> bool:
        return False

    def resume(self) -> None:
        return None
