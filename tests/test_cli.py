"""The command line as users run it: help, configuration errors, missing binary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import start_router

# Every test runs the CLI as a subprocess; those whose router starts the real llama-server are
# also marked `real`.
pytestmark = pytest.mark.process

CLI = [sys.executable, "-m", "router.cli"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_help() -> None:
    result = run("--help")
    assert result.returncode == 0
    assert "serve" in result.stdout and "install-llama-server" in result.stdout
    serve = run("serve", "--help")
    assert serve.returncode == 0 and "--models-max" in serve.stdout
    install = run("install-llama-server", "--help")
    assert install.returncode == 0 and "CMAKE_ARGS" in install.stdout


def test_missing_binary_says_how_to_install(tmp_path: Path) -> None:
    env = {"PATH": "/nonexistent", "XDG_CACHE_HOME": str(tmp_path), "LLAMA_SERVER_BIN": ""}
    result = run("serve", "--port", "0", env=env)
    assert result.returncode == 2
    assert "llama-router install-llama-server" in result.stderr


def test_llama_server_flag_must_be_executable(tmp_path: Path) -> None:
    result = run("serve", "--llama-server", str(tmp_path / "nope"))
    assert result.returncode == 2
    assert "not an executable file" in result.stderr


# A Python that has the router but not the `tiny` extra: importing gguf or numpy fails.
WITHOUT_TINY_EXTRA = "import sys; sys.modules['gguf'] = sys.modules['numpy'] = None; "


def test_the_router_imports_neither_numpy_nor_gguf() -> None:
    """gguf and numpy are the `tiny` extra (tiny-model only): serving, the CLI and the GGUF
    header reader must work without them."""
    code = ("import sys, router.cli, router.server, router.edge.app, router.llama.ggufmeta, "
            "router.host.memory; "
            "print(sorted({'numpy', 'gguf'} & {m.split('.')[0] for m in sys.modules}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "[]"
    result = subprocess.run([sys.executable, "-c", WITHOUT_TINY_EXTRA + code],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_serving_loads_no_installer_and_no_cli_of_httpx() -> None:
    """What serving never uses stays out of the router's memory (docs/benchmarks.md, idle
    RSS): the installer's archive and packaging modules, ctypes (only the spawn fallback),
    httpx's command-line client (click's pygments)."""
    code = ("import sys, router.cli, router.server, router.edge.app; "
            "loaded = {name for name, module in sys.modules.items() if module is not None}; "
            "print(sorted({'tarfile', 'ctypes', 'pygments', 'httpx._main'} & loaded))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    assert result.stdout.strip() == "[]"


def test_tiny_model_without_the_extra_says_which_to_install(tmp_path: Path) -> None:
    out = tmp_path / "tiny.gguf"
    code = WITHOUT_TINY_EXTRA + "from router.cli import main; raise SystemExit(main())"
    result = subprocess.run([sys.executable, "-c", code, "tiny-model", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "llama-router: tiny-model needs the `gguf` package, which is not installed: "
        "pip install 'llama-router[tiny]'"]
    assert not out.exists()


def test_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "tiny.gguf"
    result = run("tiny-model", str(out), "--seed", "3", "--name", "t")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out) and out.stat().st_size > 100_000


@pytest.mark.real
@pytest.mark.parametrize(("text", "expected"), [
    ("[m]\nmodel = {model}\nctx-sise = 512\n",
     "bad.ini:3: [m] ctx-sise: unknown key (not a llama-server flag nor a preset key); "
     "did you mean ctx-size?"),
    ("[m]\nmodel = {model}\nembeddings = maybe\n",
     "bad.ini:3: [m] embeddings: bad boolean 'maybe'"),
    ("[*]\nctx-size = 512\n[m]\nctx-size = 1024\n",
     "bad.ini:3: [m]: no model source"),
    ("[m]\nmodel = missing.gguf\n", "bad.ini:2: [m] model: file does not exist"),
    ("ctx-size = 512\n", "bad.ini:1: ctx-size: key outside any section"),
])
def test_bad_presets_exit_before_serving(tmp_path: Path, llama_server: Path, text: str,
                                         expected: str) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    bad = tmp_path / "bad.ini"
    bad.write_text(text.format(model=model))
    result = run("serve", "--presets", str(bad), "--port", "0")
    assert result.returncode == 2
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.real
def test_missing_preset_file(tmp_path: Path, llama_server: Path) -> None:
    result = run("serve", "--presets", str(tmp_path / "nope.ini"), "--port", "0")
    assert result.returncode == 2
    assert "nope.ini:0: file does not exist" in result.stderr


@pytest.mark.real
def test_bad_pass_through_arg(tmp_path: Path, llama_server: Path) -> None:
    result = run("serve", "--port", "0", "--", "--no-such-flag")
    assert result.returncode != 0
    assert "unknown llama-server argument '--no-such-flag'" in result.stderr


@pytest.mark.real
def test_models_dir_source(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    models = tmp_path / "models"
    (models / "sub").mkdir(parents=True)
    (models / "flat.gguf").write_bytes(tiny_models["alpha"].read_bytes())
    (models / "sub" / "sub-model.gguf").write_bytes(tiny_models["beta"].read_bytes())
    with start_router(tmp_path, "--models-dir", str(models)) as router, \
            router.client() as client:
        assert set(router.models()) == {"flat", "sub"}
        assert router.models()["flat"]["source"] == "models_dir"
        for name in ("flat", "sub"):
            response = client.post("/v1/chat/completions", json={
                "model": name, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
            assert response.status_code == 200, response.text


@pytest.mark.parametrize(("args", "expected"), [
    (("--memory-budget", "lots"), "--memory-budget (LLAMA_ROUTER_MEMORY_BUDGET): invalid size"),
    (("--gpu-memory-budget", "1:2G"), "--gpu-memory-budget (LLAMA_ROUTER_GPU_MEMORY_BUDGET): "),
    (("--gpu-memory-budget", "x=2G"), "expected INDEX=SIZE"),
    (("--state-budget=-1",), "--state-budget (LLAMA_ROUTER_STATE_BUDGET): invalid size '-1'"),
    (("--state-budget", "abc"), "--state-budget (LLAMA_ROUTER_STATE_BUDGET): invalid size"),
    (("--state-budget", "1e400"), "invalid size '1e400'"),
    (("--state-budget", "99999999999999999999999T"),
     "is more than the most a state directory may hold (1024.0 TiB)"),
])
def test_bad_budgets_are_refused_before_anything_starts(args: tuple[str, ...],
                                                        expected: str) -> None:
    result = run("serve", "--port", "0", *args)
    assert result.returncode == 2
    assert "invalid settings" in result.stderr and expected in result.stderr, result.stderr
    assert "pydantic" not in result.stderr and "validation error" not in result.stderr


@pytest.mark.real
def test_a_budget_for_a_gpu_that_is_not_there(tmp_path: Path, llama_server: Path) -> None:
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}  # no nvidia-smi: no GPUs
    result = run("serve", "--port", "0", "--llama-server", str(llama_server),
                 "--gpu-memory-budget", "7=1G", env=env)
    assert result.returncode == 2
    assert "--gpu-memory-budget: there is no GPU 7 (nvidia-smi lists none)" in result.stderr


@pytest.mark.parametrize(("args", "env", "named"), [
    (("--api-key", ""), {}, "--api-key"),
    (("--api-key", " , "), {}, "--api-key"),
    ((), {"LLAMA_ROUTER_API_KEY": " , "}, "LLAMA_ROUTER_API_KEY"),
    (("--api-key-file", "{comments}"), {}, "keys.txt: gives no API key"),  # names the file
])
def test_key_options_that_give_no_key_refuse_to_start(tmp_path: Path, args: tuple[str, ...],
                                                      env: dict[str, str], named: str) -> None:
    comments = tmp_path / "keys.txt"
    comments.write_text("# no key here yet\n\n   # nor here\n")
    argv = [a.format(comments=comments) for a in args]
    result = run("serve", "--port", "0", *argv, env=env)
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and "refusing to start without authentication" in result.stderr


def test_an_empty_key_variable_is_unset(tmp_path: Path) -> None:
    """``LLAMA_ROUTER_API_KEY=`` as an env file writes it: no keys asked for, so no refusal
    (it fails later, for want of a llama-server here, not for the key)."""
    result = run("serve", "--port", "0", "--llama-server", str(tmp_path / "none"),
                 env={"LLAMA_ROUTER_API_KEY": ""})
    assert result.returncode == 2
    assert "API key" not in result.stderr and "none" in result.stderr


def test_an_unreadable_key_file_is_named(tmp_path: Path) -> None:
    result = run("serve", "--port", "0", "--api-key-file", str(tmp_path / "missing.txt"))
    assert result.returncode == 2
    assert "missing.txt" in result.stderr and "No such file" in result.stderr
