"""tests/fake_hub.py driven by the real huggingface_hub client, offline.

huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_DISABLE_XET once, at import, so
setting them here with monkeypatch does not reach the library already imported: these tests pass
``endpoint=`` and ``cache_dir=`` explicitly and patch ``constants.HF_HUB_DISABLE_XET``;
``test_hf_endpoint_env_in_a_fresh_process`` shows the variables work in a new process.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import httpx2
import pytest
from fake_hub import FakeHub, local_only_hf_client
from huggingface_hub import (
    HfApi,
    constants,
    file_download,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    scan_cache_dir,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

pytestmark = pytest.mark.fake

FAKE_HUB = Path(__file__).with_name("fake_hub.py")
REPO = "test-org/tiny"
GGUF = "tiny-Q8_0.gguf"


def gguf_bytes(size: int, seed: int = 0) -> bytes:
    return b"GGUF" + random.Random(seed).randbytes(size - 4)


DATA = gguf_bytes(300_000)
OTHER = gguf_bytes(200_000, seed=1)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "hub"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, cache: Path) -> Iterator[FakeHub]:
    with FakeHub.running() as hub, local_only_hf_client():
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # read at import
        hub.add_file(REPO, GGUF, DATA)
        hub.add_file(REPO, "tiny-Q4_K_M.gguf", OTHER)
        hub.add_file(REPO, "README.md", b"# tiny\n")
        hub.add_file(REPO, "extra/nested/notes.txt", b"notes\n")
        yield hub


@pytest.fixture
def no_retry_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """http_get sleeps 1 s before each resume attempt; skip it (its only use of `time`)."""
    monkeypatch.setattr(file_download, "time", SimpleNamespace(sleep=lambda _s: None))


def download(hub: FakeHub, cache: Path, filename: str = GGUF,
             revision: str | None = None) -> Path:
    return Path(hf_hub_download(REPO, filename, revision=revision, endpoint=hub.url,
                                cache_dir=cache))


def test_model_info_lists_files_with_sizes(hub: FakeHub) -> None:
    api = HfApi(endpoint=hub.url)
    info = api.model_info(REPO, files_metadata=True)
    assert info.id == REPO
    assert info.sha == hub.repos[REPO].sha and len(info.sha) == 40
    assert info.tags == ["gguf"]
    assert info.siblings is not None
    files = {s.rfilename: s for s in info.siblings}
    assert sorted(files) == ["README.md", "extra/nested/notes.txt", "tiny-Q4_K_M.gguf", GGUF]
    assert files[GGUF].size == len(DATA)
    lfs = files[GGUF].lfs
    assert lfs is not None
    assert lfs.sha256 == hub.repos[REPO].files[GGUF].sha256
    assert lfs.size == len(DATA)

    plain = api.model_info(REPO)  # without files_metadata: names only, as on the Hub
    assert plain.siblings is not None and {s.size for s in plain.siblings} == {None}
    assert api.model_info(REPO, revision="main").sha == info.sha
    assert ("GET", f"/api/models/{REPO}/revision/main", None) in hub.requests


def test_list_repo_files_and_tree(hub: FakeHub) -> None:
    api = HfApi(endpoint=hub.url)
    assert api.list_repo_files(REPO) == [
        "README.md", "extra/nested/notes.txt", "tiny-Q4_K_M.gguf", GGUF]
    top = {e.path: type(e).__name__ for e in api.list_repo_tree(REPO)}
    assert top == {"README.md": "RepoFile", "extra": "RepoFolder",
                   "tiny-Q4_K_M.gguf": "RepoFile", GGUF: "RepoFile"}
    assert [e.path for e in api.list_repo_tree(REPO, "extra", recursive=True)] == [
        "extra/nested", "extra/nested/notes.txt"]
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree(REPO, "nope"))
    assert ("GET", f"/api/models/{REPO}/tree/main", None) in hub.requests


def test_file_metadata_is_lfs_style(hub: FakeHub) -> None:
    meta = get_hf_file_metadata(hf_hub_url(REPO, GGUF, endpoint=hub.url))
    entry = hub.repos[REPO].files[GGUF]
    assert meta.etag == entry.sha256
    assert meta.size == len(DATA)
    assert meta.commit_hash == hub.repos[REPO].sha
    assert meta.xet_file_data is None
    with httpx.Client() as client:
        head = client.head(f"{hub.url}/{REPO}/resolve/main/{GGUF}")
    assert head.headers["etag"] == f'"{entry.sha256}"'
    assert head.headers["x-linked-etag"] == f'"{entry.sha256}"'
    assert head.headers["x-linked-size"] == head.headers["content-length"] == str(len(DATA))
    assert not [h for h in head.headers if h.lower().startswith("x-xet")]


def test_download_then_cache_hit(hub: FakeHub, cache: Path) -> None:
    path = download(hub, cache)
    sha = hub.repos[REPO].sha
    assert path == cache / "models--test-org--tiny" / "snapshots" / sha / GGUF
    assert path.read_bytes() == DATA
    assert hub.file_requests(GGUF) == [None]

    assert download(hub, cache) == path
    assert hub.file_requests(GGUF) == [None]  # no second GET ...
    assert len(hub.file_requests(GGUF, "HEAD")) == 2  # ... only a HEAD to check "main"

    assert download(hub, cache, revision=sha) == path  # pinned and cached: no request at all
    assert len(hub.file_requests(GGUF, "HEAD")) == 2


def test_interrupted_download_resumes_with_range(
        hub: FakeHub, cache: Path, monkeypatch: pytest.MonkeyPatch,
        no_retry_sleep: None) -> None:
    # http_get writes (and so resumes) only whole DOWNLOAD_CHUNK_SIZE chunks: shrink them.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    hub.drop_after(GGUF, 100_000)
    assert download(hub, cache).read_bytes() == DATA  # http_get retries inside the call
    assert hub.file_requests(GGUF) == [None, f"bytes={64 * 1024}-"]


def test_resume_granularity_is_the_10_mib_download_chunk(
        hub: FakeHub, cache: Path, no_retry_sleep: None) -> None:
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    assert chunk == 10 * 1024 * 1024
    big = gguf_bytes(chunk + 2 * 1024 * 1024, seed=2)
    hub.add_file(REPO, "big.gguf", big)
    hub.drop_after("big.gguf", chunk + 1024 * 1024)
    assert download(hub, cache, "big.gguf").read_bytes() == big
    assert hub.file_requests("big.gguf") == [None, f"bytes={chunk}-"]

    hub.drop_after(GGUF, 100_000)  # cut inside the first chunk: nothing kept, starts over
    assert download(hub, cache).read_bytes() == DATA
    assert hub.file_requests(GGUF) == [None, None]


def test_persistent_failure_raises_and_next_call_starts_over(
        hub: FakeHub, cache: Path, no_retry_sleep: None) -> None:
    hub.drop_after(GGUF, 0, times=6)  # one try + 5 resume attempts, none gets a byte
    with pytest.raises(httpx2.RemoteProtocolError):
        download(hub, cache)
    assert hub.file_requests(GGUF) == [None] * 6
    storage = cache / "models--test-org--tiny"
    assert not list((storage / "blobs").iterdir())  # the partial temp file is deleted

    assert download(hub, cache).read_bytes() == DATA  # a new call: a full GET, no Range
    assert hub.file_requests(GGUF) == [None] * 7


def test_missing_repo_file_and_revision(hub: FakeHub, cache: Path) -> None:
    api = HfApi(endpoint=hub.url)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("test-org/nope")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("test-org/nope", GGUF, endpoint=hub.url, cache_dir=cache)
    with pytest.raises(EntryNotFoundError):
        download(hub, cache, "nope.gguf")
    sha = hub.repos[REPO].sha
    assert (cache / "models--test-org--tiny" / ".no_exist" / sha / "nope.gguf").exists()
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO, revision="v9")
    with pytest.raises(RevisionNotFoundError):
        download(hub, cache, revision="v9")


def test_scan_cache_dir_sees_the_repo(hub: FakeHub, cache: Path) -> None:
    download(hub, cache)
    download(hub, cache, "README.md")
    info = scan_cache_dir(cache)
    assert info.warnings == []
    (repo,) = info.repos
    assert (repo.repo_id, repo.repo_type) == (REPO, "model")
    assert repo.size_on_disk == len(DATA) + len(b"# tiny\n")
    (revision,) = repo.revisions
    assert revision.commit_hash == hub.repos[REPO].sha
    assert revision.refs == frozenset({"main"})
    assert {f.file_name for f in revision.files} == {GGUF, "README.md"}


def test_range_requests(hub: FakeHub) -> None:
    url = f"{hub.url}/{REPO}/resolve/main/{GGUF}"
    size = len(DATA)
    with httpx.Client() as client:
        part = client.get(url, headers={"Range": "bytes=4-9"})
        assert part.status_code == 206
        assert part.headers["content-range"] == f"bytes 4-9/{size}"
        assert part.content == DATA[4:10]
        tail = client.get(url, headers={"Range": "bytes=-4"})
        assert (tail.status_code, tail.content) == (206, DATA[-4:])
        rest = client.get(url, headers={"Range": f"bytes={size - 10}-"})
        assert rest.content == DATA[-10:]
        bad = client.get(url, headers={"Range": f"bytes={size}-"})
        assert bad.status_code == 416
        assert bad.headers["content-range"] == f"bytes */{size}"
        missing = client.get(f"{hub.url}/{REPO}/resolve/main/nope")
        assert missing.status_code == 404
        assert missing.headers["x-error-code"] == "EntryNotFound"
        assert missing.headers["x-repo-commit"] == hub.repos[REPO].sha


def test_delay_per_chunk_slows_the_download(hub: FakeHub, cache: Path) -> None:
    hub.delay_per_chunk(0.05)  # 300 kB = 5 chunks of 64 KiB, a pause between two
    started = time.monotonic()
    assert download(hub, cache).read_bytes() == DATA
    assert time.monotonic() - started >= 0.2


def test_cancelled_download_frees_the_server(hub: FakeHub) -> None:
    hub.delay_per_chunk(0.2)
    with httpx.Client() as client, client.stream(
            "GET", f"{hub.url}/{REPO}/resolve/main/{GGUF}") as response:
        first = next(response.iter_raw())
        assert first == DATA[:len(first)]
        assert hub.active_downloads == 1
    assert hub.wait_idle(2.0)


def test_stall_after_sends_some_bytes_then_nothing(hub: FakeHub, cache: Path) -> None:
    hub.stall_after(GGUF, 100_000)
    with httpx.Client(timeout=httpx.Timeout(5.0, read=2.0)) as client, client.stream(
            "GET", f"{hub.url}/{REPO}/resolve/main/{GGUF}") as response:
        received = b""
        pieces = response.iter_raw()
        while len(received) < 100_000:
            received += next(pieces)
        assert received == DATA[:100_000]
        # Checked before the read times out: a timed-out read closes the connection, and the
        # hub then ends the stall (a race this assertion must not run against).
        assert hub.active_downloads == 1  # still open, sending nothing
        with pytest.raises(httpx.ReadTimeout):
            next(pieces)  # nothing more comes
    assert hub.wait_idle(2.0)  # the client went away: the stall ends
    assert download(hub, cache).read_bytes() == DATA  # the next GET is whole


def test_cdn_redirect_mode(monkeypatch: pytest.MonkeyPatch, cache: Path,
                           no_retry_sleep: None) -> None:
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    with FakeHub.running(redirect_to_cdn=True) as hub, local_only_hf_client():
        entry = hub.add_file(REPO, GGUF, DATA)
        hub.drop_after(GGUF, 100_000)
        meta = get_hf_file_metadata(hf_hub_url(REPO, GGUF, endpoint=hub.url))
        assert meta.location == f"{hub.cdn_url}/cdn-lfs/{entry.sha256}"
        assert (meta.etag, meta.size) == (entry.sha256, len(DATA))
        assert download(hub, cache).read_bytes() == DATA
        cdn = f"/cdn-lfs/{entry.sha256}"
        assert [r for r in hub.requests if r[0] == "GET"] == [
            ("GET", cdn, None), ("GET", cdn, f"bytes={64 * 1024}-")]
        assert hub.file_requests(GGUF) == [None, f"bytes={64 * 1024}-"]


def test_hf_endpoint_env_in_a_fresh_process(hub: FakeHub, cache: Path) -> None:
    assert hub.url != constants.ENDPOINT  # this process imported huggingface_hub before
    script = ("from huggingface_hub import hf_hub_download\n"
              f"print(hf_hub_download({REPO!r}, {GGUF!r}))\n")
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}  # monkeypatched vars included
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    path = Path(done.stdout.strip())
    assert path.is_relative_to(cache)
    assert path.read_bytes() == DATA
    assert hub.file_requests(GGUF) == [None]


def test_script_mode(tmp_path: Path) -> None:
    model = tmp_path / "tiny-Q8_0.gguf"
    model.write_bytes(DATA)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(FAKE_HUB), "--port", str(port),
                             "--repo", f"{REPO}={model}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 20
            while True:
                assert proc.poll() is None
                try:
                    info = client.get(f"/api/models/{REPO}", params={"blobs": True})
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "fake hub did not start"
                    time.sleep(0.05)
            assert info.json()["siblings"][0]["size"] == len(DATA)
            assert client.get(f"/{REPO}/resolve/main/{GGUF}").content == DATA
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
