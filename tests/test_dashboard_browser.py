"""The operator dashboard in headless Chromium, against the real router and llama-server.

Everything waits on what the page shows (Playwright's ``expect`` and ``wait_for_function``),
never on fixed sleeps. With ``LLAMA_ROUTER_DASHBOARD_SCREENSHOT=docs/dashboard.png`` the first
test also writes the screenshot used in the README.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import RouterProcess, start_router, write_presets

pytestmark = pytest.mark.real

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
WAIT_MS = 60_000  # two busy cores: generous, and only ever reached when something is broken
SCREENSHOT = os.environ.get("LLAMA_ROUTER_DASHBOARD_SCREENSHOT")

# Records every value a row's data-status takes, in order, from the moment it is installed.
WATCH_STATUS = """model => {
  const row = document.querySelector(`#model-rows tr[data-model="${model}"]`);
  window.seen = [row.dataset.status];
  new MutationObserver(records => {
    for (const r of records) window.seen.push(r.target.dataset.status);
  }).observe(row, {attributes: true, attributeFilter: ['data-status']});
}"""


@pytest.fixture
def presets(tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> Path:
    text = "version = 1\n[*]\nctx-size = 1024\nparallel = 2\n"
    for name in ("alpha", "beta", "gamma"):
        text += f"[{name}]\nmodel = {tiny_models[name]}\n"
    text += "alias = g\n"
    return write_presets(tmp_path / "dash.ini", text)


@pytest.fixture
def router(tmp_path: Path, presets: Path) -> Iterator[RouterProcess]:
    with start_router(tmp_path, "--presets", str(presets)) as router:
        yield router


def expect() -> Any:
    from playwright.sync_api import expect as playwright_expect
    return playwright_expect


def row(page: Any, model: str) -> Any:
    return page.locator(f'#model-rows tr[data-model="{model}"]')


def chat(client: httpx.Client, model: str, stream: bool = False) -> None:
    response = client.post("/v1/chat/completions", json={"model": model, **CHAT,
                                                         "stream": stream})
    assert response.status_code == 200, response.text


def test_live_status_buttons_logs_and_activity(router: RouterProcess, page: Any) -> None:
    check = expect()
    page.goto(router.url + "/dashboard")
    alpha = row(page, "alpha")
    check(alpha).to_have_attribute("data-status", "unloaded", timeout=WAIT_MS)
    check(page.locator("#conn")).to_have_attribute("data-state", "live", timeout=WAIT_MS)
    check(page.locator("#model-rows tr")).to_have_count(3)

    # Load with the row's button: the row goes loading -> loaded as the events arrive.
    page.evaluate(WATCH_STATUS, "alpha")
    alpha.locator('button[data-action="load"]').click()
    check(alpha).to_have_attribute("data-status", "loaded", timeout=WAIT_MS)
    seen = page.evaluate("window.seen")
    assert "loading" in seen and seen.index("loading") < seen.index("loaded"), seen
    check(alpha.locator("td").nth(3)).to_contain_text("pid", timeout=WAIT_MS)
    # A load through the API shows up the same way.
    with router.client() as client:
        assert client.post("/models/load", json={"model": "beta"}).status_code == 200
    check(row(page, "beta")).to_have_attribute("data-status", "loaded", timeout=WAIT_MS)

    # The log pane follows the selected model: its past lines, then new ones as they come.
    alpha.locator("td").first.click()
    check(page.locator("#log-source")).to_have_text("alpha")
    check(page.locator("#log")).to_contain_text("listening on http", timeout=WAIT_MS)
    before = page.locator("#log div", has_text="launch_slot_").count()
    with router.client() as client:
        chat(client, "alpha")
        chat(client, "alpha", stream=True)
        chat(client, "beta")
    page.wait_for_function(
        """n => [...document.querySelectorAll('#log div')]
                 .filter(d => d.textContent.includes('launch_slot_')).length >= n""",
        arg=before + 2, timeout=WAIT_MS)

    # The activity list shows the requests just made, with their token counts.
    chats = page.locator("#activity-rows tr", has_text="/v1/chat/completions")
    check(chats).to_have_count(3, timeout=WAIT_MS)
    check(chats.filter(has_text="alpha")).to_have_count(2)
    for cells in chats.evaluate_all("rows => rows.map(r => [...r.cells].map(c => c.textContent))"):
        assert cells[3] == "200" and cells[7] == "3", cells  # status, tokens
    check(page.locator("#activity-rows tr", has_text="/models/load")).to_have_count(2)
    # Who uses what: the one team of a router without keys, per model.
    used = page.locator("#usage-rows tr", has_text="alpha")
    check(used.locator("td").nth(2)).to_have_text("2", timeout=WAIT_MS)  # requests
    check(used.locator("td").first).to_have_text("anonymous")
    check(used.locator("td").nth(4)).to_have_text("6")  # generated tokens, 3 each
    # Only the selected model's requests, on request.
    page.locator("#activity-only").check()
    check(page.locator("#activity-rows tr:visible", has_text="beta")).to_have_count(0)
    check(page.locator("#activity-rows tr:visible", has_text="/v1/chat")).to_have_count(2)
    page.locator("#activity-only").uncheck()

    if SCREENSHOT:
        take_screenshot(router, page, Path(SCREENSHOT))

    # Unload with the row's button.
    alpha.locator('button[data-action="unload"]').click()
    check(alpha).to_have_attribute("data-status", "unloaded", timeout=WAIT_MS)
    assert router.models()["alpha"]["status"]["value"] == "unloaded"
    assert router.models()["beta"]["status"]["value"] == "loaded"


def take_screenshot(router: RouterProcess, page: Any, path: Path) -> None:
    """Some traffic over a few chart samples, then the picture for the docs."""
    with router.client() as client:
        for n in range(24):
            shown = page.locator("#activity-rows tr").count()
            chat(client, "alpha" if n % 3 else "beta", stream=bool(n % 2))
            page.wait_for_function("n => document.querySelectorAll('#activity-rows tr').length"
                                   " > n", arg=shown, timeout=WAIT_MS)
            page.wait_for_timeout(700)  # spread the traffic over the samples (docs only)
    page.locator("#v-req").wait_for()
    path.parent.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size({"width": 1280, "height": 800})
    page.screenshot(path=str(path))


def test_with_an_api_key_the_page_asks_for_it(tmp_path: Path, presets: Path,
                                               page: Any) -> None:
    check = expect()
    with start_router(tmp_path, "--presets", str(presets), "--api-key", "sesame") as router:
        page.goto(router.url + "/dashboard")  # the page itself is public
        check(page.locator("#key-panel")).to_be_visible(timeout=WAIT_MS)
        check(page.locator("#model-rows tr")).to_have_count(0)
        page.locator("#key-input").fill("wrong")
        page.locator("#key-save").click()
        check(page.locator("#key-message")).to_contain_text("Invalid API Key",
                                                            timeout=WAIT_MS)
        page.locator("#key-input").fill("sesame")
        page.locator("#key-input").press("Enter")
        check(page.locator("#key-panel")).to_be_hidden(timeout=WAIT_MS)
        check(page.locator("#model-rows tr")).to_have_count(3, timeout=WAIT_MS)
        check(page.locator("#conn")).to_have_attribute("data-state", "live", timeout=WAIT_MS)
        # The key works for actions too, and is kept for this tab.
        row(page, "gamma").locator('button[data-action="load"]').click()
        check(row(page, "gamma")).to_have_attribute("data-status", "loaded", timeout=WAIT_MS)
        page.reload()
        check(row(page, "gamma")).to_have_attribute("data-status", "loaded", timeout=WAIT_MS)
        check(page.locator("#key-panel")).to_be_hidden()
        # An error answer is shown as its message.
        row(page, "gamma").locator('button[data-action="unload"]').click()
        check(row(page, "gamma")).to_have_attribute("data-status", "unloaded", timeout=WAIT_MS)
        page.locator("#pull-input").fill("not a repo")
        page.locator("#pull-button").click()
        check(page.locator("#banner")).to_be_visible(timeout=WAIT_MS)
        check(page.locator("#banner-text")).to_contain_text("Pull not a repo:")


def test_five_hundred_models(tmp_path: Path, tiny_models: dict[str, Path],
                             llama_server: Path, page: Any) -> None:
    """Rows are created in batches and updated in place: an event touches one row."""
    check = expect()
    text = "version = 1\n[*]\nctx-size = 1024\n"
    text += "".join(f"[m-{n:03d}]\nmodel = {tiny_models['alpha']}\n" for n in range(500))
    presets = write_presets(tmp_path / "many.ini", text)
    with start_router(tmp_path, "--presets", str(presets)) as router:
        started = time.monotonic()
        page.goto(router.url + "/dashboard")
        check(page.locator("#model-rows tr")).to_have_count(500, timeout=WAIT_MS)
        rendered_s = time.monotonic() - started
        assert rendered_s < 30, f"500 rows took {rendered_s:.1f} s"
        check(page.locator("#model-count")).to_have_text("500 models, 0 loaded")
        page.evaluate("document.querySelectorAll('#model-rows tr')"
                      ".forEach(r => { r.original = true; })")
        with router.client() as client:
            assert client.post("/models/load", json={"model": "m-250"}).status_code == 200
        check(row(page, "m-250")).to_have_attribute("data-status", "loaded", timeout=WAIT_MS)
        check(page.locator("#model-count")).to_have_text("500 models, 1 loaded",
                                                         timeout=WAIT_MS)
        kept = page.evaluate("[...document.querySelectorAll('#model-rows tr')]"
                             ".filter(r => r.original).length")
        assert kept == 500, "rows were rebuilt instead of updated in place"
        page.locator("#filter").fill("m-25")
        check(page.locator("#model-rows tr:visible")).to_have_count(10, timeout=WAIT_MS)
