"""Residency on the real llama-server: a pinned model (``pin = true``) that fills
``--models-max`` is never evicted for another model; a request for that other model gets the
503 naming the pin at once, not at the end of its wait budget; an explicit unload of the
pinned model still works, and the other model then loads."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from support import start_router, wait_until, write_presets

pytestmark = pytest.mark.real

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
WAIT_BUDGET_S = 30  # the refused request's: its answer must come long before it ends
REFUSED_WITHIN_S = 5.0


def test_a_pin_filling_models_max_refuses_the_other_model_at_once(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    presets = write_presets(tmp_path / "models.ini", (
        "version = 1\n[*]\nctx-size = 2048\nparallel = 1\n"
        f"[alpha]\nmodel = {tiny_models['alpha']}\npin = true\n"
        f"[beta]\nmodel = {tiny_models['beta']}\nmin-resident = 5\n"))
    with start_router(tmp_path, "--presets", str(presets), "--models-max", "1") as router, \
            router.client() as client:
        response = client.post("/v1/chat/completions", json={"model": "alpha", **CHAT})
        assert response.status_code == 200, response.text
        pid = router.models()["alpha"]["status"]["pid"]

        started = time.monotonic()
        refused = client.post("/v1/chat/completions", json={"model": "beta", **CHAT},
                              headers={"X-Wait-Budget": str(WAIT_BUDGET_S)})
        took = time.monotonic() - started
        assert refused.status_code == 503, refused.text
        assert took < REFUSED_WITHIN_S, f"refused after {took:.1f} s"
        error = refused.json()["error"]
        assert error["type"] == "unavailable_error"
        assert error["message"] == (
            "cannot load 'beta': --models-max 1 is held by pinned models: alpha (pin = "
            "true); unload one with POST /models/unload or raise --models-max"), error

        models = router.models()
        assert models["alpha"]["status"]["value"] == "loaded"
        assert models["alpha"]["status"]["pid"] == pid  # the same child: never evicted
        assert models["alpha"]["pin"] is True and models["beta"]["min_resident"] == 5
        assert "pin" not in models["beta"] and "min_resident" not in models["alpha"]
        assert models["beta"]["status"]["value"] == "unloaded"

        unload = httpx.post(router.url + "/models/unload", json={"model": "alpha"},
                            timeout=30.0)
        assert unload.status_code == 200, unload.text
        response = client.post("/v1/chat/completions", json={"model": "beta", **CHAT})
        assert response.status_code == 200, response.text
        assert router.models()["beta"]["status"]["value"] == "loaded"
        assert wait_until(lambda: router.models()["alpha"]["status"]["value"] == "unloaded",
                          timeout=20.0)


def _loads(router: object) -> int:
    """Loads so far, all models (``llamarouter_model_loads_total``)."""
    with router.client() as client:  # type: ignore[attr-defined]
        text = client.get("/metrics").text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("llamarouter_model_loads_total{")))


def test_min_resident_stops_two_clients_thrashing_two_models(
        tmp_path: Path, tiny_models: dict[str, Path], llama_server: Path) -> None:
    """Two clients, one asking alpha and one beta over and over, under ``--models-max 1``:
    with ``min-resident = 2`` the models swap at most once per two seconds (plus the first
    load), and every request is answered."""
    import threading
    presets = write_presets(tmp_path / "models.ini", (
        "[*]\nctx-size = 256\nparallel = 1\nmin-resident = 2\n"
        f"[alpha]\nmodel = {tiny_models['alpha']}\n"
        f"[beta]\nmodel = {tiny_models['beta']}\n"))
    with start_router(tmp_path, "--presets", str(presets), "--models-max", "1") as router:
        answers: list[int] = []
        started = time.monotonic()

        def client(model: str) -> None:
            with router.client() as c:
                while time.monotonic() - started < 6.0:
                    answers.append(c.post("/v1/chat/completions", json={
                        "model": model, **CHAT}).status_code)

        threads = [threading.Thread(target=client, args=(m,)) for m in ("alpha", "beta")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        elapsed = time.monotonic() - started
        assert answers and set(answers) == {200}, answers
        loads = _loads(router)
        assert 2 <= loads <= elapsed / 2 + 2, (loads, elapsed)
