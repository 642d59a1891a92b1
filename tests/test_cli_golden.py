"""The command line as users see it, held to recorded output: every ``--help`` and the error
output and exit code of invalid invocations and invalid ``LLAMA_ROUTER_*`` variables.

Each case runs ``python -m router.cli`` in a subprocess at a fixed width (``COLUMNS=100``),
from the repository root, with no ``LLAMA_ROUTER_*`` of the caller's, and compares its exit
code, stdout and stderr with ``tests/data/cli/<case>.txt``. No case starts a server: each asks
for help or fails before anything listens (``LLAMA_ROUTER_LLAMA_SERVER`` points at no binary,
so a case that passed every check would still stop at the binary, before binding).

After a deliberate change to what the command line prints, rewrite the recorded files with
``.venv/bin/python tests/test_cli_golden.py`` and review the diff.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "cli"
NO_BINARY = "/nonexistent/llama-server"
COMMENTS_ONLY_KEYS = "tests/data/cli/comments-only.keys"

Case = tuple[tuple[str, ...], dict[str, str]]

HELP: dict[str, Case] = {
    "help": (("--help",), {}),
    **{f"help-{command}": ((command, "--help"), {}) for command in (
        "serve", "install-llama-server", "ls", "ps", "load", "unload", "logs", "events",
        "pull", "tiny-model")},
}

INT_FLAGS = ("--port", "--models-max", "--liveness-misses", "--max-queue")
FLOAT_FLAGS = ("--load-timeout", "--stop-timeout", "--liveness-interval", "--liveness-timeout",
               "--shutdown-grace", "--body-timeout", "--upstream-timeout", "--wait-budget",
               "--idle-timeout", "--fairness", "--peer-dns-interval")

# Refused by argparse: the usage and one error line, exit 2.
COMMAND_LINE: dict[str, Case] = {
    "no-command": ((), {}),
    "unknown-command": (("frobnicate",), {}),
    "unknown-flag": (("serve", "--no-such-flag"), {}),
    "missing-value": (("serve", "--port"), {}),
    **{f"not-a-number{flag}": (("serve", flag, "x"), {}) for flag in INT_FLAGS + FLOAT_FLAGS},
    "int-given-a-fraction": (("serve", "--port", "1.5"), {}),
    "bad-choice--log-level": (("serve", "--log-level", "loud"), {}),
    "switch-given-a-value": (("serve", "--peer-prefix=yes"), {}),
    "negative-switch-given-a-value": (("serve", "--no-webui=1"), {}),
    "ambiguous-prefix-models": (("serve", "--mod", "x"), {}),
    "ambiguous-prefix-peer-dns": (("serve", "--peer-d", "x"), {}),
    "repeatable-flag-without-value": (("serve", "--presets"), {}),
    "install-conflicting-flags": (("install-llama-server", "--no-webui", "--webui-only"), {}),
    "install-jobs-not-a-number": (("install-llama-server", "--jobs", "many"), {}),
    "load-without-model": (("load",), {}),
    "logs-lines-not-a-number": (("logs", "-n", "x"), {}),
    "pull-without-model": (("pull",), {}),
    "tiny-model-without-output": (("tiny-model",), {}),
    "tiny-model-seed-not-a-number": (("tiny-model", "out.gguf", "--seed", "x"), {}),
}

# Refused by the settings: "invalid settings", one line a setting, exit 2.
OUT_OF_RANGE = ("--port", "70000", "--load-timeout", "0", "--stop-timeout", "-1",
                "--wait-budget", "0", "--body-timeout", "0", "--upstream-timeout", "0",
                "--idle-timeout", "-1", "--max-queue", "0", "--fairness", "0",
                "--liveness-interval", "-1", "--liveness-timeout", "0", "--liveness-misses", "0",
                "--shutdown-grace", "0", "--peer-dns-interval", "0", "--state-budget", "abc",
                "--memory-budget", "lots", "--gpu-memory-budget", "x=2G",
                "--cors-origins", "bogus", "--host", ",")
SETTINGS: dict[str, Case] = {
    "port-too-big": (("serve", "--port", "70000"), {}),
    "port-negative": (("serve", "--port", "-1"), {}),
    "timeout-nan": (("serve", "--load-timeout", "nan"), {}),
    "every-out-of-range-flag-at-once": (("serve", *OUT_OF_RANGE), {}),
    "host-without-address": (("serve", "--host", ","), {}),
    "cors-origin-with-path": (("serve", "--cors-origins", "http://x/path"), {}),
    "memory-budget-not-a-size": (("serve", "--memory-budget", "lots"), {}),
    "gpu-memory-budget-bad-index": (("serve", "--gpu-memory-budget", "x=2G"), {}),
    "gpu-memory-budget-bad-separator": (("serve", "--gpu-memory-budget", "1:2G"), {}),
    "state-budget-negative": (("serve", "--state-budget=-1"), {}),
    "state-budget-too-big": (("serve", "--state-budget", "99999999999999999999999T"), {}),
    "flag-and-variable-both-bad": (("serve", "--port", "70000"),
                                   {"LLAMA_ROUTER_LOAD_TIMEOUT": "0"}),
    "flag-wins-over-bad-variable": (("serve", "--port", "80"), {"LLAMA_ROUTER_PORT": "x"}),
}

# Invalid environment variables, each alone.
ENVIRONMENT: dict[str, Case] = {
    f"env-{name.removeprefix('LLAMA_ROUTER_').lower().replace('_', '-')}": (("serve",),
                                                                          {name: value})
    for name, value in (
        ("LLAMA_ROUTER_PORT", "abc"), ("LLAMA_ROUTER_MODELS_MAX", "1.5"),
        ("LLAMA_ROUTER_MODELS_AUTOLOAD", "maybe"), ("LLAMA_ROUTER_LOAD_TIMEOUT", "x"),
        ("LLAMA_ROUTER_CRASH_LOOP_LIMIT", "0"), ("LLAMA_ROUTER_MAX_BODY_BYTES", "0"),
        ("LLAMA_ROUTER_LOG_LINES", "0"), ("LLAMA_ROUTER_HOST", ","),
        ("LLAMA_ROUTER_STATE_BUDGET", "abc"), ("LLAMA_ROUTER_WEBUI", "perhaps"),
        ("LLAMA_ROUTER_CPU_SHARING", "sometimes"), ("LLAMA_ROUTER_PEER_PREFIX", "2"),
        ("LLAMA_ROUTER_CORS_ORIGINS", "bogus"), ("LLAMA_ROUTER_GPU_MEMORY_BUDGET", "x=1G"),
        ("LLAMA_ROUTER_MEMORY_BUDGET", "lots"), ("LLAMA_ROUTER_FAIRNESS", "-3"),
        ("LLAMA_ROUTER_PEER", "ftp://x"), ("LLAMA_ROUTER_API_KEY", " , "),
        ("LLAMA_ROUTER_API_KEY_FILE", "/nonexistent/keys.txt"), ("LLAMA_ROUTER_LOG_LEVEL", "loud"),
    )
}

# Refused when serving starts, before anything listens: keys, peers, the binary.
START: dict[str, Case] = {
    "api-key-empty": (("serve", "--api-key", ""), {}),
    "api-key-blank-list": (("serve", "--api-key", " , "), {}),
    "api-key-repeated-blank": (("serve", "--api-key", ",", "--api-key", " "), {}),
    "api-key-file-missing": (("serve", "--api-key-file", "/nonexistent/keys.txt"), {}),
    "api-key-file-comments-only": (("serve", "--api-key-file", COMMENTS_ONLY_KEYS), {}),
    "peer-not-http": (("serve", "--peer", "ftp://x"), {}),
    "peer-dns-without-port": (("serve", "--peer-dns", "nope"), {}),
    "peer-api-key-file-missing": (("serve", "--peer-api-key-file", "/nonexistent/peer.key"),
                                  {}),
    "llama-server-missing": (("serve", "--llama-server", "/nonexistent/other-llama-server"),
                             {}),
    "unknown-variable-is-ignored": (("serve",), {"LLAMA_ROUTER_NO_SUCH_SETTING": "1"}),
}

# The cases whose settings are valid: they stop at the binary (NO_BINARY), the safety net.
REACH_THE_BINARY = frozenset({"unknown-variable-is-ignored", "flag-wins-over-bad-variable"})

CASES: dict[str, Case] = {**HELP, **COMMAND_LINE, **SETTINGS, **ENVIRONMENT, **START}


def environment(extra: dict[str, str]) -> dict[str, str]:
    """The caller's environment less what would change the output, plus the case's own."""
    base = {name: value for name, value in os.environ.items()
            if not name.startswith("LLAMA_ROUTER_")
            and name not in ("LLAMA_SERVER_BIN", "COLUMNS", "LINES", "FORCE_COLOR")}
    return {**base, "COLUMNS": "100", "NO_COLOR": "1", "PYTHONWARNINGS": "ignore",
            "LLAMA_ROUTER_LLAMA_SERVER": NO_BINARY, **extra}


def render(name: str) -> str:
    """What the case prints, as its recorded file holds it."""
    argv, env = CASES[name]
    result = subprocess.run([sys.executable, "-m", "router.cli", *argv], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, env=environment(env))
    shown_env = "".join(f" {k}={v!r}" for k, v in env.items())
    return (f"$ llama-router {subprocess.list2cmdline(argv)}\n"
            f"env:{shown_env}\n"
            f"exit {result.returncode}\n"
            f"--- stdout\n{result.stdout}"
            f"--- stderr\n{result.stderr}")


@cache
def rendered() -> dict[str, str]:
    """Every case, a few at a time (each is a Python start, most of its time)."""
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return dict(zip(CASES, pool.map(render, CASES), strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_output_is_as_recorded(name: str) -> None:
    expected = (DATA / f"{name}.txt").read_text()
    assert rendered()[name] == expected


def test_every_recorded_file_is_a_case() -> None:
    recorded = {path.stem for path in DATA.glob("*.txt")}
    assert recorded == set(CASES)


def test_no_case_started_anything() -> None:
    """Every help exits 0 and every other case 2; only the cases with valid settings got as
    far as the binary (the safety net above), and none further."""
    for name, output in rendered().items():
        assert output.splitlines()[2] == ("exit 0" if name.startswith("help") else "exit 2"), name
        assert (NO_BINARY in output) == (name in REACH_THE_BINARY), name


def main() -> None:
    """Rewrite the recorded files from the current command line."""
    DATA.mkdir(parents=True, exist_ok=True)
    for path in DATA.glob("*.txt"):
        path.unlink()
    for name, text in rendered().items():
        (DATA / f"{name}.txt").write_text(text)
    print(f"wrote {len(CASES)} files under {DATA.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
