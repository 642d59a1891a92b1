"""A request's path from the edge to the child visits each module at most once per direction.

The router is served in process as ``serve`` serves it (uvicorn, the HTTP/1.1 protocol of
``http11``, the app of ``server.build_app``), with tests/fake_llama_server.py as its child, and
every call between the router's modules is recorded (``sys.setprofile``) while a client's
requests go through it: a chat completion answered whole, and one streamed with a resumable
conversation id, both with an API key.

What "once per direction" means here, checked on every chain of calls the request makes:

* **Down**: the modules of the path are layered (``LAYERS``, the edge first, the child's
  connection last); a call from one module into another must go to a module below every
  module of the path already on the stack. So no module is entered twice on the way down
  and nothing calls back up into a module above it: no callbacks climbing from the leases
  into the supervisor, no middleware re-entered after the CORS layer.
* **Up**: the response goes up through the ASGI ``send`` chain (or the direct body writer of
  ``http11``, its shortcut to the client's transport): a call to those starts the up
  direction, which must descend the same way from there.
* **Records** (``RECORDS``) are the values the steps read and write, not steps: the request's
  context, a model's view, its preset, the clock, the errors. Any module may call them; they
  call nothing but records.
* A chain that begins outside the router's code (the event loop resuming a task, a transport
  handing over bytes) starts a fresh stack.

A module the path enters that is in neither table fails the test: it must be placed.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import pytest
from support import fake_binary, serve_in_uvicorn

import router
from router.config.settings import Settings
from router.config.sources import build_catalogue
from router.http.http11 import EnvelopeHttpToolsProtocol, Refusals
from router.llama.flags import FlagTable
from router.server import Prepared, build_app

pytestmark = pytest.mark.fake

GUARD_S = 60.0  # a hang guard, never a measurement
KEY = "sk-path-5e1f"

# Top to bottom: on the way down a module may call only modules below every path module on
# its stack; on the way up, only modules above them.
LAYERS = ("http11", "middleware", "cors", "keys", "forward", "metering", "route", "nodes",
          "resumable", "supervisor", "wait", "leases", "slotqueue", "executor", "lifecycle",
          "modelset", "changes", "cpugate", "proxy", "upstream")
# Where the response's way up begins (module, qualified name or its prefix): the ASGI send
# chain (a keyed request's ``keys.Flight``, then the edge's wrapper), and the direct body
# (``proxy.DirectBody``: the child's bytes written by the upstream connection through
# ``http11``'s writer straight to the client's transport).
UP = (("keys", "Flight.__call__"),
      ("middleware", "RequestMetricsMiddleware.__call__.<locals>.send_wrapper"),
      ("proxy", "DirectBody."), ("http11", "body_writer"), ("http11", "BodyWriter."),
      ("http11", "OneWrite."))
# Values read or written along the way, and pure functions of them: callable from anywhere,
# calling only each other.
RECORDS = frozenset({"requests", "paths", "errors", "view", "runtime", "presets", "clock",
                     "tail", "process", "backend", "affinity", "pace", "metrics", "activity",
                     "keyfile", "sources", "connstate", "members", "fairshare", "quotas",
                     "usage", "genai", "otel"})
ROOTS = frozenset({"http11", "middleware", "upstream"})  # where the request's chains begin


@dataclass(frozen=True)
class Call:
    event: str  # "call" or "return"
    module: str
    function: str  # the code's qualified name


def _begins_up(call: Call) -> bool:
    return any(call.module == module and call.function.startswith(prefix)
               for module, prefix in UP)


def violations(calls: Iterable[Call]) -> list[str]:
    """Every call that breaks the rule (see the module docstring), described."""
    found: list[str] = []
    stack: list[tuple[str, bool]] = []  # (module, begins an up chain)
    skipping = 0  # depth inside a chain that is not the request's
    for call in calls:
        if call.event == "return":
            if skipping:
                skipping -= 1
            elif stack:
                stack.pop()
            continue
        if skipping or (not stack and call.module not in ROOTS):
            skipping += 1
            continue
        module = call.module
        up = _begins_up(call)
        if module not in LAYERS and module not in RECORDS:
            found.append(f"{module}.{call.function}: a module on the path that is neither "
                         "in LAYERS nor in RECORDS")
        elif stack and stack[-1][0] != module and not up:
            problem = _crossing(stack, module)
            if problem:
                found.append(f"{problem} {module}.{call.function}")
        stack.append((module, up))
    return found


def _crossing(stack: list[tuple[str, bool]], module: str) -> str | None:
    """What is wrong with a call into ``module`` (another module) from the top of
    ``stack``, or None."""
    caller = stack[-1][0]
    if caller in RECORDS:
        return None if module in RECORDS else f"{caller} -> a record calls a step:"
    if module in RECORDS:
        return None
    start = max((i for i, (_, up) in enumerate(stack) if up), default=-1)
    chain = _collapsed(stack[max(start, 0):])
    rank = LAYERS.index(module)
    if start >= 0:  # on the way up: only outwards
        below = [m for m in chain if m in LAYERS and LAYERS.index(m) <= rank]
        return f"{' -> '.join(chain)} -> goes back down past {below[0]}:" if below else None
    above = [m for m in chain if m in LAYERS and LAYERS.index(m) >= rank]
    return f"{' -> '.join(chain)} -> climbs back past {above[0]}:" if above else None


def _collapsed(frames: list[tuple[str, bool]]) -> list[str]:
    chain: list[str] = []
    for module, _ in frames:
        if not chain or chain[-1] != module:
            chain.append(module)
    return chain


class Recorder:
    """Calls into the router's modules, recorded while ``recording``."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._root = str(Path(router.__file__).parent) + "/"

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event in ("call", "return"):
            filename = frame.f_code.co_filename
            if filename.startswith(self._root):
                module = Path(filename).stem  # a module's name is unique across the parts
                self.calls.append(Call(event, module, frame.f_code.co_qualname))

    @contextlib.contextmanager
    def recording(self) -> Any:
        sys.setprofile(self._profile)
        try:
            yield
        finally:
            sys.setprofile(None)


