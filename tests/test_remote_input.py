"""What a remote upstream is sent: its key, checked when the configuration is read (at start
and at reload), and ``upstream-model`` renaming the model of multipart requests as of JSON ones.

* in process: the key file's checks, ``for_remote`` on a multipart body;
* a router process in front of a stand-in upstream that records what it receives;
* real: a router whose remote upstream is a second router serving a real llama-server, which
  routes the multipart request by the renamed field.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from support import http_server, start_router, write_presets

from router.config.presets import PresetsInvalid
from router.config.sources import build_catalogue
from router.http.proxy import for_remote
from router.llama.flags import FlagTable

SECRET = "sk-remote-0123456789"
BOUNDARY = "----routerRenameBoundary"
CONTENT_TYPE = f"multipart/form-data; boundary={BOUNDARY}"
GUARD_S = 60.0


def multipart(model: str, audio: bytes = b"RIFF\x00\x01\xff\xfe wave bytes") -> bytes:
    return (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n").encode() + audio + (
            f'\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{model}'
            f'\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name="language"\r\n\r\nen'
            f"\r\n--{BOUNDARY}--\r\n").encode()


# ----------------------------------------------------------------------------- upstream keys

BAD_KEYS = {
    "non-latin-1": f"{SECRET}\u20ac",
    "latin-1 but not ASCII": f"{SECRET}\u00e9",
    "a control character": f"{SECRET}\x01x",
    "DEL": f"{SECRET}\x7f",
    "NUL": f"{SECRET}\x00",
}


@pytest.mark.parametrize("key", BAD_KEYS.values(), ids=BAD_KEYS.keys())
def test_a_key_no_header_can_carry_is_refused_when_read(
        tmp_path: Path, help_table: FlagTable, key: str) -> None:
    (tmp_path / "remote.key").write_text(f"# the key for box2\n\n{key}\n", encoding="utf-8")
    presets = write_presets(tmp_path / "models.ini",
                            "[far]\nupstream = http://box:1\nupstream-api-key-file = remote.key\n")
    with pytest.raises(PresetsInvalid) as info:
        build_catalogue([presets], [], help_table, hf_cache=False)
    [problem] = [str(p) for p in info.value.problems]
    assert problem.startswith(f"{presets}:3: [far] upstream-api-key-file: the key in "
                              f"{tmp_path / 'remote.key'} (line 3) cannot be sent in an HTTP "
                              "header: character 21 is not printable ASCII"), problem
    assert SECRET not in problem


def test_a_printable_key_with_inner_spaces_is_kept(tmp_path: Path,
                                                   help_table: FlagTable) -> None:
    (tmp_path / "remote.key").write_text("  sk-a b~!  \n")
    presets = write_presets(tmp_path / "models.ini",
                            "[far]\nupstream = http://box:1\nupstream-api-key-file = remote.key\n")
    catalogue = build_catalogue([presets], [], help_table, hf_cache=False)
    assert catalogue.models["far"].upstream_key == "sk-a b~!"


# ----------------------------------------------------------------------------- multipart rename

def test_for_remote_renames_the_multipart_model_field() -> None:
    headers = [(b"content-type", CONTENT_TYPE.encode())]
    out_headers, body = for_remote(headers, multipart("far"), None, "sk", "served-name",
                                   CONTENT_TYPE.encode())
    assert body == multipart("served-name")
    assert out_headers[-1] == (b"authorization", b"Bearer sk")
    # Without upstream-model, or for another content type, the bytes are left alone.
    assert for_remote(headers, multipart("far"), None, None, None,
                      CONTENT_TYPE.encode())[1] == multipart("far")
    assert for_remote(headers, b"far", None, None, "x", b"text/plain")[1] == b"far"


class Recorder(BaseHTTPRequestHandler):
    """A stand-in remote upstream: healthy, and records every POST it gets."""

    seen: list[dict[str, Any]]

    def do_GET(self) -> None:
        self._answer({"data": [{"id": "served-name"}]} if self.path == "/v1/models" else {})

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.seen.append({"path": self.path, "headers": dict(self.headers.items()),
                          "body": body})
        self._answer({"text": "transcribed"})

    def _answer(self, payload: object) -> None:
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def recorder() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    with http_server(type("Handler", (Recorder,), {"seen": seen}), GUARD_S) as url:
        yield url, seen


@pytest.mark.process
def test_a_multipart_request_to_a_remote_gets_the_upstream_model(tmp_path: Path) -> None:
    (tmp_path / "remote.key").write_text(f"{SECRET}\n")
    with recorder() as (url, seen):
        presets = write_presets(tmp_path / "models.ini", (
            f"[far]\nupstream = {url}\nupstream-model = served-name\n"
            "upstream-api-key-file = remote.key\n"
            f"[plain]\nupstream = {url}\n"))
        with start_router(tmp_path, "--presets", str(presets)) as router, \
                router.client() as client:
            for model, expected in (("far", "served-name"), ("plain", "plain")):
                sent = multipart(model)
                answer = client.post("/v1/audio/transcriptions", content=sent,
                                     headers={"content-type": CONTENT_TYPE})
                assert answer.status_code == 200, answer.text
                got = seen[-1]
                assert got["path"] == "/v1/audio/transcriptions"
                assert got["body"] == multipart(expected)  # only the field's value changed
                assert got["headers"]["content-type"] == CONTENT_TYPE
            assert seen[0]["headers"]["authorization"] == f"Bearer {SECRET}"
            # JSON as before.
            answer = client.post("/v1/chat/completions", json={"model": "far", "messages": []})
            assert answer.status_code == 200, answer.text
            assert json.loads(seen[-1]["body"])["model"] == "served-name"


@pytest.mark.process
def test_a_bad_upstream_key_stops_the_start_and_a_reload(tmp_path: Path) -> None:
    key_file = tmp_path / "remote.key"
    key_file.write_text(f"{SECRET}\u20ac\n", encoding="utf-8")
    presets = write_presets(tmp_path / "models.ini",
                            "[far]\nupstream = http://127.0.0.1:9\n"
                            "upstream-api-key-file = remote.key\n")
    result = subprocess.run([sys.executable, "-m", "router.cli", "serve", "--port", "0",
                             "--presets", str(presets)],
                            capture_output=True, text=True, timeout=GUARD_S)
    assert result.returncode == 2, result.stderr
    assert (f"{presets}:3: [far] upstream-api-key-file: the key in {key_file} (line 1) cannot "
            "be sent in an HTTP header") in result.stderr
    assert SECRET not in result.stderr + result.stdout
    assert "Traceback" not in result.stderr

    key_file.write_text(f"{SECRET}\n")
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client:
        key_file.write_text(f"{SECRET}\x01\n")
        answer = client.post("/models/reload")
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert "models.ini:3: [far] upstream-api-key-file: the key in" in message
        assert "(line 1) cannot be sent in an HTTP header" in message
        assert SECRET not in message + router.log()
        assert "far" in router.models()  # the previous configuration serves on


# ----------------------------------------------------------------------------- real

@pytest.mark.real
def test_the_renamed_multipart_field_routes_at_a_router_upstream(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """Router A's ``far`` is router B's ``alpha`` (a real llama-server child): a multipart
    request for ``far`` reaches B as ``alpha``, B routes it by that field to its child, and the
    child's own answer comes back (without the rename, B would answer 404 for ``far``)."""
    back = write_presets(tmp_path / "back.ini",
                         f"[alpha]\nmodel = {tiny_models['alpha']}\nctx-size = 512\n")
    with start_router(tmp_path, "--presets", str(back)) as b:
        front = write_presets(tmp_path / "front.ini",
                              f"[far]\nupstream = {b.url}\nupstream-model = alpha\n")
        with start_router(tmp_path, "--presets", str(front)) as a, a.client() as client:
            answer = client.post("/v1/audio/transcriptions", content=multipart("far"),
                                 headers={"content-type": CONTENT_TYPE})
            # llama-server's own answer (this model has no audio), not a router's 404.
            assert answer.status_code != 404, answer.text
            assert "not found" not in answer.text
            with b.client() as b_client:
                records = b_client.get("/activity").json()["requests"]
                assert b_client.get("/models").json()["data"][0]["status"]["value"] == "loaded"
            assert [(r["model"], r["endpoint"]) for r in records] == [
                ("alpha", "/v1/audio/transcriptions")], records
            print(f"llama-server answered {answer.status_code}: {answer.text[:200]}")


@pytest.mark.process
def test_an_upstream_that_never_sends_its_head_is_a_504_after_the_upstream_timeout(
        tmp_path: Path) -> None:
    """A remote that is healthy but holds a request without answering: the request ends
    with a 504 envelope naming it after ``--upstream-timeout`` (it waited for ever)."""
    release = threading.Event()

    class Holder(Recorder):
        def do_POST(self) -> None:
            release.wait(GUARD_S)  # never answers within the test

    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (Holder,), {"seen": []}))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        presets = write_presets(tmp_path / "models.ini", f"[far]\nupstream = {url}\n")
        with start_router(tmp_path, "--presets", str(presets), "--upstream-timeout", "1") \
                as router, router.client() as client:
            answer = client.post("/v1/chat/completions", json={"model": "far", "messages": []})
            assert answer.status_code == 504, answer.text
            assert answer.json()["error"]["message"] == (
                f"upstream {url} sent no response head within 1 s")
            assert client.get("/health").status_code == 200
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(GUARD_S)
