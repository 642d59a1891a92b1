"""Hugging Face models: resolution rules (unit), and downloads through the router against a
local fake of the Hub (tests/fake_hub.py), then served by the real llama-server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub
import pytest
from fake_hub import FakeHub, local_only_hf_client
from support import SSEClient, start_router, wait_until, write_presets

from router.config import downloads
from router.config.downloads import (
    DownloadCancelled,
    HfRef,
    Resolution,
    ResolveError,
    choose_files,
    download,
    file_tag,
)

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

    resolution = choose_files("test-org/tiny", [("tiny-Q8_0.gguf", 10**12)], "Q8_0")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(downloads.shutil, "disk_usage",
                        lambda path: usage._replace(free=10**9))
    monkeypatch.setattr(downloads, "hub_cache_dir", lambda: tmp_path / "hub")
    monkeypatch.setattr(downloads, "_cached_path", lambda repo, name, cache=None: None)
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


# --------------------------------------------------------------------------- cancelling
#
# huggingface-hub reads a body in 10 MiB pieces with a 10 s read timeout and retries after
# sleeps: a cancel checked only by its progress bar took as long as the rest of the file, or the
# timeout and a retry on a Hub sending nothing. ``download`` must return within a poll interval.

BIG = "big-Q8_0.gguf"
BIG_DATA = b"GGUF" + bytes(4 * 1024 * 1024 - 4)
CANCEL_BOUND_S = 2.0


@pytest.fixture
def slow_hub(request: pytest.FixtureRequest) -> Iterator[FakeHub]:
    """A hub with a 4 MiB file sent in 16 KiB chunks (the knobs then make it slow); with the
    parameter True, it redirects the file to its "CDN" as the real Hub does."""
    cdn = getattr(request, "param", False)
    with FakeHub.running(chunk_size=16 * 1024, redirect_to_cdn=cdn) as hub, \
            local_only_hf_client():
        hub.add_file("test-org/big", BIG, BIG_DATA)
        yield hub


def big_resolution() -> Resolution:
    return choose_files("test-org/big", [(BIG, len(BIG_DATA))], "Q8_0")


class Download(threading.Thread):
    """``download`` of ``test-org/big`` in a thread, as the loader runs it; ``cancel`` stops it."""

    def __init__(self, hub: FakeHub, cache: Path) -> None:
        super().__init__(daemon=True)
        self.hub, self.cache = hub, cache
        self.cancel = threading.Event()
        self.result: list[Path] | BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = download(big_resolution(), lambda *a: None, self.cancel.is_set,
                                   endpoint=self.hub.url, cache=self.cache)
        except BaseException as exc:
            self.result = exc

    def cancel_and_wait(self) -> float:
        """Cancel; the seconds until ``download`` returned."""
        started = time.monotonic()
        self.cancel.set()
        self.join(30)
        assert not self.is_alive(), "download did not return"
        return time.monotonic() - started


def library_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hf-download:")]


def assert_nothing_left(hub: FakeHub, cache: Path) -> None:
    """The connection is closed, the library's thread gone, no file (partial or not) kept."""
    assert hub.wait_idle(CANCEL_BOUND_S), "the download still holds its connection"
    assert not library_threads()
    assert not [p for p in cache.rglob("*") if p.is_file() and p.parent.name == "blobs"]
    assert not list(cache.rglob(BIG))


@pytest.mark.fake
@pytest.mark.parametrize("slow_hub", [False, True], indirect=True, ids=["hub", "cdn"])
def test_cancel_stops_a_download_from_a_slow_hub(tmp_path: Path, slow_hub: FakeHub) -> None:
    slow_hub.delay_per_chunk(0.05)  # 320 kB/s: the file would take 13 s
    running = Download(slow_hub, tmp_path / "hub")
    assert wait_until(lambda: slow_hub.active_downloads == 1, 10)
    time.sleep(0.3)  # bytes are trickling in
    took = running.cancel_and_wait()
    assert isinstance(running.result, DownloadCancelled), running.result
    assert took < CANCEL_BOUND_S
    assert_nothing_left(slow_hub, tmp_path / "hub")


