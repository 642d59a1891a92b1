"""One llama-server child: spawn, readiness, output capture, stop, exit.

Contract:

* ``start()`` spawns the binary in its own process group (``start_new_session``) with
  ``PR_SET_PDEATHSIG = SIGKILL`` on Linux, so a router killed with SIGKILL takes its children
  with it (``spawn``: without forking the router).
* Child mode: the child runs with ``LLAMA_SERVER_ROUTER_PORT`` set, as llama.cpp's own router
  starts its children. llama-server then reports its state on stdout as lines
  ``cmd_child_to_router:state:{"state": ..., "payload": ...}`` (load progress per stage, and
  ``ready`` with its model info) and logs to stderr. Each state line goes to ``on_state``
  (never to the log); every other line of either stream is read into a ``LogRing`` and the
  router's log (prefixed with the model id). stdin is a pipe held open for the child's life:
  a ready child exits when it reads EOF, so it also ends when the router is gone.
* ``wait_ready(timeout)`` returns when the child's ``ready`` line arrives (llama-server
  writes it after its HTTP server listens and it has marked itself ready, so ``/health``
  would answer 200: no round trip to confirm it). Until the child's first state line shows
  it runs in child mode, ``GET /health`` is polled every ``HEALTH_POLL_INTERVAL_S`` (at once
  when the child logs that it listens), and a 200 counts too: a binary without child mode.
  It races the process's exit; it raises ``ChildExited`` or ``ChildTimeout`` (the caller
  stops it).
* ``stop(timeout)`` writes llama.cpp's exit command (``cmd_router_to_child:exit``) to the
  child's stdin and closes it (a ready child in child mode waits for that, even after
  SIGTERM), sends SIGTERM to the group, waits ``timeout``, then SIGKILLs the group, and
  reaps. It is idempotent and safe to call at any point, including mid-start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from .. import clock
from ..config.settings import HEALTH_POLL_INTERVAL_S
from ..errors import UpstreamError
from ..host.cpus import CpuShare
from ..http.upstream import DEFAULT_HEAD_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS, ChildConnections, probe
from ..logs import LogRing, relay
from .childenv import child_environment
from .spawn import Spawned, spawn

log = logging.getLogger("router.child")
output_log = logging.getLogger("router.child.output")
# llama.cpp log lines look like "0.00.003.284 W srv  llama_server: ..."; keep their level.
_LLAMA_LEVELS = {"W": logging.WARNING, "E": logging.ERROR, "D": logging.DEBUG}

_LISTENING_MARKER = "listening on http"
CHILD_STATE_PREFIX = b"cmd_child_to_router:state:"
EXIT_COMMAND = b"cmd_router_to_child:exit\n"
ROUTER_PORT_ENV = "LLAMA_SERVER_ROUTER_PORT"
# Called with (state, payload) for each state line a child writes: "loading", "ready",
# "sleeping" or "downloading". Must be quick and must not raise.
# Told each state line of a child: the child, its state and the line's payload.
StateCallback = Callable[["ChildProcess", str, dict[str, Any]], None]
_BIND_FAILURE_MARKERS = ("couldn't bind", "address already in use", "failed to bind")
# A ready child's output is read at most this often (``_read_output``), this much at a time.
OUTPUT_BATCH_S = 0.05
OUTPUT_CHUNK_BYTES = 1 << 16
MAX_LINE_BYTES = 1 << 16  # longer output lines are skipped


def load_progress(previous: dict[str, Any] | None,
                  payload: dict[str, Any]) -> dict[str, Any] | None:
    """A child's ``loading`` payload as llama.cpp's router publishes it,
    ``{"stages": [...], "current": stage, "value": 0.0..1.0}``; ``{"stage": s}`` (sent before
    the mmproj loads) starts stage ``s`` at 0. None for a payload of neither shape."""
    if "stages" in payload and "current" in payload:
        try:
            value = min(max(float(payload.get("value", 0.0)), 0.0), 1.0)
        except (TypeError, ValueError):
            return None
        return {"stages": list(payload["stages"]), "current": payload["current"],
                "value": value}
    stage = payload.get("stage")
    if isinstance(stage, str):
        stages = list(previous["stages"]) if previous else []
        if stage not in stages:
            stages.append(stage)
        return {"stages": stages, "current": stage, "value": 0.0}
    return None


def progress_rank(progress: dict[str, Any]) -> tuple[int, float]:
    """Order progress reports: the later stage, then the larger value, is further."""
    stages = progress.get("stages") or []
    current = progress.get("current")
    index = stages.index(current) if current in stages else 0
    return index, float(progress.get("value", 0.0))


class ChildError(Exception):
    """Base for child failures; carries the last output lines."""

    def __init__(self, message: str, last_lines: list[str]) -> None:
        super().__init__(message)
        self.last_lines = last_lines


class ChildExited(ChildError):
    def __init__(self, message: str, last_lines: list[str], exit_code: int) -> None:
        super().__init__(message, last_lines)
        self.exit_code = exit_code

    @property
    def port_in_use(self) -> bool:
        text = "\n".join(self.last_lines).lower()
        return any(marker in text for marker in _BIND_FAILURE_MARKERS)


class ChildTimeout(ChildError):
    pass


def _level_of(line: str) -> int:
    parts = line.split(" ", 2)
    if len(parts) >= 2 and len(parts[1]) == 1:
        return _LLAMA_LEVELS.get(parts[1], logging.INFO)
    return logging.INFO


def _wake(waker: asyncio.Future[None]) -> None:
    if not waker.done():
        waker.set_result(None)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def http_error_text(exc: httpx.HTTPError) -> str:
    """An HTTP failure in a few words for a message: its type, and its text if it has one."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def no_answer(timeout: float) -> str:
    """What ``ask_health`` says when nothing answered within ``timeout`` s."""
    return f"no answer within {timeout:g} s"