# --------------------------------------------------------------------------- the checker


def calls(*pairs: str) -> list[Call]:
    """``"+mod.fn"`` enters a function, ``"-"`` returns from the innermost."""
    found: list[Call] = []
    open_: list[Call] = []
    for pair in pairs:
        if pair == "-":
            entered = open_.pop()
            found.append(Call("return", entered.module, entered.function))
        else:
            module, function = pair[1:].split(".", 1)
            entered = Call("call", module, function)
            open_.append(entered)
            found.append(entered)
    return found


def test_the_checker_passes_a_straight_path_with_siblings_and_records() -> None:
    assert violations(calls(
        "+middleware.M.__call__", "+requests.RequestContext.__init__", "-",
        "+forward.proxy", "+route.decide", "+supervisor.Supervisor.find", "+view.V.id", "-",
        "-", "-", "+supervisor.Supervisor.lease_now", "+leases.Leases.take",
        "+cpugate.CpuGate.busy", "-", "-", "-", "+proxy.relay", "+upstream.send", "-",
        "+middleware.RequestMetricsMiddleware.__call__.<locals>.send_wrapper",
        "+requests.RequestContext.sent", "-", "-", "-", "-", "-")) == []


def test_the_checker_finds_a_callback_climbing_back_up() -> None:
    found = violations(calls(
        "+middleware.M.__call__", "+forward.proxy", "+supervisor.Supervisor.lease_now",
        "+leases.Leases.take", "+supervisor.Supervisor._on_busy", "-", "-", "-", "-", "-"))
    assert found == ["middleware -> forward -> supervisor -> leases -> climbs back past "
                     "supervisor: supervisor.Supervisor._on_busy"]


def test_the_checker_finds_a_module_entered_twice_on_the_way_down() -> None:
    found = violations(calls("+middleware.M.__call__", "+cors.C.__call__",
                             "+middleware.K.__call__", "-", "-", "-"))
    assert found == ["middleware -> cors -> climbs back past middleware: "
                     "middleware.K.__call__"]


