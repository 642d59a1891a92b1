"""Live configuration: edits apply without dropping a request (against the real llama-server,
marker ``real``); a configuration left without models is refused (also with the fake child,
marker ``fake``); the API key file re-read with the presets (in process: the reloader, its
watch and the keys it puts in force; against real children: ``test_keyfile_live_real.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from support import (
    RouterProcess,
    SSEClient,
    alive,
    fake_binary,
    start_router,
    wait_until,
    write_presets,
)

from router.config.settings import Settings
from router.edge.keys import Keys
from router.edge.reload import Reloader
from router.events import EventBus
from router.llama.flags import FlagTable

real = pytest.mark.real
fake = pytest.mark.fake
HANG_GUARD_S = 10  # generous: a reload takes well under a second
CHAT = {"max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}


def ini(models: dict[str, Path], long_ctx: int = 8192, with_b: bool = True,
        broken: bool = False) -> str:
    text = f"[a]\nmodel = {models['long']}\nctx-size = {long_ctx}\nparallel = 1\n"
    if with_b:
        text += f"[b]\nmodel = {models['beta']}\nctx-size = 1024\n"
    if broken:
        text += "ctx-sise = 5\n"
    return text


def save_atomically(path: Path, text: str) -> None:
    """What editors do: write a temporary file, then rename it over the original."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture
def models(tiny_models: dict[str, Path], llama_server: Path) -> dict[str, Path]:
    return tiny_models