async def ask_health(client: httpx.AsyncClient, url: str, timeout: float,
                     headers: dict[str, str]) -> tuple[int | None, str | None]:
    """One health request: ``(status, None)`` when answered in time, else ``(None, what
    went wrong)`` (``no_answer(timeout)`` when nothing answered at all)."""
    try:
        response = await client.get(url, timeout=timeout, headers=headers)
    except httpx.TimeoutException:
        return None, no_answer(timeout)
    except httpx.HTTPError as exc:
        return None, http_error_text(exc)
    return response.status_code, None


class ChildProcess:
    """A llama-server process serving one model on 127.0.0.1:``port``: a ``backend.Backend``."""

    def __init__(self, model_id: str, argv: Sequence[str], port: int, logs: LogRing,
                 client: httpx.AsyncClient, env: dict[str, str] | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S,
                 cpu: CpuShare | None = None, router_port: int = 0,
                 on_state: StateCallback | None = None) -> None:
        self.model_id = model_id
        self.cpu = cpu  # the cores it computes on, when the router placed it (``cpus``)
        self.argv = list(argv)
        self.port = port
        self.logs = logs
        self.base_url = f"http://127.0.0.1:{port}"
        self._client = client
        self._env = {**(env if env is not None else child_environment()),
                     ROUTER_PORT_ENV: str(router_port)}
        self.on_state = on_state
        # The child's own /v1/models entry, from its ``ready`` line (child mode only).
        self.ready_info: dict[str, Any] | None = None
        self._proc: Spawned | None = None
        self._listening = asyncio.Event()  # the child said it is listening: poll now
        self._ready = asyncio.Event()  # the child wrote its ready line: it serves
        self._child_mode = False  # it wrote a state line: its ready line says when it serves
        self._connections: ChildConnections | None = None
        self._max_connections = max_connections
        self._head_timeout_s = head_timeout_s
        self._readers: list[asyncio.Task[None]] = []
        self._batch_output = False  # read output every OUTPUT_BATCH_S (once ready)
        self._wakers: set[asyncio.Future[None]] = set()  # readers waiting to read again
        self.started_at: float | None = None

    def __repr__(self) -> str:
        return (f"<ChildProcess {self.model_id} pid={self.pid} port={self.port} "
                f"rc={self.returncode}>")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    @property
    def connections(self) -> ChildConnections:
        """The keep-alive pool for requests proxied to this child. One pool per child, so
        that stopping the child first closes its idle connections: llama-server takes about
        100 ms longer to exit while a keep-alive connection is open."""
        if self._connections is None:
            self._connections = ChildConnections("127.0.0.1", self.port,
                                                 self._max_connections,
                                                 head_timeout_s=self._head_timeout_s)
        return self._connections

    async def close_pool(self) -> None:
        """Close the idle proxied connections; the ones in use close when released."""
        if self._connections is not None:
            await self._connections.aclose()

    async def start(self) -> None:
        self._proc = await spawn(self.argv, self._env)
        self.started_at = clock.now()
        log.info("spawned", extra={"event": "spawned", "model": self.model_id,
                                   "pid": self._proc.pid, "port": self.port})
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._readers = [
            asyncio.create_task(self._read_output(self._proc.stdout), name=f"out:{self.model_id}"),
            asyncio.create_task(self._read_output(self._proc.stderr), name=f"log:{self.model_id}")]

    async def _read_output(self, stream: asyncio.StreamReader) -> None:
        """Read one output stream to its end, line by line. Once the child is ready, what
        it wrote is taken at most every ``OUTPUT_BATCH_S``: llama-server writes several lines
        as it starts each request, and handling them one by one would compete with relaying
        that request's first token (on a loaded machine, with the child's own computing)."""
        prefix = f"[{self.model_id}] "
        pending = b""
        skipping = False  # within a line over MAX_LINE_BYTES: drop it up to its end
        while True:
            chunk = await stream.read(OUTPUT_CHUNK_BYTES)
            if not chunk:
                if pending and not skipping:
                    self._output_line(pending, prefix)
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                if skipping:
                    skipping = False
                else:
                    self._output_line(raw, prefix)
            if len(pending) > MAX_LINE_BYTES:
                pending, skipping = b"", True
            if self._batch_output:
                await self._nap()

    async def _nap(self) -> None:
        """Wait ``OUTPUT_BATCH_S``, or less if ``_output_now`` is called meanwhile."""
        loop = asyncio.get_running_loop()
        waker: asyncio.Future[None] = loop.create_future()
        self._wakers.add(waker)
        timer = loop.call_later(OUTPUT_BATCH_S, _wake, waker)
        try:
            await waker
        finally:
            timer.cancel()
            self._wakers.discard(waker)

    def _output_now(self) -> None:
        """Read output as it comes again (the child is stopping or gone: its last lines
        matter, and nothing is relayed any more)."""
        self._batch_output = False
        for waker in list(self._wakers):
            _wake(waker)

    def _output_line(self, raw: bytes, prefix: str) -> None:
        if raw.startswith(CHILD_STATE_PREFIX):
            self._state_line(raw[len(CHILD_STATE_PREFIX):])
            return
        line = raw.decode("utf-8", "replace").rstrip()
        self.logs.append(line)
        level = _level_of(line)
        if output_log.isEnabledFor(level):
            # Handed to the log thread as is: formatting and writing happen there.
            relay(output_log, level, prefix + line)
        if _LISTENING_MARKER in line:
            self._listening.set()

    def _state_line(self, raw: bytes) -> None:
        try:
            message = json.loads(raw)
            state, payload = str(message["state"]), message.get("payload") or {}
            if not isinstance(payload, dict):
                raise TypeError("payload is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("unreadable state line from the child: %s", exc,
                        extra={"model": self.model_id})
            return
        self._child_mode = True
        if state == "ready":
            if payload:  # waking from sleep sends {}
                self.ready_info = payload
            self._ready.set()
        if self.on_state is not None:
            try:
                self.on_state(self, state, payload)
            except Exception:
                log.exception("state callback failed", extra={"model": self.model_id})

    async def wait_exit(self) -> int:
        """Wait for the process to exit and its output to be drained; the exit code."""
        assert self._proc is not None
        code = await self._proc.wait()
        self._output_now()
        if self._readers:  # at most a second for their last lines; they are not cancelled
            await asyncio.wait(self._readers, timeout=1.0)
        return code

    async def wait_ready(self, timeout: float, total: float | None = None) -> None:
        """Wait up to ``timeout`` s for health; ``total`` is the whole budget, for messages."""
        exit_task = asyncio.ensure_future(self.wait_exit())
        poll_task = asyncio.ensure_future(self._poll_health())
        ready_task = asyncio.ensure_future(self._ready.wait())
        try:
            done, _ = await asyncio.wait({exit_task, poll_task, ready_task}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (poll_task, exit_task, ready_task):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if ready_task in done or (poll_task in done and not poll_task.cancelled()
                                  and poll_task.exception() is None):
            self._batch_output = True  # serving: its output is read in batches
            return
        if exit_task in done:
            code = exit_task.result()
            raise ChildExited(f"llama-server exited with code {code} while loading",
                              self.logs.tail(20), code)
        raise ChildTimeout(f"llama-server did not become healthy within {total or timeout:g} s",
                           self.logs.tail(20))

    async def _poll_health(self) -> None:
        """Until ``/health`` answers 200. A child that wrote a state line is in child mode: it
        is polled no more (each poll costs the router and the loading child CPU time, ~10 ms
        a load on 2 cores), its ready line ends ``wait_ready``. The first poll waits an
        interval too: a child in child mode writes its first state line before that."""
        url = self.base_url + "/health"
        while True:
            # Poll after the interval, or at once when the child logs that it listens (once:
            # the event is cleared so a child that never turns healthy is not polled in a
            # busy loop).
            with contextlib.suppress(TimeoutError):  # not wait_for: it may swallow a cancel
                async with asyncio.timeout(HEALTH_POLL_INTERVAL_S):
                    await self._listening.wait()
            self._listening.clear()
            if self._child_mode:
                break
            try:
                # No keep-alive: an idle pooled connection makes llama-server slow to exit.
                response = await self._client.get(url, timeout=2.0,
                                                  headers={"connection": "close"})
                if response.status_code == 200:
                    return
            except httpx.TransportError:
                pass
        await self._ready.wait()

    async def probe(self, timeout: float) -> str | None:
        """A liveness check (``liveness``): None if ``/health`` answered 200 within
        ``timeout``, else what went wrong."""
        try:
            async with asyncio.timeout(timeout):
                status = await probe("127.0.0.1", self.port, b"/health")
        except TimeoutError:
            return no_answer(timeout)
        except UpstreamError as exc:
            return str(exc)
        return None if status == 200 else f"/health answered {status}"

    async def stop(self, timeout: float) -> int | None:
        """SIGTERM the group, SIGKILL after ``timeout``, reap. Returns the exit code."""
        proc = self._proc
        if proc is None:
            return None
        self._output_now()
        if proc.returncode is None:
            await self.close_pool()
            self._close_stdin(EXIT_COMMAND)
            self._signal_group(signal.SIGTERM)
            self._signal_group(signal.SIGCONT)  # a paused child could not act on SIGTERM
            try:
                # ``asyncio.timeout``, not ``wait_for``: Python 3.11's ``wait_for`` drops a
                # cancel that comes in the same loop step as the exit.
                async with asyncio.timeout(timeout):
                    await asyncio.shield(proc.wait())
            except TimeoutError:
                log.warning("did not stop within %.1f s; killing", timeout,
                            extra={"event": "kill", "model": self.model_id, "pid": proc.pid})
                self._signal_group(signal.SIGKILL)
        code = await self.wait_exit()
        self._signal_group(signal.SIGKILL)  # grandchildren, if any, go with it
        log.info("stopped", extra={"event": "stopped", "model": self.model_id, "pid": proc.pid,
                                   "exit_code": code})
        return code

    def _close_stdin(self, last: bytes = b"") -> None:
        stdin = self._proc.stdin if self._proc is not None else None
        if stdin is None or stdin.is_closing():
            return
        with contextlib.suppress(OSError, RuntimeError):
            if last:
                stdin.write(last)
            stdin.close()

    def pause(self) -> bool:
        """SIGSTOP the child (``cpugate``: it computes in turns); False if it is not running."""
        if self._proc is None or self._proc.returncode is not None:
            return False
        self._signal_group(signal.SIGSTOP)
        return True

    def resume(self) -> None:
        """SIGCONT a child that ``pause()`` stopped."""
        if self._proc is not None and self._proc.returncode is None:
            self._signal_group(signal.SIGCONT)

    def kill_now(self) -> None:
        """SIGKILL the group without waiting (used during interpreter shutdown)."""
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)
