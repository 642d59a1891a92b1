"""Unit tests for router.llama.flags: parsing ``llama-server --help`` and the FlagTable."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.llama.flags import FlagTable, Option, load_build, parse_help, parse_version


def test_parses_a_few_hundred_options(help_table: FlagTable) -> None:
    assert len(help_table.options) >= 200
    keys = [option.key for option in help_table.options]
    assert "ctx-size" in keys
    assert "kv-unified" in keys
    assert "embeddings" in keys


@pytest.mark.parametrize("key", ["c", "ctx-size", "LLAMA_ARG_CTX_SIZE"])
def test_ctx_size_spellings_resolve_to_one_valued_option(help_table: FlagTable, key: str) -> None:
    resolved = help_table.lookup(key)
    assert resolved is not None
    assert resolved.negated is False
    assert resolved.option.key == "ctx-size"
    assert resolved.option.takes_value is True
    assert resolved.option.env == "LLAMA_ARG_CTX_SIZE"
    assert resolved.option is help_table.lookup("ctx-size").option  # type: ignore[union-attr]


def test_ctx_size_short_and_long_spellings(help_table: FlagTable) -> None:
    option = help_table.by_canonical("c")
    assert option is not None
    assert option.spellings == ("-c", "--ctx-size")
    assert option.negatives == ()
    assert option.flag == "--ctx-size"


@pytest.mark.parametrize("key", ["kv-unified", "kvu", "LLAMA_ARG_KV_UNIFIED"])
def test_kv_unified_positive_spellings(help_table: FlagTable, key: str) -> None:
    resolved = help_table.lookup(key)
    assert resolved is not None
    assert resolved.option.key == "kv-unified"
    assert resolved.option.takes_value is False
    assert resolved.negated is False


@pytest.mark.parametrize("key", ["no-kvu", "no-kv-unified", "LLAMA_ARG_NO_KV_UNIFIED"])
def test_kv_unified_negative_spellings_resolve_negated(help_table: FlagTable, key: str) -> None:
    resolved = help_table.lookup(key)
    assert resolved is not None
    assert resolved.option.key == "kv-unified"
    assert resolved.negated is True


def test_kv_unified_option_shape(help_table: FlagTable) -> None:
    option = help_table.by_canonical("kv-unified")
    assert option is not None
    assert option.spellings == ("-kvu", "--kv-unified")
    assert option.negatives == ("-no-kvu", "--no-kv-unified")
    assert option.env == "LLAMA_ARG_KV_UNIFIED"


def test_webui_and_no_webui(help_table: FlagTable) -> None:
    positive = help_table.lookup("webui")
    negative = help_table.lookup("no-webui")
    assert positive is not None and negative is not None
    assert positive.option is negative.option
    assert positive.option.key == "webui"
    assert positive.option.takes_value is False
    assert positive.negated is False
    assert negative.negated is True
    assert help_table.lookup("no-ui").negated is True  # type: ignore[union-attr]


def test_embeddings_is_a_flag(help_table: FlagTable) -> None:
    resolved = help_table.lookup("embeddings")
    assert resolved is not None
    assert resolved.option.takes_value is False
    assert resolved.option.key == "embeddings"
    assert resolved.negated is False
    assert help_table.lookup("embedding").option is resolved.option  # type: ignore[union-attr]


def test_flag_whose_only_name_starts_with_no_is_positive(help_table: FlagTable) -> None:
    resolved = help_table.lookup("no-host")
    assert resolved is not None
    assert resolved.negated is False
    assert resolved.option.key == "no-host"
    assert resolved.option.negatives == ()


def test_option_with_a_long_spec_line_keeps_its_env(help_table: FlagTable) -> None:
    # `-hf, -hfr, --hf-repo <user>/<model>[:quant]` is wider than the help column.
    resolved = help_table.lookup("hfr")
    assert resolved is not None
    assert resolved.option.key == "hf-repo"
    assert resolved.option.takes_value is True
    assert resolved.option.env == "LLAMA_ARG_HF_REPO"


def test_unknown_key_is_none(help_table: FlagTable) -> None:
    assert help_table.lookup("ctx-sise") is None
    assert help_table.by_canonical("definitely-not-a-flag") is None


def test_suggest_close_spelling(help_table: FlagTable) -> None:
    assert help_table.suggest("ctx-sise")[0] == "ctx-size"


def test_suggest_includes_extra_names(help_table: FlagTable) -> None:
    assert "load-on-startup" in help_table.suggest("load-on-startp", extra=["load-on-startup"])


def test_suggest_never_offers_env_names(help_table: FlagTable) -> None:
    assert all(not s.isupper() for s in help_table.suggest("LLAMA_ARG_CTX_SIZ"))


@pytest.mark.parametrize(("key", "canonical"),
                         [("nkvo", "kv-offload"), ("nocb", "cont-batching"), ("nr", "repack")])
def test_short_negatives_without_no_prefix_resolve_negated(
        help_table: FlagTable, key: str, canonical: str) -> None:
    resolved = help_table.lookup(key)
    assert resolved is not None
    assert resolved.option.key == canonical
    assert resolved.negated is True


def test_parse_argv_short_negative_without_no_prefix(help_table: FlagTable) -> None:
    parsed = help_table.parse_argv(["-nkvo"])
    assert [(o.key, v) for o, v in parsed] == [("kv-offload", "false")]


# --- Option.render ---------------------------------------------------------------------------

def test_render_valued_option(help_table: FlagTable) -> None:
    option = help_table.by_canonical("ctx-size")
    assert option is not None
    assert option.render("512") == ["--ctx-size", "512"]
    # A valued option passes even a boolean-looking value through verbatim.
    assert option.render("off") == ["--ctx-size", "off"]


@pytest.mark.parametrize("value", ["true", "on", "1", "yes", "enabled", "TRUE"])
def test_render_truthy_flag(help_table: FlagTable, value: str) -> None:
    option = help_table.by_canonical("kv-unified")
    assert option is not None
    assert option.render(value) == ["--kv-unified"]


@pytest.mark.parametrize("value", ["false", "off", "0", "no", "disabled", "False"])
def test_render_falsey_flag_with_negative(help_table: FlagTable, value: str) -> None:
    option = help_table.by_canonical("kv-unified")
    assert option is not None
    assert option.render(value) == ["--no-kv-unified"]


def test_render_falsey_flag_without_negative(help_table: FlagTable) -> None:
    option = help_table.by_canonical("embeddings")
    assert option is not None
    assert option.negatives == ()
    assert option.render("false") == []
    assert option.render("true") == ["--embeddings"]


def test_render_synthetic_options() -> None:
    short_only = Option(("-x",), takes_value=True)
    assert short_only.key == "x"
    assert short_only.flag == "-x"
    assert short_only.render("3") == ["-x", "3"]
    flag = Option(("-f", "--foo"), ("--no-foo",))
    assert flag.render("on") == ["--foo"]
    assert flag.render("off") == ["--no-foo"]


# --- FlagTable.parse_argv --------------------------------------------------------------------

def test_parse_argv_separate_value(help_table: FlagTable) -> None:
    parsed = help_table.parse_argv(["--ctx-size", "512"])
    assert [(o.key, v) for o, v in parsed] == [("ctx-size", "512")]


def test_parse_argv_inline_value_with_short_spelling(help_table: FlagTable) -> None:
    parsed = help_table.parse_argv(["-c=512"])
    assert [(o.key, v) for o, v in parsed] == [("ctx-size", "512")]


def test_parse_argv_negative_flag(help_table: FlagTable) -> None:
    parsed = help_table.parse_argv(["--no-kv-unified"])
    assert [(o.key, v) for o, v in parsed] == [("kv-unified", "false")]


def test_parse_argv_long_spelling_with_underscores(help_table: FlagTable) -> None:
    """llama-server reads ``_`` as ``-`` in long options (llama.cpp's test suite passes
    ``--backend_sampling``); short ones, values and inline values keep theirs."""
    parsed = help_table.parse_argv(["--backend_sampling", "--n_predict", "8", "--ctx_size=64",
                                    "--samplers", "top_k;top_p", "--no_kv_unified"])
    assert [(o.key, v) for o, v in parsed] == [
        ("backend-sampling", "true"), ("n-predict", "8"), ("ctx-size", "64"),
        ("samplers", "top_k;top_p"), ("kv-unified", "false"),
    ]
    with pytest.raises(ValueError, match="unknown"):
        help_table.parse_argv(["-n_predict", "8"])


def test_parse_argv_mixed(help_table: FlagTable) -> None:
    parsed = help_table.parse_argv(["-kvu", "-c", "1024", "--embeddings", "--no-webui",
                                    "--samplers", "top_k;top_p"])
    assert [(o.key, v) for o, v in parsed] == [
        ("kv-unified", "true"), ("ctx-size", "1024"), ("embeddings", "true"),
        ("webui", "false"), ("samplers", "top_k;top_p"),
    ]


def test_parse_argv_value_may_start_with_dash(help_table: FlagTable) -> None:
    parsed = help_table.parse_argv(["--ctx-size", "-1"])
    assert [(o.key, v) for o, v in parsed] == [("ctx-size", "-1")]


def test_parse_argv_empty(help_table: FlagTable) -> None:
    assert help_table.parse_argv([]) == []


@pytest.mark.parametrize("argv", [["--ctx-sise", "512"], ["ctx-size"], ["512"],
                                  ["--LLAMA_ARG_NOPE"]])
def test_parse_argv_unknown_argument(help_table: FlagTable, argv: list[str]) -> None:
    with pytest.raises(ValueError, match="unknown llama-server argument"):
        help_table.parse_argv(argv)


def test_parse_argv_missing_value(help_table: FlagTable) -> None:
    with pytest.raises(ValueError, match=r"'--ctx-size' needs a value"):
        help_table.parse_argv(["--embeddings", "--ctx-size"])


# --- parse_help on synthetic text -------------------------------------------------------------

SYNTHETIC_HELP = """\
----- common params -----