@pytest.mark.fake
@pytest.mark.parametrize("slow_hub", [False, True], indirect=True, ids=["hub", "cdn"])
def test_cancel_stops_a_download_from_a_stalled_hub(tmp_path: Path, slow_hub: FakeHub) -> None:
    slow_hub.stall_after(BIG, 100_000)  # then nothing, the connection open
    running = Download(slow_hub, tmp_path / "hub")
    assert wait_until(lambda: slow_hub.active_downloads == 1, 10)
    time.sleep(0.3)  # the library's read is blocked
    took = running.cancel_and_wait()
    assert isinstance(running.result, DownloadCancelled), running.result
    assert took < CANCEL_BOUND_S
    assert_nothing_left(slow_hub, tmp_path / "hub")
    assert len(slow_hub.file_requests(BIG)) == 1  # no resume attempt after the cancel


@pytest.mark.fake
def test_cancel_returns_even_while_the_library_cannot_be_interrupted(
        tmp_path: Path, slow_hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sleep before a retry, a Xet download, a lock held by another process: ``download``
    returns anyway, and the library's thread (a daemon) ends when the call does."""
    release = threading.Event()

    def stuck(*args: object, **kwargs: object) -> str:
        release.wait(30)
        raise OSError("released")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", stuck)
    running = Download(slow_hub, tmp_path / "hub")
    time.sleep(0.3)
    try:
        took = running.cancel_and_wait()
        assert isinstance(running.result, DownloadCancelled), running.result
        assert took < CANCEL_BOUND_S
    finally:
        release.set()
    assert wait_until(lambda: not library_threads(), 5)


@pytest.mark.fake
def test_an_uncancelled_download_is_whole_and_watched(tmp_path: Path,
                                                      slow_hub: FakeHub) -> None:
    seen: list[int] = []
    paths = download(big_resolution(), lambda name, done, total: seen.append(done),
                     endpoint=slow_hub.url, cache=tmp_path / "hub")
    assert paths[0].read_bytes() == BIG_DATA and paths[0].is_relative_to(tmp_path / "hub")
    assert seen[0] == 0 and seen[-1] == len(BIG_DATA)
    # What cancelling relies on in huggingface-hub: one shared httpx2 client (get_session) that
    # keeps the hooks, bodies read through it, each response's socket at hand.
    hooks = huggingface_hub.get_session().event_hooks
    assert downloads._on_request in hooks["request"]
    assert downloads._on_response in hooks["response"]
    with huggingface_hub.get_session().stream("GET", slow_hub.url + "/test-org/big/resolve/"
                                              "main/" + BIG) as response:
        sock = response.extensions["network_stream"].get_extra_info("socket")
        assert sock is not None and sock.fileno() >= 0
    assert not library_threads()


@pytest.mark.real
def test_unload_and_shutdown_stop_a_stalled_download(tmp_path: Path, hub: FakeHub,
                                                     llama_server: Path) -> None:
    cache = tmp_path / "hf" / "hub"
    model = "test-org/tiny:Q8_0"
    hub.stall_after("tiny-Q8_0.gguf", 100_000, times=2)
    with start_router(tmp_path, "--shutdown-grace", "5", env=hub_env(hub, cache)) as router, \
            router.client() as client:
        events = SSEClient(router.url)
        events.start()
        assert events.connected.wait(10)
        assert client.post("/models", json={"model": model}).status_code == 200
        assert wait_until(lambda: hub.active_downloads == 1, 10)
        assert router.models()[model]["status"]["value"] == "downloading"
        started = time.monotonic()
        assert client.post("/models/unload", json={"model": model}).status_code == 200
        assert time.monotonic() - started < 3
        assert router.models()[model]["status"]["value"] == "unloaded"
        assert hub.wait_idle(3)  # the router's download thread let go of the connection
        assert wait_until(lambda: any(
            e["model"] == model and e["event"] == "status_change"
            and e["data"].get("reason") == "cancelled" for e in events.events), 5)
        assert not [p for p in cache.rglob("*") if p.is_file() and p.parent.name == "blobs"]

        # Stalled again, and the router is told to stop: it exits well within its grace.
        assert client.post("/models/load", json={"model": model}).status_code == 200
        assert wait_until(lambda: hub.active_downloads == 1, 10)
        started = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)
        assert router.proc.wait(30) == 0
        assert time.monotonic() - started < 4, router.log()
    assert hub.wait_idle(3)
    assert not list(cache.rglob("tiny-Q8_0.gguf"))
