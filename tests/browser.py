"""Headless Chromium for end-to-end tests of the web UI and the dashboard.

Debian's ``chromium`` (``/usr/bin/chromium``, installed by ``.ci/run``) driven by Playwright's
Python API; Playwright never downloads a browser. A missing browser or Playwright is a failure
under CI and a skip elsewhere, with the reason. ``page`` saves a screenshot of a failed test
into ``$LLAMA_ROUTER_SCREENSHOTS`` (default: the test's tmp dir) and names it in the failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("LLAMA_ROUTER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-dev-shm-usage"]


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI installs it: see .ci/run)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium per test module. Not per session: Playwright's sync API keeps an event
    loop running in the main thread while it is open, and asyncio tests cannot run then."""
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install -e '.[dev]')")
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        _missing(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                             headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture()
def page(browser: Any, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    messages: list[str] = []
    page.on("console", lambda m: messages.append(f"{m.type}: {m.text}"))
    yield page
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        folder = Path(os.environ.get("LLAMA_ROUTER_SCREENSHOTS", tmp_path))
        folder.mkdir(parents=True, exist_ok=True)
        shot = folder / f"{request.node.name}.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"screenshot of the failure: {shot}")
        print("browser console:\n" + "\n".join(messages[-50:]))
    context.close()
