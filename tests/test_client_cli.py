"""The client commands against a live router with the real llama-server."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from support import start_router, write_presets

pytestmark = pytest.mark.real

CLI = [sys.executable, "-m", "router.cli"]
KEY = "client-test-key"


@pytest.fixture
def presets(tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> Path:
    return write_presets(tmp_path / "cli.ini", f"[a]\nmodel = {tiny_models['alpha']}\n"
                         f"alias = first\n[b]\nmodel = {tiny_models['beta']}\n")


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args, "--url", url, "--api-key", KEY], capture_output=True,
                          text=True, timeout=60)


def follow(url: str, *args: str, until: str, trigger: Callable[[], object]) -> list[str]:
    """Run a never-ending command; call ``trigger`` after its first line, stop at a line
    containing ``until``; the lines seen."""
    proc = subprocess.Popen([*CLI, *args, "--url", url, "--api-key", KEY],
                            stdout=subprocess.PIPE, text=True)
    lines: list[str] = []
    worker: threading.Thread | None = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if worker is None:
                worker = threading.Thread(target=trigger)
                worker.start()
            if until in line:
                worker.join(30)
                return lines
        raise AssertionError(f"ended before {until!r}: {lines}")
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_client_commands(tmp_path: Path, presets: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets), "--api-key", KEY) as router:
        url = router.url
        listing = cli(url, "ls")
        assert listing.returncode == 0, listing.stderr
        header, *rows = listing.stdout.splitlines()
        assert header.split()[:2] == ["MODEL", "STATUS"]
        assert [r.split()[:2] for r in rows] == [["a", "unloaded"], ["b", "unloaded"]]

        loaded = cli(url, "load", "first")
        assert loaded.returncode == 0, loaded.stderr
        assert "loaded in" in loaded.stdout
        models = {m["id"]: m for m in json.loads(cli(url, "ls", "--json").stdout)}
        assert models["a"]["status"]["value"] == "loaded"

        ps = cli(url, "ps")
        assert ps.returncode == 0
        row = ps.stdout.splitlines()[1].split()
        pid = models["a"]["status"]["pid"]
        assert row[0] == "a" and row[1] == "loaded" and row[2] == str(pid)
        ps_json = json.loads(cli(url, "ps", "--json").stdout)
        assert ps_json[0]["pid"] == pid and ps_json[0]["memory"] > 0

        logs = cli(url, "logs", "a", "-n", "500")
        assert logs.returncode == 0 and "model loaded" in logs.stdout

        assert cli(url, "unload", "a").returncode == 0
        assert json.loads(cli(url, "ls", "--json").stdout)[0]["status"]["value"] == "unloaded"

        missing = cli(url, "load", "nope")
        assert missing.returncode == 1
        assert "404" in missing.stderr and "not found" in missing.stderr

        denied = subprocess.run([*CLI, "ls", "--url", url], capture_output=True, text=True,
                                timeout=60, env={"PATH": "/usr/bin"})
        assert denied.returncode == 1 and "401" in denied.stderr


def test_events_and_log_follow(tmp_path: Path, presets: Path) -> None:
    with start_router(tmp_path, "--presets", str(presets), "--api-key", KEY) as router:
        url = router.url
        # The first line is the snapshot: the stream is live, so the load is seen.
        lines = follow(url, "events", until="status=loaded",
                       trigger=lambda: cli(url, "load", "b"))
        assert lines[0].split()[1:3] in (["a", "model_status"], ["b", "model_status"])
        assert any(" b status_change status=loading" in line for line in lines)
        assert " b status_change status=loaded" in lines[-1]

        def chat() -> None:
            with router.client(headers={"Authorization": f"Bearer {KEY}"}) as client:
                client.post("/v1/chat/completions", json={
                    "model": "b", "max_tokens": 2, "messages": [{"role": "user",
                                                                 "content": "x"}]})

        # -n 1 prints one history line after subscribing; then the chat's lines follow.
        lines = follow(url, "logs", "-f", "b", "-n", "1", until="release", trigger=chat)
        assert "release" in lines[-1]