-h,    --help, --usage                  print usage and exit
-t,    --threads N                      number of threads
                                        (env: LLAMA_ARG_THREADS)
--mmap, --no-mmap                       whether to memory-map model
                                        (env: LLAMA_ARG_MMAP)
--no-perf-x                             disable something
--very-long-option-name-here, -vl <a long value hint>
                                        explained on the next line
                                        (env: LLAMA_ARG_VERY_LONG)
"""


def test_parse_help_synthetic() -> None:
    table = FlagTable(parse_help(SYNTHETIC_HELP))
    by_key = {o.key: o for o in table.options}
    assert set(by_key) == {"usage", "threads", "mmap", "no-perf-x", "very-long-option-name-here"}
    assert by_key["usage"].spellings == ("-h", "--help", "--usage")
    assert by_key["usage"].takes_value is False
    assert by_key["threads"].takes_value is True
    assert by_key["threads"].env == "LLAMA_ARG_THREADS"
    assert by_key["mmap"].negatives == ("--no-mmap",)
    assert by_key["very-long-option-name-here"].takes_value is True
    assert by_key["very-long-option-name-here"].env == "LLAMA_ARG_VERY_LONG"
    assert table.lookup("LLAMA_ARG_NO_MMAP").negated is True  # type: ignore[union-attr]
    assert table.lookup("no-mmap").negated is True  # type: ignore[union-attr]
    assert table.lookup("no-perf-x").negated is False  # type: ignore[union-attr]
    assert table.lookup("vl").option.key == "very-long-option-name-here"  # type: ignore[union-attr]


def test_parse_help_empty() -> None:
    assert parse_help("") == []
    assert parse_help("usage: llama-server [options]\n\nnothing here\n") == []


@pytest.mark.process
def test_the_build_is_asked_once_per_binary(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\necho run >> {calls}\n"
                      "echo 'version: 0.6.0-dev (build 11434, commit pypi-sdist)' >&2\n")
    binary.chmod(0o755)
    cache = tmp_path / "cache"
    assert load_build(binary, cache) == "b11434"
    assert load_build(binary, cache) == "b11434"  # kept: not asked again
    assert calls.read_text().splitlines() == ["run"]
    binary.write_text(binary.read_text() + "# rebuilt\n")  # another size: asked again
    assert load_build(binary, cache) == "b11434"
    assert len(calls.read_text().splitlines()) == 2
    assert parse_version("built with GNU 12.2.0 for Linux x86_64") == "unknown"
    binary.chmod(0o644)  # cannot run: unknown, and asked again next time
    binary.write_text("not a program\n")
    assert load_build(binary, cache) == "unknown"
    assert not any(cache.glob("*.tmp"))
    binary.chmod(0o755)
    binary.write_text("#!/bin/sh\necho 'version: 1 (build 12000, commit x)'\n")
    assert load_build(binary, cache) == "b12000"
