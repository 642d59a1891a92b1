"""Each setting declared once: ``serve``'s flags are built from the fields of ``Settings``
(``config.settings.Flag``), and what a flag gives reaches its setting. What the command line
prints is held by ``test_cli_golden.py``; these tests hold the derivation itself."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from router import cli
from router.config.settings import Flag, Settings


def serve_parser() -> argparse.ArgumentParser:
    parser = cli._parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["serve"]
    raise AssertionError("no serve subcommand")


def flagged() -> list[str]:
    return [name for name, field in Settings.model_fields.items()
            if any(isinstance(m, Flag) for m in field.metadata)]


def test_every_flag_of_serve_is_a_setting_with_a_flag() -> None:
    actions = [a for a in serve_parser()._actions if a.dest != "help"]
    assert {a.dest for a in actions} == set(flagged())
    shown = [a.dest for a in actions if a.help != argparse.SUPPRESS]
    assert sorted(shown) == sorted(flagged())  # one shown flag each
    assert shown[:len(cli.SERVE_HELP_ORDER)] == list(cli.SERVE_HELP_ORDER)


def test_settings_without_a_flag_are_not_on_the_command_line() -> None:
    env_only = set(Settings.model_fields) - set(flagged())
    assert env_only == {"max_body_bytes", "log_lines", "crash_loop_limit", "child_args"}
    options = {s for a in serve_parser()._actions for s in a.option_strings}
    for name in env_only:
        assert f"--{name.replace('_', '-')}" not in options


@pytest.mark.parametrize(("name", "spelling", "expected"), [
    ("port", "--port", {"type": int, "help": "port to listen on (default 8080)"}),
    ("load_timeout", "--load-timeout", {"type": float, "metavar": "S",
                                        "help": "seconds a child may take to become healthy "
                                                "(default 300)"}),
    ("presets", "--presets", {"action": "append", "type": Path, "metavar": "FILE"}),
    ("peer", "--peer", {"action": "append", "metavar": "URL"}),
    ("models_autoload", "--no-models-autoload", {"action": "store_false"}),
    ("peer_prefix", "--peer-prefix", {"action": "store_true"}),
    ("log_level", "--log-level", {"choices": ["debug", "info", "warning", "error"]}),
    ("memory_budget", "--memory-budget", {"metavar": "SIZE"}),
])
def test_a_flag_is_derived_from_its_field(name: str, spelling: str,
                                          expected: dict[str, object]) -> None:
    (spellings, options), *_ = cli._flag_arguments(name, Settings.model_fields[name])
    assert spellings == [spelling]
    assert options["dest"] == name and options["default"] is argparse.SUPPRESS
    assert {k: options.get(k) for k in expected} == expected
    if Settings.model_fields[name].annotation in (str, str | None):
        assert "type" not in options  # a string is taken as given
    if "action" in options and options["action"] != "append":
        assert "metavar" not in options and "type" not in options


def test_an_alias_is_hidden_and_sets_the_same_setting() -> None:
    _, (alias, hidden) = cli._flag_arguments("presets", Settings.model_fields["presets"])
    assert alias == ["--models-preset"]
    assert hidden["help"] is argparse.SUPPRESS and hidden["dest"] == "presets"
    assert "metavar" not in hidden and hidden["action"] == "append" and hidden["type"] is Path
    args = cli._parser().parse_args(["serve", "--models-preset", "a.ini", "--presets", "b.ini"])
    assert args.presets == [Path("a.ini"), Path("b.ini")]


def test_help_shows_the_default_and_a_percent_sign() -> None:
    assert cli._help("x (default {default})", 600.0) == "x (default 600)"
    assert cli._help("x (default {default})", 1.5) == "x (default 1.5)"
    assert cli._help("x (default {default}; y)", "10G") == "x (default 10G; y)"
    assert cli._help("max(1 GiB, 10%)", None) == "max(1 GiB, 10%%)"


def test_flags_given_set_their_settings_and_the_rest_come_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_ROUTER_HOST", "::1")
    monkeypatch.setenv("LLAMA_ROUTER_PORT", "9000")
    monkeypatch.setenv("LLAMA_ROUTER_MAX_QUEUE", "7")
    args = cli._parser().parse_args([
        "serve", "--port", "9001", "--api-key", "a, b", "--api-key", "c", "--no-webui",
        "--peer-prefix", "--models-dir", "m1", "--models-dir", "m2", "--load-timeout", "2.5"])
    given = cli.given_settings(args, ["--ctx-size", "512"])
    assert "host" not in given and "max_queue" not in given
    settings = Settings(**given)
    assert (settings.host, settings.port, settings.max_queue) == ("::1", 9001, 7)
    assert settings.api_key == ["a", "b", "c"]
    assert (settings.webui, settings.peer_prefix, settings.models_autoload) == (False, True, True)
    assert settings.models_dir == [Path("m1"), Path("m2")] and settings.load_timeout == 2.5
    assert settings.child_args == ["--ctx-size", "512"]


@pytest.mark.parametrize(("given", "keys"), [
    ([], []),  # none asked for
    (["k"], ["k"]),
    (["a, b", " c "], ["a", "b", "c"]),  # each flag a comma list
    ([""], [""]),  # asked for, none given: refused by all_api_keys
    ([" , ", ","], [""]),
    ("", []),  # LLAMA_ROUTER_API_KEY= is unset
    (" , ", [""]),
    ("x,y", ["x", "y"]),
])
def test_api_keys_are_comma_lists_wherever_given(given: list[str] | str,
                                                 keys: list[str]) -> None:
    assert Settings(api_key=given).api_key == keys
