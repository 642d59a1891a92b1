"""A preset's ``env`` key (``router.config.envvars``): parsed into its children's environment,
``[*]``'s entries under a section's name by name, the names the router keeps refused with the
file, line and key, a secret-looking value never shown; the spawner's environment and launch;
GPU estimates under a preset's ``CUDA_VISIBLE_DEVICES``. The same with a real llama-server
child is in ``test_childenv_real.py``."""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import httpx
import pytest

from router.config.envvars import ChildEnv, looks_secret, parse_env
from router.config.presets import ModelPreset, Origin, PresetsInvalid, load_preset_file
from router.config.sources import build_catalogue
from router.core.spawner import Spawner
from router.events import EventBus
from router.host.gpus import GpuDevice, devices_used, visible_devices
from router.llama.flags import FlagTable


def write(directory: Path, text: str, name: str = "presets.ini") -> Path:
    (directory / "m.gguf").touch()
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def presets(directory: Path, text: str, table: FlagTable) -> dict[str, ModelPreset]:
    preset_file = load_preset_file(write(directory, text), table)
    return {s.name: preset_file.merged(s) for s in preset_file.models}


# --- parsing ----------------------------------------------------------------------------------

def test_entries_reach_the_preset_and_never_its_arguments(tmp_path: Path,
                                                          help_table: FlagTable) -> None:
    models = presets(tmp_path, "[a]\nmodel = m.gguf\n"
                     "env = CUDA_VISIBLE_DEVICES=1, GGML_SCHED_MAX_COPIES = 1 ,EMPTY=\n"
                     "[b]\nmodel = m.gguf\n", help_table)
    assert dict(models["a"].env) == {"CUDA_VISIBLE_DEVICES": "1", "GGML_SCHED_MAX_COPIES": "1",
                                     "EMPTY": ""}
    assert "env" not in models["a"].args  # never a llama-server flag
    assert dict(models["b"].env) == {}


def test_a_comma_belongs_to_the_value_unless_a_name_follows(help_table: FlagTable) -> None:
    assert dict(parse_env("CUDA_VISIBLE_DEVICES=0,1, HIP_VISIBLE_DEVICES=2,3")) == {
        "CUDA_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "2,3"}
    assert dict(parse_env("A=x, y z,B=b=c")) == {"A": "x, y z", "B": "b=c"}


def test_a_sections_entries_go_over_the_defaults_name_by_name(tmp_path: Path,
                                                              help_table: FlagTable) -> None:
    models = presets(tmp_path, "[*]\nenv = CUDA_VISIBLE_DEVICES=0, GGML_SCHED_MAX_COPIES=1\n"
                     "[a]\nmodel = m.gguf\nenv = CUDA_VISIBLE_DEVICES=1\n"
                     "[b]\nmodel = m.gguf\n", help_table)
    assert dict(models["a"].env) == {"CUDA_VISIBLE_DEVICES": "1", "GGML_SCHED_MAX_COPIES": "1"}
    assert dict(models["b"].env) == {"CUDA_VISIBLE_DEVICES": "0", "GGML_SCHED_MAX_COPIES": "1"}


def test_defaults_of_every_file_apply_and_a_remote_upstream_has_none(
        tmp_path: Path, help_table: FlagTable) -> None:
    """``[*]``'s entries of every file reach a models-dir model, a later file's over an
    earlier's by name; a remote upstream has no child, so none reach it."""
    first = write(tmp_path, "[*]\nenv = A=1, B=1\n[remote]\nupstream = http://127.0.0.1:9\n",
                  "one.ini")
    second = write(tmp_path, "[*]\nenv = B=2\n", "two.ini")
    scanned = tmp_path / "dir"
    scanned.mkdir()
    (scanned / "scanned.gguf").touch()
    catalogue = build_catalogue([first, second], [scanned], help_table, hf_cache=False)
    assert dict(catalogue.models["scanned"].env) == {"A": "1", "B": "2"}
    assert dict(catalogue.models["remote"].env) == {}


# --- refusals: file, line, key ----------------------------------------------------------------

@pytest.mark.parametrize(("entries", "fragment"), [
    ("FOO", "entry 1 has no '='"),
    ("A=1, =2", "entry 2 has an empty name"),
    ("A=1, 1B=2", "'1B' is not an environment variable name"),
    ("A-B=1", "'A-B' is not an environment variable name"),
    ("A=1, A=2", "'A' is set twice"),
    ("LLAMA_ARG_CTX_SIZE=4096", "set it as a preset key instead ('ctx-size = …' or "
                                "'LLAMA_ARG_CTX_SIZE = …')"),
    ("LLAMA_ARG_SOMETHING_NEW=1", "a llama-server option: set it as a preset key instead"),
    ("LLAMA_API_KEY=k", "the router keeps API keys and credentials from every child"),
    ("LLAMA_ARG_API_KEY=k", "the router keeps API keys and credentials from every child"),
    ("LLAMA_ROUTER_API_KEY=k", "the router keeps API keys and credentials from every child"),
    ("HF_TOKEN=t", "the router keeps API keys and credentials from every child"),
    ("LLAMA_SERVER_ROUTER_PORT=1", "the router sets it itself for every child"),
    ("LLAMA_SERVER_CHILD_MODE=download", "the router sets it itself for every child"),
    ("AIP_MODE=PREDICTION", "would make the child listen elsewhere"),
    ("GOMP_SPINCOUNT=1", "the router sets it for CPU sharing"),
    ("OMP_WAIT_POLICY=passive", "the router sets it for CPU sharing"),
    ("", "expected NAME=VALUE entries"),
])
def test_a_bad_entry_is_refused_naming_file_line_and_key(tmp_path: Path, help_table: FlagTable,
                                                         entries: str, fragment: str) -> None:
    path = write(tmp_path, f"[a]\nmodel = m.gguf\n\nenv = {entries}\n")
    with pytest.raises(PresetsInvalid) as info:
        load_preset_file(path, help_table)
    [problem] = info.value.problems
    assert (problem.origin, problem.section, problem.key) == (Origin(path, 4), "a", "env")
    assert str(problem).startswith(f"{path}:4: [a] env: ")
    assert fragment in str(problem)


def test_a_refusal_never_shows_a_value(tmp_path: Path, help_table: FlagTable) -> None:
    path = write(tmp_path, "[*]\nenv = s3cret-no-equals, LLAMA_API_KEY=s3cret-key\n"
                 "[a]\nmodel = m.gguf\n")
    with pytest.raises(PresetsInvalid) as info:
        load_preset_file(path, help_table)
    [problem] = info.value.problems
    assert (problem.origin.line, problem.section, problem.key) == (2, "*", "env")
    assert "s3cret" not in str(problem)


def test_a_remote_upstream_refuses_an_environment(tmp_path: Path, help_table: FlagTable) -> None:
    path = write(tmp_path, "[r]\nupstream = http://127.0.0.1:9\nenv = A=1\n")
    with pytest.raises(PresetsInvalid) as info:
        load_preset_file(path, help_table)
    [problem] = info.value.problems
    assert (problem.origin.line, problem.key) == (3, "env")
    assert "a remote upstream has no child" in str(problem)


# --- secrets are never shown ------------------------------------------------------------------

@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "hf_token", "MY_SECRET", "DB_PASSWORD",
                                  "SMTP_PASS", "GOOGLE_APPLICATION_CREDENTIALS", "AUTH_HEADER",
                                  "x_apikey"])
