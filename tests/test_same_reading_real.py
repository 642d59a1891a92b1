"""The router and the real llama-server read one request alike (red-team pass 5): for a
corpus of hostile spellings of paths, queries and form bodies, what the router decided on is
what a real child and a real llama.cpp router peer acted on, or the router refused it.

* paths: each spelling sent through the router gets the answer a plain llama-server gives to
  the path the router decoded (``%73lots`` is ``/slots`` for both); ``%uXXXX``, bytes that
  are no UTF-8 and control characters are a 400 envelope; a key without the admin role never
  reaches a child's ``/slots`` by any spelling;
* form bodies, which llama-server folds into the request's parameters over the query: JSON
  sent with a form's media type (``curl -d``) goes on as ``application/json``, any other
  is refused (400 on a POST, whose body must be JSON, 415 on a GET): no slot file is ever
  written into the router's state directory by one;
* queries: a key scoped to ``alpha`` asks a llama.cpp router peer for ``/props`` with every
  spelling of ``model`` (repeats, encoded names, ``%u``, a form body): the peer serves
  ``alpha`` or nothing, and never loads ``beta``.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote, unquote

import httpx
import pytest

from router.children.process import free_port
from tests.hostile import exchange, judge, request
from tests.support import llama_server_process, start_router, wait_until, write_presets

pytestmark = pytest.mark.real

ADMIN, INFER = "sk-admin-5e1f", "sk-infer-0b7a"
GUARD_S = 60.0  # a hang guard, never a measurement
# Spellings of paths under the router's and llama-server's two readings (and plain ones).
PATHS = ["/slots", "/%73lots", "/sl%6Fts", "/SLOTS", "/%2Fslots", "/slots%2F", "/props",
         "/pr%6fps", "/%u0073lots", "/sl%u006Fts", "/%U0073lots", "/%u006detrics",
         "/sl%FFots", "/slots%00", "/nope", "/%25u0073lots"]


def ask(port: int, method: str, target: str, key: str | None = None,
        headers: dict[str, str] | None = None, body: bytes = b"") -> tuple[int, bytes]:
    """One request with exactly this target (no client library re-encodes it)."""
    sent = dict(headers or {})
    if key:
        sent["Authorization"] = f"Bearer {key}"
    result = exchange(port, request(method, target, headers=sent, body=body), guard=GUARD_S)
    assert not result.hung and result.answers, f"no answer to {method} {target}"
    answer = result.answers[0]
    if answer.status >= 400 and answer.headers.get(b"content-type", b"").startswith(
            b"application/json"):
        assert judge(answer) is None or answer.status >= 500, (target, answer)
    return answer.status, answer.body


@pytest.fixture
def presets(tmp_path: Path, tiny_models: dict[str, Path]) -> Path:
    return write_presets(tmp_path / "models.ini", f"""
