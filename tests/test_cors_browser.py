"""Pages of other origins in headless Chromium against a keyless router on 127.0.0.1 and the
real llama-server: what a browser really sends (``Origin``, ``Sec-Fetch-Site``, preflights)
meets the router's CORS policy (``cors.py``).

A page served from another local port tries the forgeries a hostile site would: load, unload
and reload with a ``text/plain`` body, a multipart form, a real HTML form post into a hidden
frame, and a JSON load (preflighted). None changes anything, and the router answers each with
a 403 (its activity record shows them). With ``--cors-origins`` naming one page, only that
page can chat (a JSON fetch, so a preflight first) and read the answer; with the default
``*``, any page can chat, as with llama-server, and still change nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from support import RouterProcess, start_router, write_presets

pytestmark = [pytest.mark.real, pytest.mark.process]

PAGE = b"<!doctype html><title>another site</title><body>another site</body>"

# Forgeries a page can send without a preflight ("simple" requests), then a JSON load, which
# needs one. Each result is what the page could learn: "opaque" (sent, unreadable), or
# "blocked" (the browser stopped it).
FORGE = """async (base) => {
  const simple = (path, body, type) => fetch(base + path, {
      method: 'POST', mode: 'no-cors', body,
      headers: type ? {'Content-Type': type} : {}})
    .then(r => r.type, e => 'blocked');
  const form = new FormData();
  form.append('model', 'alpha');
  const out = {
    load: await simple('/models/load', JSON.stringify({model: 'beta'}), 'text/plain'),
    unload: await simple('/models/unload', form),
    reload: await simple('/models/reload', '{}', 'text/plain'),
  };
  out.jsonLoad = await fetch(base + '/models/load', {method: 'POST',
      headers: {'Content-Type': 'application/json'}, body: JSON.stringify({model: 'beta'})})
    .then(r => 'read ' + r.status, e => 'blocked');
  // A real form post, the oldest forgery: text/plain, into a hidden frame.
  const frame = document.createElement('iframe');
  frame.name = 'sink';
  document.body.appendChild(frame);
  const posted = new Promise(resolve => frame.addEventListener('load', resolve));
  const html = document.createElement('form');
  Object.assign(html, {method: 'POST', action: base + '/models/unload', target: 'sink',
                       enctype: 'text/plain'});
  const field = document.createElement('input');
  Object.assign(field, {name: '{"model": "alpha", "x": "', value: '"}'});
  html.appendChild(field);
  document.body.appendChild(html);
  html.submit();
  await posted;
  out.formPost = 'sent';
  return out;
}"""

# What the forgeries leave in the activity record: each with its 403.
FORGERIES = ["POST /models/load", "POST /models/reload", "POST /models/unload",
             "POST /models/unload"]
CHAT = """async (base) => fetch(base + '/v1/chat/completions', {method: 'POST',
    headers: {'Content-Type': 'application/json'},
    body: JSON.stringify({model: 'alpha', max_tokens: 4,
                          messages: [{role: 'user', content: 'hi'}]})})
  .then(async r => 'read ' + r.status + ' ' + (await r.json()).object, e => 'blocked')"""


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def site() -> Iterator[int]:
    """A server of a plain page on a free port of 127.0.0.1: ``http://localhost:PORT`` is
    another site than the router's ``http://127.0.0.1:...``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def presets(tmp_path: Path, tiny_models: dict[str, Path]) -> Path:
    return write_presets(tmp_path / "cors.ini",
                         f"[alpha]\nmodel = {tiny_models['alpha']}\nctx-size = 256\n"
                         f"[beta]\nmodel = {tiny_models['beta']}\nctx-size = 256\n")


def statuses(router: RouterProcess) -> dict[str, str]:
    return {m: str(v["status"]["value"]) for m, v in router.models().items()}  # type: ignore[index]


def refusals(router: RouterProcess) -> list[str]:
    with router.client() as client:
        records = client.get("/activity").json()["requests"]
    return sorted(f"{r['method']} {r['endpoint']}" for r in records if r["status"] == 403)


def forge(page: Any, origin: str, router: RouterProcess) -> dict[str, str]:
    page.goto(origin + "/")
    result: dict[str, str] = page.evaluate(FORGE, router.url)
    return result


def test_a_page_of_another_site_changes_nothing_and_reads_no_chat(
        tmp_path: Path, presets: Path, llama_server: Path, page: Any) -> None:
    with site() as evil, site() as good, \
            start_router(tmp_path, "--presets", str(presets),
                         "--cors-origins", f"http://localhost:{good}") as router:
        with router.client() as client:
            assert client.post("/models/load", params={"wait": "true"},
                               json={"model": "alpha"}).status_code == 200
        for origin in (f"http://localhost:{evil}", f"http://127.0.0.1:{evil}"):  # cross-, same-site
            result = forge(page, origin, router)
            assert result == {"load": "opaque", "unload": "opaque", "reload": "opaque",
                              "jsonLoad": "blocked", "formPost": "sent"}, (origin, result)
            assert page.evaluate(CHAT, router.url) == "blocked"
            assert statuses(router) == {"alpha": "loaded", "beta": "unloaded"}
        # Every forgery reached the router and got its 403; the JSON load's preflight got
        # llama-server's refusal (200, no CORS header: unrecorded), so the load was never sent.
        assert refusals(router) == sorted(2 * FORGERIES), router.log()

        page.goto(f"http://localhost:{good}/")  # the page --cors-origins names
        assert page.evaluate(CHAT, router.url) == "read 200 chat.completion"


def test_by_default_any_page_can_chat_but_changes_nothing(
        tmp_path: Path, presets: Path, llama_server: Path, page: Any) -> None:
    with site() as evil, start_router(tmp_path, "--presets", str(presets)) as router:
        with router.client() as client:
            assert client.post("/models/load", params={"wait": "true"},
                               json={"model": "alpha"}).status_code == 200
        result = forge(page, f"http://localhost:{evil}", router)
        assert result == {"load": "opaque", "unload": "opaque", "reload": "opaque",
                          "jsonLoad": "blocked", "formPost": "sent"}, result
        assert statuses(router) == {"alpha": "loaded", "beta": "unloaded"}
        assert refusals(router) == FORGERIES
        # As with llama-server's default --cors-origins *: inference is open to any page.
        assert page.evaluate(CHAT, router.url) == "read 200 chat.completion"