def test_secret_looking_names(name: str) -> None:
    assert looks_secret(name)


def test_a_secret_looking_value_is_never_in_a_repr_or_shown(tmp_path: Path,
                                                             help_table: FlagTable) -> None:
    models = presets(tmp_path, "[a]\nmodel = m.gguf\n"
                     "env = MY_SERVICE_TOKEN=s3cret, CUDA_VISIBLE_DEVICES=1\n", help_table)
    preset = models["a"]
    assert preset.env["MY_SERVICE_TOKEN"] == "s3cret"  # the child gets it
    assert preset.env.shown() == {"MY_SERVICE_TOKEN": "***", "CUDA_VISIBLE_DEVICES": "1"}
    assert "s3cret" not in repr(preset) and "CUDA_VISIBLE_DEVICES': '1'" in repr(preset)
    assert not looks_secret("CUDA_VISIBLE_DEVICES")


# --- the spawner: the child's environment and its launch --------------------------------------

def spawner(table: FlagTable, cores: list[int]) -> Spawner:
    return Spawner(Path("/bin/llama-server"), table, httpx.AsyncClient(), EventBus(),
                   router_port=8080, cores=cores, gpus=[], models=list)


@pytest.mark.parametrize("cores", [[], [0, 1]])
def test_the_preset_entries_go_over_the_routers_environment(
        help_table: FlagTable, monkeypatch: pytest.MonkeyPatch, cores: list[int]) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("LLAMA_API_KEY", "router-key")
    monkeypatch.setenv("LLAMA_ROUTER_TEST_KEPT", "yes")
    preset = ModelPreset(id="m", args=MappingProxyType({"model": "/m.gguf"}),
                         env=ChildEnv({"CUDA_VISIBLE_DEVICES": "1", "MARK": "hello"}))
    env = spawner(help_table, cores).launch_env(preset, None)
    assert (env["CUDA_VISIBLE_DEVICES"], env["MARK"], env["LLAMA_ROUTER_TEST_KEPT"]) == \
        ("1", "hello", "yes")
    assert "LLAMA_API_KEY" not in env  # the router's keys still never reach a child


def test_a_change_of_environment_changes_the_launch(help_table: FlagTable) -> None:
    base = ModelPreset(id="m", args=MappingProxyType({"model": "/m.gguf"}),
                       env=ChildEnv({"A": "1"}))
    launch = spawner(help_table, []).launch_of
    assert launch(base) == launch(ModelPreset(id="m", args=base.args, env=ChildEnv({"A": "1"})))
    assert launch(base) != launch(ModelPreset(id="m", args=base.args, env=ChildEnv({"A": "2"})))


# --- GPU estimates under a preset's CUDA_VISIBLE_DEVICES --------------------------------------

GPUS = [GpuDevice(0, "GPU-aa11", "x", 1 << 30), GpuDevice(1, "GPU-bb22", "x", 1 << 30),
        GpuDevice(2, "GPU-cc33", "x", 1 << 30)]


@pytest.mark.parametrize(("visible", "expected"), [
    (None, [0, 1, 2]), ("1", [1]), ("2,0", [2, 0]), ("GPU-bb", [1]), ("1,7,2", [1]),
    ("", []), ("-1", []), ("MIG-abc", [0, 1, 2]),
])
def test_the_gpus_a_child_sees(visible: str | None, expected: list[int]) -> None:
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert [d.index for d in visible_devices(GPUS, environ)] == expected


def test_a_device_names_the_gpus_the_child_sees_in_their_order() -> None:
    seen = visible_devices(GPUS, {"CUDA_VISIBLE_DEVICES": "2,1"})
    assert [d.index for d in devices_used({"device": "CUDA0"}, seen)] == [2]
    assert [d.index for d in devices_used({}, seen)] == [2, 1]
