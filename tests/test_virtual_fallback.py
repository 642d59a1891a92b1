"""A virtual model's ``choose = fallback`` past its target's load: a target whose child dies,
or answers 503, before the first byte of its answer is passed over for the next target, and
the client gets the next target's answer, on every endpoint family and streamed or not. A
target that answered is never retried (nothing is sent twice); a virtual model that does not
fall back relays the failure as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import fake_binary, start_router, write_presets

pytestmark = pytest.mark.fake

PRESETS = """\
[dies]
model = {model}
crash-on-request = true
[busy]
model = {model}
unavailable = true
[good]
model = {model}
[safe]
targets = dies, busy, good
choose = fallback
[warm-only]
targets = busy, good
"""

REQUESTS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
    ("/completion", {"prompt": "hi", "n_predict": 3}),
]


def test_fallback_passes_over_a_target_that_fails_before_its_first_byte(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 64)
    presets = write_presets(tmp_path / "v.ini", PRESETS.format(model=model))
    binary = fake_binary(tmp_path)
    with start_router(tmp_path, "--llama-server", str(binary), "--presets", str(presets),
                      "--models-max", "3") as router, router.client() as client:
        for path, body in REQUESTS:
            for stream in (False, True):
                answer = client.post(path, json={"model": "safe", "stream": stream, **body})
                assert answer.status_code == 200, (path, stream, answer.text)
                assert "tok0" in answer.text
        listed = router.models()
        assert listed["safe"]["last_target"] == "good"
        assert "failed before answering" in router.log()

        # Without fallback, the target's 503 is the client's answer, relayed as the child sent
        # it: from the model itself, and from a virtual model that chooses the warm target.
        for name in ("busy", "warm-only"):
            refused = client.post("/completion", json={"model": name, "prompt": "hi"})
            assert refused.status_code == 503, (name, refused.text)
            assert refused.json()["error"]["message"] == "Loading model"
        assert router.models()["warm-only"]["last_target"] == "busy"