class Stream(threading.Thread):
    """A long streamed generation, read to the end in the background."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model = url, model
        self.started = threading.Event()
        self.body = b""
        self.status = 0

    def run(self) -> None:
        request: dict[str, Any] = {"model": self.model, "stream": True, "max_tokens": 8000,
                                   "ignore_eos": True,
                                   "messages": [{"role": "user", "content": "x"}]}
        with httpx.Client(timeout=120) as client, \
                client.stream("POST", self.url + "/v1/chat/completions", json=request) as r:
            self.status = r.status_code
            for chunk in r.iter_raw():
                self.body += chunk
                self.started.set()

    def finished_cleanly(self) -> bool:
        return self.status == 200 and self.body.rstrip().endswith(b"data: [DONE]")


@real
def test_changed_model_restarts_after_its_stream(tmp_path: Path,
                                                 models: dict[str, Path]) -> None:
    presets = tmp_path / "live.ini"
    presets.write_text(ini(models))
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        for name in ("a", "b"):
            assert client.post("/models/load?wait=true", json={"model": name}).status_code == 200
        before = {m: d["status"]["pid"] for m, d in router.models().items()}
        stream = Stream(router.url, "a")
        stream.start()
        assert stream.started.wait(30)
        save_atomically(presets, ini(models, long_ctx=4096))
        stream.join(120)
        assert stream.finished_cleanly(), stream.body[-300:]
        assert wait_until(lambda: router.models()["a"]["status"].get("pid") not in
                          (None, before["a"]) and
                          router.models()["a"]["status"]["value"] == "loaded", 30)
        args = router.models()["a"]["status"]["args"]
        assert args[args.index("--ctx-size") + 1] == "4096"
        assert not alive(before["a"])
        assert router.models()["b"]["status"]["pid"] == before["b"]  # unchanged: same child
        assert "event=reloaded" in router.log()


@real
def test_removed_model_finishes_its_stream_then_disappears(tmp_path: Path,
                                                          models: dict[str, Path]) -> None:
    presets = tmp_path / "live.ini"
    presets.write_text(ini(models, with_b=True))
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        stream = Stream(router.url, "a")
        stream.start()
        assert stream.started.wait(30)
        pid = router.models()["a"]["status"]["pid"]
        presets.write_text(f"[b]\nmodel = {models['beta']}\nctx-size = 1024\n")
        # Whichever comes first, the file watcher or this request, applies the removal.
        assert client.post("/models/reload").json()["success"] is True
        # New requests for the removed model are refused at once; the stream goes on to its
        # end (a removal that stopped the child would cut it).
        refused = client.post("/v1/chat/completions", json={
            "model": "a", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
        assert refused.status_code == 404
        stream.join(120)
        assert stream.finished_cleanly()
        assert wait_until(lambda: "a" not in router.models(), 10)
        assert wait_until(lambda: not alive(pid), 5)


@real
def test_broken_edit_keeps_the_last_good_configuration(tmp_path: Path,
                                                       models: dict[str, Path]) -> None:
    presets = tmp_path / "live.ini"
    presets.write_text(ini(models))
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        save_atomically(presets, ini(models, broken=True))
        assert wait_until(lambda: client.get("/props").json()["config_error"], 5)
        error = client.get("/props").json()["config_error"]
        assert any("live.ini:8: [b] ctx-sise: unknown key" in e for e in error), error
        assert "reload rejected" in router.log()
        chat = client.post("/v1/chat/completions", json={
            "model": "b", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
        assert chat.status_code == 200  # still serving the previous configuration
        api = client.post("/models/reload")
        assert api.status_code == 400 and "ctx-sise" in api.json()["error"]["message"]
        save_atomically(presets, ini(models, long_ctx=2048))
        assert wait_until(lambda: client.get("/props").json()["config_error"] is None, 5)
        args = router.models()["a"]["status"]["args"]
        assert args[args.index("--ctx-size") + 1] == "2048"


@real
def test_atomic_save_is_picked_up_within_a_second(tmp_path: Path,
                                                  models: dict[str, Path]) -> None:
    presets = tmp_path / "live.ini"
    presets.write_text(ini(models, with_b=False))
    with start_router(tmp_path, "--presets", str(presets)) as router:
        assert set(router.models()) == {"a"}
        sse = SSEClient(router.url)
        sse.start()
        assert sse.connected.wait(10)
        save_atomically(presets, ini(models, with_b=True))
        assert wait_until(lambda: "b" in router.models(), 30)  # how soon: see the benchmark
        assert wait_until(lambda: any(e["event"] == "models_reload" for e in sse.events), 5)
        reload_event = next(e for e in sse.events if e["event"] == "models_reload")
        assert reload_event["model"] == "*" and reload_event["data"]["added"] == ["b"]
        sse.stop.set()


@real
def test_sighup_and_get_reload(tmp_path: Path, models: dict[str, Path]) -> None:
    presets = tmp_path / "live.ini"
    presets.write_text(ini(models, with_b=False))
    with start_router(tmp_path, "--presets", str(presets)) as router, router.client() as client:
        router.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "configuration reloaded (SIGHUP)" in router.log(), 5)
        listing = client.get("/models", params={"reload": "1"}).json()
        assert {m["id"] for m in listing["data"]} == {"a"}
        assert "configuration reloaded (GET /models?reload)" in router.log()
        assert router.proc.poll() is None


# --- A configuration left without models is refused unless the reload allows it ---------------

EMPTIED = {"truncated": "", "version only": "version = 1\n",
           "comments only": "; nothing here\n# nor here\n",
           "defaults only": "[*]\nctx-size = 1024\n"}


@contextmanager
def fake_router(tmp_path: Path, *args: str) -> Iterator[tuple[RouterProcess, httpx.Client]]:
    """The router with tests/fake_llama_server.py as its llama-server."""
    binary = fake_binary(tmp_path)
    with start_router(tmp_path, "--llama-server", str(binary), *args) as router, \
            router.client() as client:
        yield router, client


@contextmanager
def events(router: RouterProcess) -> Iterator[SSEClient]:
    sse = SSEClient(router.url)
    sse.start()
    assert sse.connected.wait(HANG_GUARD_S)
    try:
        yield sse
    finally:
        sse.stop.set()


def failed_reloads(sse: SSEClient, trigger: str) -> list[dict[str, Any]]:
    return [e["data"] for e in sse.events
            if e["event"] == "models_reload_failed" and e["data"]["trigger"] == trigger]


def config_error(client: httpx.Client) -> list[str] | None:
    error: list[str] | None = client.get("/props").json()["config_error"]
    return error


def loaded_pid(client: httpx.Client, model: str) -> int:
    assert client.post("/models/load?wait=true", json={"model": model}).status_code == 200
    pid: int = client.get("/models").json()["data"][0]["status"]["pid"]
    return pid


def assert_refused_empty(router: RouterProcess, client: httpx.Client, source: Path,
                         count: str) -> None:
    """The emptied configuration is rejected with its reason; the router still says so."""
    error = config_error(client)
    assert error is not None and len(error) == 1, error
    assert error[0].startswith(f"{source}: no models defined; keeping the previous "
                               f"configuration ({count})"), error
    assert "allow_empty" in error[0]
    log = router.log()
    assert "ERROR router.reload: reload rejected" in log and "no models defined" in log


@fake
@pytest.mark.parametrize("emptied", EMPTIED.values(), ids=EMPTIED.keys())
def test_emptied_preset_file_keeps_the_running_models(tmp_path: Path, emptied: str) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    presets = write_presets(tmp_path / "live.ini", f"[m]\nmodel = {model}\n")
    with fake_router(tmp_path, "--presets", str(presets)) as (router, client), \
            events(router) as sse:
        pid = loaded_pid(client, "m")
        presets.write_text(emptied)
        assert wait_until(lambda: failed_reloads(sse, "file change"), HANG_GUARD_S)
        assert_refused_empty(router, client, presets, "1 model")
        assert failed_reloads(sse, "file change")[-1]["errors"] == config_error(client)
        assert not any(e["event"] == "models_reload" for e in sse.events)
        assert client.post("/v1/chat/completions", json={"model": "m", **CHAT}).status_code == 200
        assert router.models()["m"]["status"]["pid"] == pid and alive(pid)
        # The API refuses it too, with the same reason, until allowed explicitly.
        api = client.post("/models/reload")
        assert api.status_code == 400
        assert "no models defined" in api.json()["error"]["message"]
        assert router.models()["m"]["status"]["pid"] == pid
        allowed = client.post("/models/reload", json={"allow_empty": True})
        assert allowed.status_code == 200, allowed.text
        assert allowed.json()["removed"] == ["m"]
        assert config_error(client) is None
        assert wait_until(lambda: not router.models() and not alive(pid), HANG_GUARD_S)


@fake
def test_sighup_does_not_apply_an_emptied_file(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    presets = write_presets(tmp_path / "live.ini", f"[m]\nmodel = {model}\n")
    with fake_router(tmp_path, "--presets", str(presets)) as (router, client), \
            events(router) as sse:
        pid = loaded_pid(client, "m")
        presets.write_text("")
        assert wait_until(lambda: failed_reloads(sse, "file change"), HANG_GUARD_S)
        router.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: failed_reloads(sse, "SIGHUP"), HANG_GUARD_S)
        assert_refused_empty(router, client, presets, "1 model")
        assert router.models()["m"]["status"]["pid"] == pid and alive(pid)
        # A valid edit clears the error.
        presets.write_text(f"[m]\nmodel = {model}\nttl = 600\n")
        assert wait_until(lambda: config_error(client) is None, HANG_GUARD_S)
        assert router.models()["m"]["status"]["pid"] == pid


@fake
def test_emptied_models_dir_keeps_its_models_unless_allowed(tmp_path: Path) -> None:
    directory = tmp_path / "models"
    directory.mkdir()
    for name in ("x", "y"):
        (directory / f"{name}.gguf").write_bytes(b"GGUF")
    with fake_router(tmp_path, "--models-dir", str(directory)) as (router, client), \
            events(router) as sse:
        pid = loaded_pid(client, "x")
        for name in ("x", "y"):
            (directory / f"{name}.gguf").unlink()
        assert wait_until(lambda: failed_reloads(sse, "file change"), HANG_GUARD_S)
        assert_refused_empty(router, client, directory, "2 models")
        assert set(router.models()) == {"x", "y"} and alive(pid)
        allowed = client.post("/models/reload?allow_empty=true")
        assert allowed.status_code == 200, allowed.text
        assert allowed.json()["removed"] == ["x", "y"]
        assert wait_until(lambda: not router.models() and not alive(pid), HANG_GUARD_S)


@fake
def test_starting_without_models_is_no_error(tmp_path: Path) -> None:
    """As before: no models at start is served (an empty list); reloading it stays fine,
    and models added later appear."""
    presets = write_presets(tmp_path / "live.ini", "")
    with fake_router(tmp_path, "--presets", str(presets)) as (router, client):
        assert router.models() == {} and config_error(client) is None
        reloaded = client.post("/models/reload")
        assert reloaded.status_code == 200 and reloaded.json()["success"] is True
        model = tmp_path / "m.gguf"
        model.write_bytes(b"GGUF")
        presets.write_text(f"[m]\nmodel = {model}\n")
        assert client.post("/models/reload").json()["added"] == ["m"]


@fake
@pytest.mark.parametrize("request_kw", [
    {"params": {"allow_empty": "maybe"}}, {"json": {"allow_empty": "yes"}},
    {"json": ["allow_empty"]}, {"content": b"{not json", "headers": {
        "content-type": "application/json"}},
], ids=["query", "string", "not an object", "not json"])
def test_reload_options_are_checked(tmp_path: Path, request_kw: dict[str, Any]) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    presets = write_presets(tmp_path / "live.ini", f"[m]\nmodel = {model}\n")
    with fake_router(tmp_path, "--presets", str(presets)) as (router, client):
        presets.write_text("")
        refused = client.post("/models/reload", **request_kw)
        assert refused.status_code == 400
        assert "allow_empty" in refused.text or "JSON object" in refused.text
        assert set(router.models()) == {"m"}  # a bad option never applies anything


@real
def test_emptied_file_keeps_serving_until_allow_empty(tmp_path: Path,
                                                      models: dict[str, Path]) -> None:
    presets = tmp_path / "live.ini"
    presets.write_text(ini(models))
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client, events(router) as sse:
        assert client.post("/models/load?wait=true", json={"model": "b"}).status_code == 200
        pid = router.models()["b"]["status"]["pid"]
        presets.write_text("")  # `: > live.ini`
        assert wait_until(lambda: failed_reloads(sse, "file change"), HANG_GUARD_S)
        assert_refused_empty(router, client, presets, "2 models")
        assert set(router.models()) == {"a", "b"}
        assert router.models()["b"]["status"]["pid"] == pid and alive(pid)
        chat = client.post("/v1/chat/completions", json={"model": "b", **CHAT})
        assert chat.status_code == 200, chat.text
        allowed = client.post("/models/reload", json={"allow_empty": True})
        assert allowed.status_code == 200, allowed.text
        assert allowed.json()["removed"] == ["a", "b"]
        assert config_error(client) is None
        assert wait_until(lambda: not router.models() and not alive(pid), HANG_GUARD_S)
        assert wait_until(lambda: any(e["event"] == "models_reload" for e in sse.events),
                          HANG_GUARD_S)


# --- The API key file, re-read with the presets (in process) -----------------------------------

SECRET = "sk-Never-In-A-Log-0123456789"
KEY_A, KEY_B = f"{SECRET}-a", f"{SECRET}-b"
KEY_GUARD_S = 30.0  # generous: each wait ends within a step of the watcher when right


class NoModels:
    """The models' handle as a reload of no presets sees it: nothing configured, nothing
    changed."""

    catalogue = SimpleNamespace(models={})

    def reconfigure(self, catalogue: object) -> dict[str, list[str]]:
        return {"added": [], "removed": [], "changed": []}


def key_reloader(tmp_path: Path, text: str, **settings: Any) -> tuple[Reloader, Keys, Path]:
    """A reloader of a key file holding ``text`` (and no presets), with the keys read from it
    at start in force."""
    key_file = tmp_path / "api-keys"
    key_file.write_text(text)
    config = Settings(api_key_file=key_file, **settings)
    keys = Keys(config.all_api_keys())
    table = FlagTable({})
    reloader = Reloader(config, table, [], NoModels(), EventBus(),  # type: ignore[arg-type]
                        keys=keys)
    return reloader, keys, key_file


def in_force(keys: Keys) -> dict[bytes, tuple[str, str]]:
    """Each key in force: its scope and its policy, as the key check reads them."""
    return {key: (scope.describe(), policy.describe())
            for key, (scope, policy) in keys.current.entries.items()}


async def test_a_key_file_edit_puts_its_keys_in_force_whole(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    """A key removed, a key added, a scope and a team changed: all in force after one
    reload; the keys given with --api-key stay."""
    reloader, keys, key_file = key_reloader(
        tmp_path, f"{KEY_A} role=infer\n{KEY_B} models=m role=infer\n", api_key=["flag-key"])
    caplog.set_level(logging.INFO)
    save_atomically(key_file, f"{KEY_B} models=m,n role=infer name=bees priority=batch\n"
                              f"{SECRET}-c role=metrics\n")
    outcome = await reloader.reload("file change", force=False)
    assert outcome == {"success": True,
                       "keys": {"added": 1, "removed": 1, "changed": 1, "ended": 0}}
    assert in_force(keys) == {
        b"flag-key": ("role=admin", "name=admin priority=default"),
        KEY_B.encode(): ("role=infer models=m,n", "name=bees priority=batch"),
        f"{SECRET}-c".encode(): ("role=metrics", "name=key-2 priority=default")}
    assert "API keys reloaded (file change): 1 added, 1 removed, 1 changed" in caplog.text
    assert reloader.error is None and SECRET not in caplog.text
    assert await reloader.reload("file change", force=False) == {"success": True,
                                                                 "unchanged": True}


async def test_a_broken_key_file_keeps_the_last_good_keys(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    reloader, keys, key_file = key_reloader(tmp_path, f"{KEY_A}\n{KEY_B} role=infer\n")
    before = in_force(keys)
    key_file.write_text(f"{KEY_A} role=boss\n# fine\n{KEY_B} rol=infer\n")
    outcome = await reloader.reload("SIGHUP")
    assert outcome["success"] is False and in_force(keys) == before
    assert outcome["errors"] == reloader.error == [
        f"{key_file}:1: role= has an unknown role 'boss' (roles: admin, or infer and/or "
        "metrics as a comma list)",
        f"{key_file}:3: unknown field 'rol' (known: models, role, name, priority, "
        "max-concurrent, tokens-per-minute)"]
    for problem in outcome["errors"]:
        assert f"reload rejected: {problem}" in caplog.text
    assert SECRET not in caplog.text
    key_file.write_text(f"{KEY_B}\n")  # fixed: in force, and the error gone
    assert (await reloader.reload("SIGHUP"))["keys"]["removed"] == 1
    assert reloader.error is None and list(in_force(keys)) == [KEY_B.encode()]


@pytest.mark.parametrize("emptied", ["", "# nothing\n\n"], ids=["empty", "comments only"])
async def test_a_key_file_left_without_keys_is_refused(tmp_path: Path, emptied: str) -> None:
    """As at start: a router that serves with keys never ends up serving without them."""
    reloader, keys, key_file = key_reloader(tmp_path, f"{KEY_A}\n")
    key_file.write_text(emptied)
    outcome = await reloader.reload("POST /models/reload")
    assert outcome["success"] is False and list(in_force(keys)) == [KEY_A.encode()]
    assert outcome["errors"] == [
        f"{key_file}: gives no API key (empty, blank or only comments); keeping the last good "
        "keys: a router started with keys never serves without them (restart it without "
        "--api-key-file to serve without keys)"]
    key_file.unlink()  # unreadable: the same
    outcome = await reloader.reload("POST /models/reload")
    assert outcome["errors"][0].startswith(f"{key_file}: No such file")
    assert list(in_force(keys)) == [KEY_A.encode()]


async def test_emptying_a_key_file_beside_api_key_leaves_those_keys(tmp_path: Path) -> None:
    """With keys given by --api-key, an empty file is no empty key set (as at start): its
    keys are removed, the flag's stay."""
    reloader, keys, key_file = key_reloader(tmp_path, f"{KEY_A} role=infer\n",
                                            api_key=["flag-key"])
    key_file.write_text("")
    assert (await reloader.reload("SIGHUP"))["keys"]["removed"] == 1
    assert list(in_force(keys)) == [b"flag-key"]


async def test_the_watch_applies_a_key_file_edit(tmp_path: Path) -> None:
    reloader, keys, key_file = key_reloader(tmp_path, f"{KEY_A}\n{KEY_B}\n")
    watching = asyncio.ensure_future(reloader.watch())
    try:
        async with asyncio.timeout(KEY_GUARD_S):
            while KEY_A.encode() in keys.current.entries:
                # Saved again until seen: the watch tells nobody when it has started.
                save_atomically(key_file, f"{KEY_B}\n")
                await asyncio.sleep(0.1)
        assert list(in_force(keys)) == [KEY_B.encode()]
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
