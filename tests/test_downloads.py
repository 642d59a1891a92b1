"""Hugging Face models: resolution rules (unit), and downloads through the router against a
local fake of the Hub (tests/fake_hub.py), then served by the real llama-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hub import FakeHub
from support import SSEClient, start_router, wait_until, write_presets

from router.downloads import HfRef, ResolveError, choose_files, file_tag

# --------------------------------------------------------------------------- resolution (unit)

FILES = [("tiny-Q4_K_M.gguf", 10), ("tiny-q8_0.gguf", 20), ("tiny-F16.gguf", 40),
         ("mmproj-tiny-f16.gguf", 5), ("README.md", 1)]


def test_file_tags_follow_llama_cpp() -> None:
    assert file_tag("gemma-3-4b-it-Q4_K_M.gguf") == "Q4_K_M"
    assert file_tag("X-UD-Q4_K_XL.gguf") == "Q4_K_XL"
    assert file_tag("big-Q8_0-00001-of-00003.gguf") == "Q8_0"
    assert file_tag("model.gguf") is None


def test_quant_matching_default_and_case() -> None:
    assert choose_files("o/r", FILES, None).model_files[0].name == "tiny-Q4_K_M.gguf"
    chosen = choose_files("o/r", FILES, "Q8_0")
    assert chosen.model_files[0].name == "tiny-q8_0.gguf" and chosen.id == "o/r:Q8_0"
    assert chosen.mmproj is not None and chosen.mmproj.name == "mmproj-tiny-f16.gguf"
    assert choose_files("o/r", [("only-F32.gguf", 1)], None).model_files[0].name == \
        "only-F32.gguf"
    assert choose_files("o/r", FILES, None, hf_file="tiny-F16.gguf").tag == "F16"


def test_missing_quant_lists_what_exists() -> None:
    with pytest.raises(ResolveError, match="no Q2_K file; available quants: F16, Q4_K_M, Q8_0"):
        choose_files("o/r", FILES, "Q2_K")
    with pytest.raises(ResolveError, match="no GGUF model files"):
        choose_files("o/r", [("README.md", 1)], None)


def test_split_models_bring_every_shard() -> None:
    shards = [(f"big-Q8_0-0000{i}-of-00003.gguf", 100) for i in (1, 2, 3)]
    chosen = choose_files("o/r", [*shards, ("big-Q4_K_M.gguf", 50)], "Q8_0")
    assert [f.name for f in chosen.model_files] == [name for name, _ in shards]
    assert chosen.total_bytes == 300
    with pytest.raises(ResolveError, match="1 of 3 shards but only 2"):
        choose_files("o/r", shards[:2], "Q8_0")


def test_refs() -> None:
    assert HfRef.parse("Owner/Repo:q4_k_m") == HfRef("Owner/Repo", "Q4_K_M")
    assert HfRef.parse("owner/repo").tag is None
    for bad in ("repo-only", "../etc:passwd", "a/b/c"):
        with pytest.raises(ResolveError):
            HfRef.parse(bad)


# --------------------------------------------------------------------------- through the router

@pytest.fixture
def hub(tiny_models: dict[str, Path]) -> Iterator[FakeHub]:
    with FakeHub.running() as hub:
        data = tiny_models["alpha"].read_bytes()
        hub.add_file("test-org/tiny", "tiny-Q8_0.gguf", data)
        hub.add_file("test-org/tiny", "tiny-Q4_K_M.gguf", tiny_models["beta"].read_bytes())
        yield hub


def hub_env(hub: FakeHub, cache: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_HOME": str(cache.parent)}


CHAT = {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.real
def test_hf_repo_preset_downloads_on_first_request(tmp_path: Path, hub: FakeHub,
                                                   llama_server: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    presets = write_presets(tmp_path / "hf.ini", "[tiny]\nhf-repo = test-org/tiny:Q8_0\n"
                            "ctx-size = 512\n")
    with start_router(tmp_path, "--presets", str(presets), env=hub_env(hub, cache)) as router, \
            router.client() as client:
        status = router.models()["tiny"]["status"]
        assert status["value"] == "unloaded" and status["downloaded"] is False
        events = SSEClient(router.url)
        events.start()
        assert events.connected.wait(10)
        reply = client.post("/v1/chat/completions", json={"model": "tiny", **CHAT})
        assert reply.status_code == 200, reply.text
        kinds = [e["event"] for e in events.events if e["model"] == "tiny"]
        assert "download_progress" in kinds and "download_finished" in kinds
        progress = next(e for e in events.events if e["event"] == "download_progress")
        assert progress["data"]["progress"]["tiny-Q8_0.gguf"]["total"] == \
            len(hub.repos["test-org/tiny"].files["tiny-Q8_0.gguf"].read(0, 10**9))
        model_arg = router.models()["tiny"]["status"]["args"]
        path = Path(model_arg[model_arg.index("--model") + 1])
        assert path.is_relative_to(cache) and path.name == "tiny-Q8_0.gguf"
        assert "--hf-repo" not in model_arg  # the router downloads, not the child
        # A preset's model is never deleted through the API, even when it came from the Hub.
        refused = client.delete("/models", params={"model": "tiny"})
        assert refused.status_code == 400 and "comes from preset" in refused.text
        assert path.exists()


@pytest.mark.real
def test_pull_then_router_lists_and_serves_the_cache_model(tmp_path: Path, hub: FakeHub,
                                                           llama_server: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    env = {**os.environ, **hub_env(hub, cache)}
    pulled = subprocess.run([sys.executable, "-m", "router.cli", "pull", "test-org/tiny:q8_0"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert "test-org/tiny:Q8_0: 1 file(s)" in pulled.stderr and "100.0%" in pulled.stderr
    listed = subprocess.run([sys.executable, "-m", "router.cli", "ls", "--cached"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert "test-org/tiny:Q8_0" in listed.stdout
    with start_router(tmp_path, env=hub_env(hub, cache)) as router, router.client() as client:
        model = router.models()["test-org/tiny:Q8_0"]
        assert model["source"] == "cache" and model["can_remove"] is True
        reply = client.post("/v1/chat/completions", json={"model": "test-org/tiny:Q8_0",
                                                          **CHAT})
        assert reply.status_code == 200
        removed = client.delete("/models", params={"model": "test-org/tiny:Q8_0"})
        assert removed.status_code == 200 and removed.json()["freed_bytes"] > 0
        assert "test-org/tiny:Q8_0" not in router.models()
        assert not list(cache.rglob("*.gguf"))


@pytest.mark.real
def test_dedup_cache_models_hides_the_cache_entry_a_preset_uses(tmp_path: Path, hub: FakeHub,
                                                               llama_server: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    env = {**os.environ, **hub_env(hub, cache)}
    for ref in ("test-org/tiny:q8_0", "test-org/tiny:q4_k_m"):
        pulled = subprocess.run([sys.executable, "-m", "router.cli", "pull", ref],
                                capture_output=True, text=True, timeout=120, env=env)
        assert pulled.returncode == 0, pulled.stderr
    text = "[*]\ndedup-cache-models = {on}\n[mine]\nhf-repo = test-org/tiny:Q8_0\n"
    presets = write_presets(tmp_path / "dedup.ini", text.format(on="true"))
    with start_router(tmp_path, "--presets", str(presets), env=hub_env(hub, cache)) as router, \
            router.client() as client:
        listed = set(router.models())
        assert "mine" in listed and "test-org/tiny:Q4_K_M" in listed  # another quant stays
        assert "test-org/tiny:Q8_0" not in listed
        # Hidden, not gone: it still answers by its id.
        reply = client.post("/v1/chat/completions", json={"model": "test-org/tiny:Q8_0", **CHAT})
        assert reply.status_code == 200, reply.text
        presets.write_text(text.format(on="false"))
        assert client.post("/models/reload").status_code == 200
        assert "test-org/tiny:Q8_0" in router.models()


@pytest.mark.real
def test_post_models_validates_downloads_and_cancels(tmp_path: Path, hub: FakeHub,
                                                     llama_server: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    with start_router(tmp_path, env=hub_env(hub, cache)) as router, router.client() as client:
        missing = client.post("/models", json={"model": "test-org/nope:Q8_0"})
        assert missing.status_code == 400
        assert "does not exist" in missing.json()["error"]["message"]
        bad_quant = client.post("/models", json={"model": "test-org/tiny:Q2_K"})
        assert bad_quant.status_code == 400
        assert "available quants: Q4_K_M, Q8_0" in bad_quant.json()["error"]["message"]

        added = client.post("/models", json={"model": "test-org/tiny"})
        assert added.json() == {"success": True, "model": "test-org/tiny:Q4_K_M"}
        assert wait_until(lambda: router.models()["test-org/tiny:Q4_K_M"]["status"]["value"]
                          == "unloaded" and "downloaded" not in
                          router.models()["test-org/tiny:Q4_K_M"]["status"], 30)
        again = client.post("/models", json={"model": "test-org/tiny:Q4_K_M"})
        assert again.status_code == 400 and "already exists" in again.text

        hub.delay_per_chunk(0.2)  # slow: about 1.4 s for the file
        assert client.post("/models", json={"model": "test-org/tiny:Q8_0"}).status_code == 200
        assert wait_until(lambda: router.models()["test-org/tiny:Q8_0"]["status"]["value"]
                          == "downloading", 10)
        assert client.post("/models/unload",
                           json={"model": "test-org/tiny:Q8_0"}).status_code == 200
        assert router.models()["test-org/tiny:Q8_0"]["status"]["value"] == "unloaded"
        assert not [p for p in cache.rglob("tiny-Q8_0.gguf")]
        assert client.delete("/models", params={"model": "nope"}).status_code == 404


@pytest.mark.real
def test_download_survives_a_dropped_connection(tmp_path: Path, hub: FakeHub,
                                                llama_server: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    hub.drop_after("tiny-Q8_0.gguf", 100_000)
    presets = write_presets(tmp_path / "hf.ini", "[tiny]\nhf-repo = test-org/tiny:Q8_0\n")
    with start_router(tmp_path, "--presets", str(presets), env=hub_env(hub, cache)) as router, \
            router.client() as client:
        reply = client.post("/v1/chat/completions", json={"model": "tiny", **CHAT})
        assert reply.status_code == 200, reply.text
        assert len(hub.file_requests("tiny-Q8_0.gguf")) == 2  # dropped once, then completed
        files = list(cache.rglob("tiny-Q8_0.gguf"))
        assert len(files) == 1
        expected = hub.repos["test-org/tiny"].files["tiny-Q8_0.gguf"]
        assert files[0].read_bytes() == expected.read(0, expected.size)


@pytest.mark.fake
def test_pull_of_a_three_shard_model_and_an_mmproj_pair(tmp_path: Path, hub: FakeHub) -> None:
    cache = tmp_path / "hf" / "hub"
    for i in (1, 2, 3):
        hub.add_file("test-org/big", f"big-Q8_0-0000{i}-of-00003.gguf", b"GGUF" + bytes(1000 * i))
    hub.add_file("test-org/vision", "vision-Q4_K_M.gguf", b"GGUF" + bytes(500))
    hub.add_file("test-org/vision", "mmproj-vision-f16.gguf", b"GGUF" + bytes(300))
    env = {**os.environ, **hub_env(hub, cache)}
    for model in ("test-org/big:Q8_0", "test-org/vision"):
        pulled = subprocess.run([sys.executable, "-m", "router.cli", "pull", model],
                                capture_output=True, text=True, timeout=120, env=env)
        assert pulled.returncode == 0, pulled.stderr
    shards = sorted(p.name for p in cache.rglob("big-*.gguf"))
    assert shards == [f"big-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    listed = json.loads(subprocess.run(
        [sys.executable, "-m", "router.cli", "ls", "--cached", "--json"],
        capture_output=True, text=True, timeout=60, env=env).stdout)
    by_id = {m["id"]: m for m in listed}
    assert set(by_id) == {"test-org/big:Q8_0", "test-org/vision:Q4_K_M"}
    assert by_id["test-org/big:Q8_0"]["files"][0].endswith("-00001-of-00003.gguf")
    assert by_id["test-org/big:Q8_0"]["bytes"] == 4 * 3 + 6000
    vision = by_id["test-org/vision:Q4_K_M"]["files"]
    assert vision[0].endswith("vision-Q4_K_M.gguf") and vision[1].endswith("mmproj-vision-f16.gguf")


@pytest.mark.fake
def test_pull_refuses_without_disk_space(tmp_path: Path, hub: FakeHub,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from router import downloads

    resolution = choose_files("test-org/tiny", [("tiny-Q8_0.gguf", 10**12)], "Q8_0")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(downloads.shutil, "disk_usage",
                        lambda path: usage._replace(free=10**9))
    monkeypatch.setattr(downloads, "hub_cache_dir", lambda: tmp_path / "hub")
    monkeypatch.setattr(downloads, "_cached_path", lambda repo, name: None)
    with pytest.raises(ResolveError, match=r"needs 931\.3 GiB, 953\.7 MiB free"):
        downloads.download(resolution, lambda *a: None)


@pytest.mark.real
def test_a_downloaded_mmproj_is_passed_to_the_child(tmp_path: Path, hub: FakeHub,
                                                    llama_server: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    hub.add_file("test-org/vision", "vision-Q4_K_M.gguf", b"GGUF" + bytes(500))
    hub.add_file("test-org/vision", "mmproj-vision-f16.gguf", b"GGUF" + bytes(300))
    with start_router(tmp_path, env=hub_env(hub, cache)) as router, router.client() as client:
        assert client.post("/models", json={"model": "test-org/vision"}).status_code == 200
        assert wait_until(lambda: "downloaded" not in
                          router.models()["test-org/vision:Q4_K_M"]["status"], 30)
        args = router.models()["test-org/vision:Q4_K_M"]["status"]["args"]
        assert Path(args[args.index("--model") + 1]).name == "vision-Q4_K_M.gguf"
        assert Path(args[args.index("--mmproj") + 1]).name == "mmproj-vision-f16.gguf"
