"""The API key file against the real llama-server, through a router subprocess: each key
without ``name=`` is a team of its own, and the file is applied live.

A key removed from the file (by the file watch, ``SIGHUP`` or ``POST /models/reload``) is
refused from its next request, and its stream in flight ends at once with the unload's kind
of ending, a last 503 error event; another key's stream goes on untouched, and the keys given
with ``--api-key`` stay. A broken or emptied file keeps the last good keys, each problem
logged as ``file:line: problem``, never a key."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from support import RouterProcess, start_router, wait_until, write_presets

pytestmark = pytest.mark.real

TIMEOUT = 60.0  # a hang guard: every wait ends at once when the router is right
ADMIN = "sk-admin-flag-0123456789"  # given with --api-key: not from the file, stays
KEY_A, KEY_B = "sk-alice-removed-0123456789", "sk-bob-kept-0123456789"
ENDLESS = {"model": "m", "stream": True, "ignore_eos": True,
           "messages": [{"role": "user", "content": "go on"}]}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def save_atomically(path: Path, text: str) -> None:
    """What editors do: write a temporary file, then rename it over the original."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def models_status(router: RouterProcess, key: str) -> int:
    with router.client() as client:
        return client.get("/v1/models", headers=auth(key)).status_code


class Stream(threading.Thread):
    """An endless streamed generation with ``key``, read until it ends or ``stop`` is set."""

    def __init__(self, router: RouterProcess, key: str) -> None:
        super().__init__(daemon=True)
        self.router, self.key = router, key
        self.started = threading.Event()
        self.stop = threading.Event()
        self.body = b""
        self.status = 0

    def run(self) -> None:
        with self.router.client() as client, \
                client.stream("POST", "/v1/chat/completions", json=ENDLESS,
                              headers=auth(self.key)) as response:
            self.status = response.status_code
            for chunk in response.iter_raw():
                self.body += chunk
                self.started.set()
                if self.stop.is_set():
                    return

    def last_event(self) -> dict[str, Any]:
        event: dict[str, Any] = json.loads(self.body.rstrip().rsplit(b"data: ", 1)[-1])
        return event


def router_args(tmp_path: Path, model: Path, llama_server: Path, key_file: Path,
                flag_key: bool = True) -> tuple[str, ...]:
    """One model, two slots; the key file, and ``ADMIN`` with --api-key if ``flag_key``."""
    presets = write_presets(tmp_path / "m.ini", f"[m]\nmodel = {model}\nctx-size = 1024\n"
                            "parallel = 2\ncontext-shift = true\n")
    return ("--presets", str(presets), "--llama-server", str(llama_server),
            *(("--api-key", ADMIN) if flag_key else ()), "--api-key-file", str(key_file))


