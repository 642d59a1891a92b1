"""The client commands' output, in process, against a live router with fake children.

``test_client_cli.py`` runs the same commands as a user does (subprocesses, the real
llama-server); here each command function is called directly, so what it prints can be checked
line by line, including the never-ending ``events`` and ``logs -f`` and the error paths.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support import RouterProcess, fake_binary, start_router, wait_until, write_presets

from router import client as commands
from router.children.process import free_port

pytestmark = pytest.mark.fake

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
CLOCK = r"\d\d:\d\d:\d\d"


class Enough(Exception):
    """Raised by ``Until`` to end a command that would otherwise print forever."""


class Until(io.StringIO):
    """Output that calls ``trigger`` (in a thread) after the first line and ends the command,
    by raising ``Enough``, once a line matches ``until``."""

    def __init__(self, until: str, trigger: Callable[[], object]) -> None:
        super().__init__()
        self.until = re.compile(until)
        self.trigger = trigger
        self.worker: threading.Thread | None = None

    def write(self, text: str) -> int:
        written = super().write(text)
        if self.worker is None:
            self.worker = threading.Thread(target=self.trigger)
            self.worker.start()
        if any(self.until.search(line) for line in text.splitlines()):
            raise Enough
        return written

    def lines(self) -> list[str]:
        return self.getvalue().splitlines()


def follow(command: Callable[..., int], client: httpx.Client, args: argparse.Namespace,
           until: str, trigger: Callable[[], object]) -> list[str]:
    out = Until(until, trigger)
    with pytest.raises(Enough):
        command(client, args, out)
    assert out.worker is not None
    out.worker.join(30)
    return out.lines()


def namespace(**fields: object) -> argparse.Namespace:
    defaults: dict[str, object] = {"json": False, "model": None, "lines": 100, "follow": False}
    return argparse.Namespace(**{**defaults, **fields})


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    tmp_path = tmp_path_factory.mktemp("client")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    presets = write_presets(tmp_path / "client.ini",
                            f"[chat]\nmodel = {model}\nalias = talk\n"
                            f"[hot]\nmodel = {model}\nreplicas = 2\n"
                            f"[spare]\nmodel = {model}\n")
    with start_router(tmp_path, "--llama-server", str(fake_binary(tmp_path)),
                      "--presets", str(presets), "--models-max", "0") as running:
        yield running


@pytest.fixture
def client(router: RouterProcess) -> Iterator[httpx.Client]:
    # A read timeout: a stream that never shows the awaited line fails the test, not hangs it.
    with httpx.Client(base_url=router.url, timeout=30.0) as http:
        yield http
        for model, info in router.models().items():  # every test starts with none loaded
            if info["status"]["value"] != "unloaded":  # type: ignore[index]
                http.post("/models/unload", json={"model": model})


def columns(row: str) -> list[str]:
    return re.split(r" {2,}", row)


def test_load_json_then_ps_lists_every_replica(router: RouterProcess,
                                               client: httpx.Client) -> None:
    out = io.StringIO()
    assert commands.cmd_load(client, namespace(model="hot", json=True), out) == 0
    assert json.loads(out.getvalue()) == {"success": True}
    status = router.models()["hot"]["status"]
    replicas = status["replicas"]
    assert isinstance(replicas, list) and len(replicas) == 2

    out = io.StringIO()
    assert commands.cmd_ps(client, namespace(), out) == 0
    header, *rows = map(columns, out.getvalue().splitlines())
    assert header == ["MODEL", "STATUS", "PID", "PORT", "UPTIME", "MEMORY", "IN-FLIGHT"]
    assert [r[:2] for r in rows] == [["hot", "loaded"]] * 2
    assert sorted((r[2], r[3], r[6]) for r in rows) == sorted(
        (str(r["pid"]), str(r["port"]), "0") for r in replicas)
    assert all(re.fullmatch(r"\d+s", r[4]) and r[5].endswith("iB") for r in rows)

    out = io.StringIO()
    assert commands.cmd_unload(client, namespace(model="hot", json=True), out) == 0
    assert json.loads(out.getvalue())["success"] is True
    assert router.models()["hot"]["status"]["value"] == "unloaded"


def test_events_prints_one_line_per_event(router: RouterProcess, client: httpx.Client) -> None:
    lines = follow(commands.cmd_events, client, namespace(),
                   until=r" chat status_change status=loaded\b",
                   trigger=lambda: commands.cmd_load(client, namespace(model="chat"),
                                                     io.StringIO()))
    # The snapshot first (one line per model), then the load as it happens.
    assert all(re.match(CLOCK + r" \S+ \S+", line) for line in lines)
    snapshot = {line.split()[1] for line in lines if line.split()[2] == "model_status"}
    assert {"chat", "hot", "spare"} <= snapshot
    assert any(re.search(r" chat status_change status=loading\b", line) for line in lines)
    assert re.search(r" chat status_change status=loaded duration=[0-9.]+ ", lines[-1])


def test_events_json_prints_each_event_as_sent(client: httpx.Client) -> None:
    lines = follow(commands.cmd_events, client, namespace(json=True),
                   until=r'"event": ?"status_change".*"status": ?"loaded"',
                   trigger=lambda: commands.cmd_load(client, namespace(model="spare"),
                                                     io.StringIO()))
    events = [json.loads(line) for line in lines]
    assert all({"model", "event"} <= set(e) for e in events)
    assert events[-1]["model"] == "spare"
    assert events[-1]["data"]["status"] == "loaded"


def test_logs_follow_prints_the_history_then_new_lines(router: RouterProcess,
                                                       client: httpx.Client) -> None:
    assert commands.cmd_load(client, namespace(model="chat"), io.StringIO()) == 0

    def last_line() -> str:
        out = io.StringIO()
        commands.cmd_logs(client, namespace(model="chat", lines=1), out)
        return out.getvalue()

    # Once a child serves, its output is read every 50 ms (``process.OUTPUT_BATCH_S``): its
    # last start-up line ("all slots are idle") may still be in the pipe. Until it is in the
    # log, "the last line before following" is a moving target.
    assert wait_until(lambda: "all slots are idle" in last_line(), 10), last_line()
    history = io.StringIO()
    assert commands.cmd_logs(client, namespace(model="talk", lines=2), history) == 0
    assert len(history.getvalue().splitlines()) == 2

    def chat() -> None:
        with router.client() as http:
            assert http.post("/v1/chat/completions",
                             json={"model": "chat", **CHAT}).status_code == 200

    lines = follow(commands.cmd_logs, client, namespace(model="chat", lines=1, follow=True),
                   until="release", trigger=chat)
    assert lines[0] == history.getvalue().splitlines()[-1]  # -n 1: the last line before
    assert any("processing task" in line for line in lines[1:])
    assert "release" in lines[-1]


def test_logs_of_an_unknown_model_is_an_error(client: httpx.Client) -> None:
    with pytest.raises(commands.ClientError, match=r"^404: model 'nope' not found"):
        commands.cmd_logs(client, namespace(model="nope", follow=True), io.StringIO())
    with pytest.raises(commands.ClientError, match=r"^404: model 'nope' not found"):
        commands.cmd_logs(client, namespace(model="nope"), io.StringIO())


def test_an_unreachable_router_is_exit_1_naming_the_address(
        capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    args = namespace(command="ls", url=url, api_key=None)
    assert commands.run_client(args, io.StringIO()) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"llama-router ls: cannot reach the router at {url}: ")


def test_an_error_without_an_envelope_shows_the_body_or_the_reason(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Something in front of the router (a reverse proxy) may answer in plain text."""
    answers = {"/models/load": httpx.Response(502, text="upstream went away\n"),
               "/models/unload": httpx.Response(503, content=b"")}
    transport = httpx.MockTransport(lambda request: answers[request.url.path])
    with httpx.Client(transport=transport, base_url="http://router") as mocked:
        with pytest.raises(commands.ClientError, match=r"^502: upstream went away$"):
            commands.cmd_load(mocked, namespace(model="m"), io.StringIO())
        with pytest.raises(commands.ClientError, match=r"^503: Service Unavailable$"):
            commands.cmd_unload(mocked, namespace(model="m"), io.StringIO())


