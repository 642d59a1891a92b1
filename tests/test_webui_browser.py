"""llama.cpp's own web UI, served by the router at ``/``, driven in headless Chromium against
the real llama-server, as a person uses it: the selector lists the models, picking one loads
it ("Model loaded: …", from the ``/models/sse`` events), a message gets a streamed reply, and
picking another under ``--models-max 1`` swaps them and replies again; with ``--state-dir``, a
conversation picked up again after such a swap comes from its restored slot. With
``--api-key``, the UI's own API-key prompt lets the user in."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import start_router, wait_until, write_presets

from router.llama.install import find_webui

pytestmark = pytest.mark.real

SELECTOR = "button[data-dropdown-menu-trigger][aria-haspopup=menu]"
MESSAGE_BOX = "Type a message..."
# The reply of a random-weight model is random text: what matters is that it streams into
# the page as an assistant message with its generation statistics.
REPLY_STATS = r"[\d,]+ tokens(?!/)"


@pytest.fixture(scope="module")
def webui() -> Path:
    """The UI that `make llama-server` builds; missing is a failure under CI."""
    found = find_webui()
    if found is None:
        reason = "llama.cpp's web UI is not built: run `llama-router install-llama-server`"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return found


@pytest.fixture
def presets(tmp_path: Path, tiny_models: dict[str, Path]) -> Path:
    return write_presets(tmp_path / "ui.ini",
                         f"[tiny-chat]\nmodel = {tiny_models['alpha']}\nctx-size = 512\n"
                         f"[tiny-coder]\nmodel = {tiny_models['beta']}\nctx-size = 512\n")


def pick(page: Any, model: str) -> None:
    """Open the model selector and pick ``model``; wait for the UI to say it is loaded."""
    form = page.locator("form").filter(has=page.get_by_placeholder(MESSAGE_BOX))
    form.locator(SELECTOR).filter(has_text=re.compile(r"tiny-|Select model")).click()
    options = page.get_by_role("option")
    options.filter(has_text=model).first.click()
    page.get_by_text(f"Model loaded: {model}").first.wait_for()


def chat(page: Any, text: str, replies_before: int) -> None:
    box = page.get_by_placeholder(MESSAGE_BOX)
    box.fill(text)
    box.press("Enter")
    page.get_by_text(text).first.wait_for()
    # Each finished assistant reply shows its statistics ("N tokens"); the user message's
    # own statistics count too, so wait for two more.
    page.wait_for_function(
        "([pattern, n]) => (document.body.innerText.match(new RegExp(pattern, 'g')) || [])"
        ".length >= n", arg=[REPLY_STATS, replies_before + 2])


def test_the_web_ui_picks_loads_swaps_and_chats_through_the_router(
        tmp_path: Path, presets: Path, webui: Path, llama_server: Path, page: Any) -> None:
    with start_router(tmp_path, "--presets", str(presets), "--models-max", "1") as router:
        seen: list[str] = []
        page.on("request", lambda r: seen.append(f"{r.method} {r.url.split(router.url)[-1]}"))
        page.goto(router.url + "/")
        page.locator(SELECTOR).filter(has_text="tiny-").wait_for()

        pick(page, "tiny-chat")
        assert router.models()["tiny-chat"]["status"]["value"] == "loaded"
        chat(page, "Hello from the first model", 0)

        pick(page, "tiny-coder")  # --models-max 1: the first one makes room
        models = router.models()
        assert models["tiny-coder"]["status"]["value"] == "loaded"
        assert models["tiny-chat"]["status"]["value"] == "unloaded"
        chat(page, "Hello from the second model", 2)

    # What the UI asked of the router, as it asks llama.cpp's router.
    for call in ("GET /props", "GET /models/sse", "GET /v1/models", "POST /models/load",
                 "POST /v1/chat/completions", "POST /v1/streams/lookup"):
        assert any(s.startswith(call) for s in seen), (call, seen)


def test_the_web_ui_asks_for_the_api_key_and_works_with_it(
        tmp_path: Path, presets: Path, webui: Path, llama_server: Path, page: Any) -> None:
    key = "ui-secret-key-1"
    with start_router(tmp_path, "--presets", str(presets), "--api-key", key) as router:
        page.goto(router.url + "/")
        page.get_by_role("button", name="Enter API Key").click()
        prompt = page.get_by_placeholder("Enter your API key...")
        prompt.fill(key)
        prompt.press("Enter")
        pick(page, "tiny-chat")
        chat(page, "Hello with a key", 0)


def test_the_web_ui_on_a_gateway_serves_models_of_other_machines(
        tmp_path: Path, tiny_models: dict[str, Path], webui: Path, llama_server: Path,
        page: Any) -> None:
    """The UI on a gateway in front of two nodes (``--peer``; 127.0.0.2 and 127.0.0.3 stand
    for two machines): it lists both nodes' models, loads each on its node (the load and its
    events go through the gateway) and chats with it."""
    nodes = []
    with contextlib.ExitStack() as stack:
        for host, name, source in (("127.0.0.2", "tiny-chat", "alpha"),
                                   ("127.0.0.3", "tiny-coder", "beta")):
            presets = write_presets(tmp_path / f"{name}.ini", f"[{name}]\nmodel = "
                                    f"{tiny_models[source]}\nctx-size = 512\n")
            nodes.append(stack.enter_context(start_router(
                tmp_path, "--presets", str(presets), "--node-name", f"node-{name}",
                host=host)))
        gateway = stack.enter_context(start_router(
            tmp_path, "--peer", nodes[0].url, "--peer", nodes[1].url))
        assert wait_until(lambda: {"tiny-chat", "tiny-coder"} <= set(gateway.models()), 30)
        page.goto(gateway.url + "/")
        page.locator(SELECTOR).filter(has_text="tiny-").wait_for()
        pick(page, "tiny-chat")
        assert nodes[0].models()["tiny-chat"]["status"]["value"] == "loaded"
        chat(page, "Hello, first machine", 0)
        pick(page, "tiny-coder")
        assert nodes[1].models()["tiny-coder"]["status"]["value"] == "loaded"
        chat(page, "Hello, second machine", 2)


def test_a_conversation_comes_back_warm_after_the_web_ui_swapped_its_model(
        tmp_path: Path, tiny_models: dict[str, Path], webui: Path, llama_server: Path,
        page: Any) -> None:
    """With ``--state-dir``: a conversation on one model, the other model picked and asked
    (the first is evicted, its slot saved), then the first picked again and the conversation
    continued: the next turn's prompt comes from the restored slot (its ``timings``)."""
    states = tmp_path / "states"
    presets = write_presets(tmp_path / "warm.ini",  # short replies: three turns fit
                            "[*]\nctx-size = 2048\nn-predict = 24\n"
                            f"[tiny-chat]\nmodel = {tiny_models['alpha']}\n"
                            f"[tiny-coder]\nmodel = {tiny_models['beta']}\n")
    with start_router(tmp_path, "--presets", str(presets), "--models-max", "1",
                      "--state-dir", str(states)) as router:
        page.goto(router.url + "/")
        page.locator(SELECTOR).filter(has_text="tiny-").wait_for()
        pick(page, "tiny-chat")
        chat(page, "Remember these words: " + " ".join(f"word{i}" for i in range(60)), 0)
        pick(page, "tiny-coder")  # evicts tiny-chat: its slot is saved
        chat(page, "A question for the other model", 2)
        assert router.models()["tiny-chat"]["status"]["states"]["count"] == 1
        pick(page, "tiny-chat")  # loads it again: the slot is restored before it is loaded
        with page.expect_response(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
            chat(page, "And the next turn", 4)
        timings = [json.loads(line[6:]).get("timings") for line in sent.value.text().splitlines()
                   if line.startswith("data: {")]
        last = [t for t in timings if t][-1]
        # The whole conversation goes to tiny-chat; what it said before comes from the cache.
        assert last["cache_n"] >= 60, last
        metrics = httpx.get(router.url + "/metrics").text
        assert 'llamarouter_state_restores_total{model="tiny-chat"} 1.0' in metrics