def test_keys_without_a_name_are_teams_of_their_own(tmp_path: Path,
                                                    tiny_models: dict[str, Path],
                                                    llama_server: Path) -> None:
    """Two keys with one field each and no ``name=``: two teams, ``key-1`` and ``key-2``
    after their lines, each with its own usage row (one shared row before the fix)."""
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"{KEY_A} role=infer\n{KEY_B} role=infer\n")
    with start_router(tmp_path, *router_args(tmp_path, tiny_models["alpha"], llama_server,
                                             key_file)) as router, router.client() as client:
        for key in (KEY_A, KEY_B):
            answer = client.post("/v1/chat/completions", headers=auth(key), json={
                "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            assert answer.status_code == 200, answer.text
        rows = client.get("/usage", headers=auth(ADMIN)).json()["usage"]
    assert sorted((row["name"], row["requests"]) for row in rows) == [("key-1", 1),
                                                                     ("key-2", 1)]


@pytest.mark.parametrize("trigger", ["file change", "SIGHUP", "POST /models/reload"])
def test_a_removed_keys_stream_ends_and_the_other_goes_on(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path, trigger: str) -> None:
    """Key A's stream and key B's run; A is removed from the file. For ``SIGHUP`` and the
    API the file is a link to a file elsewhere, whose edits the watch (of the link's
    directory) does not see, so that the trigger alone applies them."""
    key_file = tmp_path / "etc" / "api-keys"
    key_file.parent.mkdir()
    target = key_file
    if trigger != "file change":
        target = tmp_path / "secrets" / "api-keys"
        target.parent.mkdir()
        key_file.symlink_to(target)
    target.write_text(f"{KEY_A} role=infer\n{KEY_B} role=infer\n")
    with start_router(tmp_path, *router_args(tmp_path, tiny_models["long"], llama_server,
                                             key_file)) as router:
        a, b = Stream(router, KEY_A), Stream(router, KEY_B)
        for stream in (a, b):
            stream.start()
            assert stream.started.wait(TIMEOUT), router.log()
        remove_key_a(router, key_file, target, trigger)
        assert wait_until(lambda: models_status(router, KEY_A) == 401, TIMEOUT), router.log()
        a.join(TIMEOUT)
        assert not a.is_alive() and a.status == 200
        ended = a.last_event()["error"]
        assert ended["code"] == 503 and "API key of this request was removed" in \
            ended["message"], a.body[-300:]
        mark = len(b.body)
        assert wait_until(lambda: b.body.count(b"data: ", mark) >= 20, TIMEOUT)  # goes on
        b.stop.set()
        b.join(TIMEOUT)
        assert b"error" not in b.body and not b.is_alive()
        assert models_status(router, KEY_B) == 200 and models_status(router, ADMIN) == 200
    log = router.log()
    assert f"API keys reloaded ({trigger}): 0 added, 1 removed, 0 changed; 1 requests of " \
           "removed keys ended" in log, log
    assert "Traceback" not in log and "ERROR" not in log, log
    assert not any(key in log for key in (KEY_A, KEY_B, ADMIN))


def remove_key_a(router: RouterProcess, key_file: Path, target: Path, trigger: str) -> None:
    """Key A gone from the file (B stays on its line: its team ``key-2`` unchanged), and the
    trigger that applies it."""
    kept = f"# alice's key removed\n{KEY_B} role=infer\n"
    if trigger == "file change":
        save_atomically(key_file, kept)
        return
    target.write_text(kept)
    assert models_status(router, KEY_A) == 200  # the watch saw nothing
    if trigger == "SIGHUP":
        router.proc.send_signal(signal.SIGHUP)
        return
    with router.client() as client:
        reloaded = client.post("/models/reload", headers=auth(ADMIN))
    assert reloaded.status_code == 200, reloaded.text
    assert reloaded.json()["keys"] == {"added": 0, "removed": 1, "changed": 0, "ended": 1}


def test_a_broken_or_emptied_key_file_keeps_the_last_good_keys(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """Every key from the file (``ADMIN`` too: without --api-key, an emptied file would leave
    the router without keys, and is refused as at start)."""
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"{KEY_A} role=infer\n{KEY_B} role=infer\n{ADMIN}\n")
    with start_router(tmp_path, *router_args(tmp_path, tiny_models["alpha"], llama_server,
                                             key_file, flag_key=False)) as router, \
            router.client() as client:
        def config_error() -> list[str] | None:
            error: list[str] | None = client.get("/props", headers=auth(ADMIN)).json()[
                "config_error"]
            return error

        save_atomically(key_file, f"{KEY_B} role=infer\n{KEY_A} role=root\n# fine\n"
                                  f"{KEY_A}-more rol=infer\n")
        assert wait_until(config_error, TIMEOUT), router.log()
        assert [e.split(": ", 1)[0] for e in config_error() or []] == [f"{key_file}:2",
                                                                       f"{key_file}:4"]
        assert all(models_status(router, key) == 200 for key in (KEY_A, KEY_B))
        api = client.post("/models/reload", headers=auth(ADMIN))
        assert api.status_code == 400 and f"{key_file}:4: unknown field 'rol'" in \
            api.json()["error"]["message"]
        save_atomically(key_file, "# nobody\n")
        assert wait_until(lambda: "gives no API key" in str(config_error()), TIMEOUT), \
            router.log()
        assert all(models_status(router, key) == 200 for key in (KEY_A, KEY_B, ADMIN))
        save_atomically(key_file, f"# alice's key removed\n{KEY_B} role=infer\n{ADMIN}\n")
        assert wait_until(lambda: config_error() is None, TIMEOUT), router.log()
        assert (models_status(router, KEY_A), models_status(router, KEY_B)) == (401, 200)
    log = router.log()
    assert f"reload rejected: {key_file}:2: role= has an unknown role 'root'" in log
    assert f"reload rejected: {key_file}:4: unknown field 'rol'" in log
    assert not any(key in log for key in (KEY_A, KEY_B, ADMIN))
