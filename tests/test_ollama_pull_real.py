"""Ollama's pull and delete with the official client, through the router's Hugging Face
download (from tests/fake_hub.py): progress lines as the file arrives, the model listed and
served under the name pulled, then deleted from the cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest
from fake_hub import FakeHub
from support import start_router

pytestmark = pytest.mark.real

NAME = "test-org/tiny:Q8_0"


@pytest.fixture
def hub(tiny_models: dict[str, Path]) -> Iterator[FakeHub]:
    with FakeHub.running() as hub:
        hub.add_file("test-org/tiny", "tiny-Q8_0.gguf", tiny_models["alpha"].read_bytes())
        yield hub


def test_pull_chat_and_delete_with_the_ollama_client(tmp_path: Path, hub: FakeHub,
                                                     llama_server: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent)}
    with start_router(tmp_path, env=env) as router, \
            ollama.Client(host=router.url, timeout=60) as api:
        lines = list(api.pull(NAME, stream=True))
        statuses = [line.status for line in lines]
        assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
        progress = [line for line in lines if (line.status or "").startswith("pulling tiny")]
        assert progress and progress[-1].completed == progress[-1].total > 0
        assert NAME in [m.model for m in api.list().models]
        answer = api.chat(NAME, messages=[{"role": "user", "content": "hi"}],
                          options={"num_predict": 2})
        assert answer.done and answer.eval_count
        assert api.pull(NAME).status == "success"  # here already: at once
        api.delete(NAME)
        assert NAME not in [m.model for m in api.list().models]
        assert not list(cache.rglob("*.gguf"))
        with pytest.raises(ollama.ResponseError) as missing:
            api.pull("test-org/absent:Q8_0")
        assert missing.value.status_code in (400, 404) and missing.value.error