[*]
ctx-size = 512
[alpha]
model = {tiny_models['alpha']}
""")


def test_a_child_reads_every_path_as_the_router_decided(
        tmp_path: Path, presets: Path, tiny_models: dict[str, Path], llama_server: Path
        ) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{INFER} role=infer\n")
    port = free_port("127.0.0.1")
    with start_router(tmp_path, "--presets", str(presets), "--api-key", ADMIN,
                      "--api-key-file", str(keys), "--state-dir", str(tmp_path / "state"),
                      "--no-webui") as router, \
            llama_server_process([str(llama_server), "--host", "127.0.0.1", "--port",
                                  str(port), "-m", str(tiny_models["alpha"]), "-c", "512"],
                                 port, tmp_path / "oracle.log"):
        refused = []
        for path in PATHS:
            status, body = ask(router.port, "GET", f"{path}?model=alpha", ADMIN)
            if status == 400 and (b"request target" in body or b"request path" in body):
                refused.append(path)
                continue
            decided = quote(unquote(path), safe="/")  # the path the router read, encoded
            oracle, _ = ask(port, "GET", f"{decided}?model=alpha")
            assert status == oracle, (path, status, body[:200])
            infer, infer_body = ask(router.port, "GET", f"{path}?model=alpha", INFER)
            if unquote(path).startswith("/slots"):
                assert infer == 403, (path, infer, infer_body[:200])  # the admin role
        assert refused == ["/%u0073lots", "/sl%u006Fts", "/%U0073lots", "/%u006detrics",
                           "/sl%FFots", "/slots%00"], router.log()
        for path in ("/%u0073lots", "/sl%u006Fts"):  # what the attack read as /slots
            status, _ = ask(router.port, "GET", f"{path}?model=alpha", INFER)
            assert status == 400


def test_no_form_body_or_spelling_writes_a_slot_file(
        tmp_path: Path, presets: Path) -> None:
    state = tmp_path / "state"
    with start_router(tmp_path, "--presets", str(presets), "--api-key", ADMIN,
                      "--state-dir", str(state), "--no-webui") as router:
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        attempts = [
            ("/slots/0?action=erase&model=alpha", form, b"action=save&filename=planted1.bin"),
            ("/slots/0?action=erase&model=alpha",
             {"Content-Type": "Application/X-WWW-Form-Urlencoded; charset=utf-8"},
             b"action=save&filename=planted2.bin"),
            # valid JSON that cpp-httplib still splits on '&': the folded action=save wins
            # over the query's erase, and llama-server reads the filename from the JSON
            ("/slots/0?action=erase", form,
             b'{"model": "alpha", "filename": "planted3.bin", "x": "&action=save&"}'),
            ("/slots/0", form,
             b'{"model": "alpha", "filename": "planted3b.bin", "x": "&action=save&"}'),
            ("/%u0073lots/0?action=save&filename=planted4.bin&model=alpha", {}, b""),
            ("/slots/0?action=erase&action=save&filename=planted5.bin&model=alpha", {}, b""),
            ("/slots/0?action=sa%76e&filename=planted6.bin&model=alpha", {}, b""),
        ]
        statuses = [ask(router.port, "POST", target, ADMIN, headers, body)[0]
                    for target, headers, body in attempts]
        # a form that is no JSON: 400 (a POST's body is read as JSON); the JSON one is
        # forwarded as application/json, so the child erases and saves nothing
        assert statuses == [400, 400, 200, 400, 400, 403, 403], router.log()
        # a form body on a GET (not read as JSON): refused
        status, body = ask(router.port, "GET", "/slots?model=alpha", ADMIN, form,
                           b"action=save&filename=planted7.bin")
        assert status == 415, body
        planted = [p for p in tmp_path.rglob("planted*")]
        assert planted == [], planted


def test_a_peer_serves_the_model_the_router_decided_by_every_spelling(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """A key scoped to alpha, through a gateway, in front of llama.cpp's router holding alpha
    and beta: whatever the spelling, the peer serves alpha's props or nothing at all."""
    peer_presets = write_presets(tmp_path / "peer.ini", f"""
[alpha]
model = {tiny_models['alpha']}
ctx-size = 512
[beta]
model = {tiny_models['beta']}
ctx-size = 512
""")
    keys = tmp_path / "keys"
    keys.write_text(f"{INFER} models=alpha role=infer\n")
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    queries = ["model=alpha", "model=alph%61", "model=beta&model=alpha",
               "model=alpha&model=beta", "%6dodel=beta&model=alpha", "model=alpha&%6dodel=beta",
               "model=%u0062eta", "model=alpha&=beta", "model=alpha&model%00=beta",
               "model=be%74a", "model=alpha&mod%65l=beta"]
    with llama_server_process([str(llama_server), "--host", "127.0.0.1", "--port", str(port),
                               "--models-preset", str(peer_presets), "--models-max", "2"],
                              port, tmp_path / "cpp-router.log",
                              env={"LLAMA_CACHE": str(cache)}), \
            start_router(tmp_path, "--peer", url, "--api-key", ADMIN, "--api-key-file",
                         str(keys), "--no-webui") as gateway:
        def peer_models() -> dict[str, object]:
            with gateway.client(headers={"Authorization": f"Bearer {ADMIN}"}) as client:
                return {m["id"]: m for m in client.get("/models").json()["data"]}
        assert wait_until(lambda: "beta" in peer_models(), GUARD_S), gateway.log()
        served = {}
        for query in queries:
            status, body = ask(gateway.port, "GET", f"/props?{query}", INFER)
            if status == 200:
                served[query] = httpx.Response(200, content=body).json()["model_path"]
            else:
                assert status in (400, 404), (query, status, body[:200])
        for form_body in (b"model=beta", b"model=alpha&model=beta"):
            status, body = ask(gateway.port, "GET", "/props?model=alpha", INFER,
                               {"Content-Type": "application/x-www-form-urlencoded"},
                               form_body)
            assert status == 415, body
        assert served.get("model=alpha") == str(tiny_models["alpha"])  # the control
        assert set(served.values()) == {str(tiny_models["alpha"])}, served
        assert "model=beta&model=alpha" in served  # the router read alpha: so did the peer
        with httpx.Client(base_url=url, timeout=GUARD_S) as direct:
            beta = next(m for m in direct.get("/models").json()["data"] if m["id"] == "beta")
        assert beta["status"]["value"] == "unloaded", beta