def test_events_refused_by_the_router_is_an_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/models/sse"
        return httpx.Response(401, json={"error": {"code": 401, "message": "Invalid API Key",
                                                   "type": "authentication_error"}})

    with httpx.Client(transport=httpx.MockTransport(refuse), base_url="http://router") as mocked:
        out = io.StringIO()
        with pytest.raises(commands.ClientError, match=r"^401: Invalid API Key$"):
            commands.cmd_events(mocked, namespace(), out)
        assert out.getvalue() == ""


def test_ls_cached_with_an_empty_cache_says_where_it_looked(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    out = io.StringIO()
    assert commands.list_cached(False, out) == 0
    assert out.getvalue() == f"no GGUF models in {tmp_path / 'hub'}\n"
    out = io.StringIO()
    assert commands.list_cached(True, out) == 0
    assert json.loads(out.getvalue()) == []


@pytest.mark.parametrize("name", ["not-a-repo", "owner/repo/extra", ":Q4_K_M"])
def test_pull_of_a_malformed_name_is_exit_1(name: str) -> None:
    out = io.StringIO()
    assert commands.pull(name, out=out) == 1
    assert out.getvalue() == (f"llama-router pull: {name!r} is not a Hugging Face model: "
                              "use owner/repo[:QUANT]\n")