def test_the_checker_lets_the_answer_go_up_only_outwards() -> None:
    send = "+middleware.RequestMetricsMiddleware.__call__.<locals>.send_wrapper"
    assert violations(calls(
        "+upstream.C.data_received", "+proxy.DirectBody.__call__",
        "+http11.BodyWriter.one_write", "-", "-", "-",
        "+middleware.M.__call__", "+forward.proxy", "+proxy.relay", send,
        "+http11.P.on_response_complete", "-", "-", "-", "-", "-")) == []
    found = violations(calls("+middleware.M.__call__", "+proxy.relay", send,
                             "+cors.C.again", "-", "-", "-", "-"))
    assert found == ["middleware -> goes back down past middleware: cors.C.again"]


def test_the_checker_finds_a_record_calling_a_step_and_an_unplaced_module() -> None:
    found = violations(calls("+middleware.M.__call__", "+view.V.x", "+supervisor.S.y", "-",
                             "-", "+dashboard.D.z", "-", "-"))
    assert found == ["view -> a record calls a step: supervisor.S.y",
                     "dashboard.D.z: a module on the path that is neither in LAYERS nor in "
                     "RECORDS"]


def test_the_checker_ignores_chains_that_are_not_the_requests() -> None:
    assert violations(calls("+liveness.L.probe", "+supervisor.S.x", "+liveness.L.y", "-",
                            "-", "-")) == []


# ----------------------------------------------------------------------- the real path


@contextlib.asynccontextmanager
async def served(tmp_path: Path, help_table: FlagTable) -> AsyncIterator[httpx.AsyncClient]:
    """The router over one model, ``alpha`` (loaded), served by uvicorn with the router's
    HTTP/1.1 protocol on loopback; a client for it with the key."""
    binary = fake_binary(tmp_path)
    (tmp_path / "alpha.gguf").write_bytes(b"GGUF")
    presets = tmp_path / "models.ini"
    presets.write_text(f"version = 1\n[alpha]\nmodel = {tmp_path / 'alpha.gguf'}\n")
    config = Settings(presets=[presets], llama_server=binary, api_key=[KEY], webui=False)
    catalogue = build_catalogue([presets], [], help_table, [])
    prepared = Prepared(config, binary, help_table, [], catalogue, config.all_api_keys(),
                        "test")
    refusals = Refusals()
    app = build_app(prepared, refusals=refusals)
    async with serve_in_uvicorn(
            app, GUARD_S, lifespan="on", proxy_headers=False, ws="none",
            http=EnvelopeHttpToolsProtocol.configured(refusals=refusals)) as url, \
            httpx.AsyncClient(base_url=url, timeout=GUARD_S,
                              headers={"Authorization": f"Bearer {KEY}"}) as client:
        loaded = await client.post("/models/load?wait=true", json={"model": "alpha"})
        assert loaded.status_code == 200, loaded.text
        yield client


CHAT = {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_a_request_goes_down_and_its_answer_up_without_climbing_back(
        tmp_path: Path, help_table: FlagTable) -> None:
    recorder = Recorder()
    async with served(tmp_path, help_table) as client:
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        with recorder.recording():
            whole = await client.post("/v1/chat/completions", json=CHAT)
        assert whole.status_code == 200 and whole.json()["choices"]
        whole_calls = len(recorder.calls)
        with recorder.recording():
            async with client.stream("POST", "/v1/chat/completions",
                                     json={**CHAT, "stream": True},
                                     headers={"X-Conversation-Id": "path-1"}) as streamed:
                assert streamed.status_code == 200
                body = b"".join([chunk async for chunk in streamed.aiter_bytes()])
        assert body.rstrip().endswith(b"data: [DONE]")
    entered = {c.module for c in recorder.calls}
    # It did reach the child both times, through every step of the path.
    assert {"http11", "middleware", "cors", "keys", "forward", "route", "supervisor",
            "leases", "proxy", "upstream", "resumable"} <= entered
    assert 0 < whole_calls < len(recorder.calls)
    problems = violations(recorder.calls)
    for problem in problems:
        print(problem)
    assert not problems, "\n".join(sorted(set(problems)))
