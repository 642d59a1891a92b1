"""Unit tests for router.config.presets: INI parsing and validation against the real flag table."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config.presets import (
    ModelPreset,
    Origin,
    PresetFile,
    PresetProblem,
    PresetsInvalid,
    canonical_model_id,
    load_preset_file,
    parse_ini,
)
from router.llama.flags import FlagTable


def write(directory: Path, text: str, name: str = "presets.ini") -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def model_file(directory: Path, name: str = "m.gguf") -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def load(directory: Path, text: str, table: FlagTable) -> PresetFile:
    return load_preset_file(write(directory, text), table)


def problems_of(directory: Path, text: str, table: FlagTable) -> list[PresetProblem]:
    with pytest.raises(PresetsInvalid) as info:
        load(directory, text, table)
    return info.value.problems


def by_id(preset_file: PresetFile) -> dict[str, ModelPreset]:
    return {s.name: preset_file.merged(s) for s in preset_file.models}


# --- a valid file ---------------------------------------------------------------------------

VALID = """\
version = 1
; a comment line
# another comment line
[*]
ctx-size = 4096
LLAMA_ARG_N_PARALLEL = 2
stop-timeout = 7.5

[alpha]
model = m.gguf
c = 8192
embeddings = true
no-kv-unified = true
alias = a1, a2 ,, a3
tags = chat, small
load-on-startup = on
load-timeout = 30

[beta]
m = sub/b.gguf
__PRESET_LOAD_ON_STARTUP = 1
webui = off
"""


def test_valid_file_sections_and_defaults(tmp_path: Path, help_table: FlagTable) -> None:
    model_file(tmp_path)
    model_file(tmp_path, "sub/b.gguf")
    preset_file = load(tmp_path, VALID, help_table)
    assert preset_file.path == tmp_path / "presets.ini"
    assert preset_file.warnings == []
    assert preset_file.defaults is not None
    assert preset_file.defaults.name == "*"
    assert preset_file.defaults.args == {"ctx-size": "4096", "parallel": "2"}
    assert preset_file.defaults.options == {"stop_timeout": 7.5}
    assert [s.name for s in preset_file.models] == ["alpha", "beta"]
    assert preset_file.models[0].origin == Origin(tmp_path / "presets.ini", 9)


def test_valid_file_merged_alpha(tmp_path: Path, help_table: FlagTable) -> None:
    model_file(tmp_path)
    model_file(tmp_path, "sub/b.gguf")
    alpha = by_id(load(tmp_path, VALID, help_table))["alpha"]
    assert alpha.id == "alpha"
    assert alpha.source == "preset"
    assert dict(alpha.args) == {
        "ctx-size": "8192",  # the short key `c` beats [*]'s ctx-size
        "parallel": "2",  # LLAMA_ARG_N_PARALLEL from [*]
        "model": str(tmp_path / "m.gguf"),
        "embeddings": "true",
        "kv-unified": "false",  # no-kv-unified = true inverts
    }
    assert alpha.model_path == str(tmp_path / "m.gguf")
    assert alpha.hf_repo is None
    assert alpha.aliases == ("a1", "a2", "a3")
    assert alpha.tags == ("chat", "small")
    assert alpha.load_on_startup is True
    assert alpha.load_timeout == 30.0
    assert alpha.stop_timeout == 7.5  # from [*]
    # preset-only keys never reach the child
    for key in ("alias", "tags", "load-on-startup", "load-timeout", "stop-timeout"):
        assert key not in alpha.args


def test_valid_file_merged_beta(tmp_path: Path, help_table: FlagTable) -> None:
    model_file(tmp_path)
    model_file(tmp_path, "sub/b.gguf")
    beta = by_id(load(tmp_path, VALID, help_table))["beta"]
    assert beta.model_path == str(tmp_path / "sub" / "b.gguf")
    assert beta.args["ctx-size"] == "4096"
    assert beta.args["webui"] == "false"
    assert beta.load_on_startup is True  # __PRESET_LOAD_ON_STARTUP env form
    assert beta.load_timeout is None
    assert beta.aliases == ()


def test_merged_args_are_read_only(tmp_path: Path, help_table: FlagTable) -> None:
    model_file(tmp_path)
    alpha = by_id(load(tmp_path, "[alpha]\nmodel = m.gguf\n", help_table))["alpha"]
    with pytest.raises(TypeError):
        alpha.args["ctx-size"] = "1"  # type: ignore[index]


@pytest.mark.parametrize(("value", "expected"), [
    ("true", "true"), ("false", "false"), ("on", "true"), ("off", "false"),
    ("1", "true"), ("0", "false"), ("TRUE", "true"), ("Off", "false"),
    ("yes", "true"), ("no", "false"), ("enabled", "true"), ("disabled", "false"),
])
def test_boolean_values(tmp_path: Path, help_table: FlagTable, value: str,
                        expected: str) -> None:
    model_file(tmp_path)
    preset_file = load(tmp_path, f"[a]\nmodel = m.gguf\nembeddings = {value}\n", help_table)
    assert preset_file.models[0].args["embeddings"] == expected


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("kv-unified", "true", "true"),
    ("kv-unified", "false", "false"),
    ("no-kv-unified", "true", "false"),
    ("no-kv-unified", "false", "true"),
    ("no-kvu", "on", "false"),
    ("kvu", "1", "true"),
    ("LLAMA_ARG_KV_UNIFIED", "0", "false"),
    ("LLAMA_ARG_NO_KV_UNIFIED", "1", "false"),
    ("LLAMA_ARG_NO_KV_UNIFIED", "0", "true"),
])
def test_negative_spellings_invert(tmp_path: Path, help_table: FlagTable, key: str, value: str,
                                   expected: str) -> None:
    model_file(tmp_path)
    preset_file = load(tmp_path, f"[a]\nmodel = m.gguf\n{key} = {value}\n", help_table)
    assert preset_file.models[0].args == {"model": str(tmp_path / "m.gguf"),
                                          "kv-unified": expected}


@pytest.mark.parametrize("key", ["ctx-size", "c", "LLAMA_ARG_CTX_SIZE"])
def test_short_long_and_env_keys_store_canonical(tmp_path: Path, help_table: FlagTable,
                                                 key: str) -> None:
    model_file(tmp_path)
    preset_file = load(tmp_path, f"[a]\nmodel = m.gguf\n{key} = 123\n", help_table)
    assert preset_file.models[0].args["ctx-size"] == "123"


def test_hf_repo_source(tmp_path: Path, help_table: FlagTable) -> None:
    preset_file = load(tmp_path, "[a]\nhf = owner/repo:Q4_K_M\n", help_table)
    model = preset_file.merged(preset_file.models[0])
    assert model.hf_repo == "owner/repo:Q4_K_M"
    assert model.model_path is None


def test_absolute_model_path_kept(tmp_path: Path, help_table: FlagTable) -> None:
    elsewhere = model_file(tmp_path / "elsewhere", "x.gguf")
    presets_dir = tmp_path / "conf"
    presets_dir.mkdir()
    preset_file = load(presets_dir, f"[a]\nmodel = {elsewhere}\n", help_table)
    assert preset_file.models[0].args["model"] == str(elsewhere)


def test_relative_paths_resolve_against_the_file(tmp_path: Path, help_table: FlagTable,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "conf"
    model_file(conf, "models/m.gguf")
    model_file(conf, "models/mmproj.gguf")
    other = tmp_path / "cwd"
    other.mkdir()
    monkeypatch.chdir(other)
    preset_file = load(conf, "[a]\nmodel = models/m.gguf\nmmproj = models/mmproj.gguf\n",
                       help_table)
    args = preset_file.models[0].args
    assert args["model"] == str(conf / "models" / "m.gguf")
    assert args["mmproj"] == str(conf / "models" / "mmproj.gguf")


def test_preset_path_itself_may_be_relative(tmp_path: Path, help_table: FlagTable,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    model_file(tmp_path)
    write(tmp_path, "[a]\nmodel = m.gguf\n")
    monkeypatch.chdir(tmp_path)
    preset_file = load_preset_file(Path("presets.ini"), help_table)
    assert preset_file.path == tmp_path / "presets.ini"
    assert preset_file.models[0].args["model"] == str(tmp_path / "m.gguf")


def test_inline_comments_only_after_whitespace(tmp_path: Path, help_table: FlagTable) -> None:
    model_file(tmp_path)
    text = ("[a] ; header comment\n"
            "model = m.gguf # trailing comment\n"
            "samplers = top_k;top_p\n"
            "ctx-size = 512 ; comment\n"
            "chat-template-kwargs = {\"x\":1}#not-a-comment\n"
            "    batch-size = 64\t; tab before comment\n")
    args = load(tmp_path, text, help_table).models[0].args
    assert args["model"] == str(tmp_path / "m.gguf")
    assert args["samplers"] == "top_k;top_p"
    assert args["ctx-size"] == "512"
    assert args["chat-template-kwargs"] == '{"x":1}#not-a-comment'
    assert args["batch-size"] == "64"


def test_quoted_values(tmp_path: Path, help_table: FlagTable) -> None:
    model_file(tmp_path)
    text = ('[a]\nmodel = "m.gguf"\n'
            'samplers = "top_k ; top_p # all kept"\n'
            'chat-template = "hello world" ; trailing comment\n'
            'reasoning-format = ""\n')
    args = load(tmp_path, text, help_table).models[0].args
    assert args["model"] == str(tmp_path / "m.gguf")
    assert args["samplers"] == "top_k ; top_p # all kept"
    assert args["chat-template"] == "hello world"
    assert args["reasoning-format"] == ""


def test_utf8_bom_and_version(tmp_path: Path, help_table: FlagTable) -> None:
    model_file(tmp_path)
    path = tmp_path / "bom.ini"
    path.write_bytes(b"\xef\xbb\xbfversion = 1\n[a]\nmodel = m.gguf\n")
    preset_file = load_preset_file(path, help_table)
    assert [s.name for s in preset_file.models] == ["a"]


def test_no_defaults_section(tmp_path: Path, help_table: FlagTable) -> None:
    model_file(tmp_path)
    preset_file = load(tmp_path, "[a]\nmodel = m.gguf\n", help_table)
    assert preset_file.defaults is None
    assert dict(preset_file.merged(preset_file.models[0]).args) == {
        "model": str(tmp_path / "m.gguf")}


def test_empty_file(tmp_path: Path, help_table: FlagTable) -> None:
    preset_file = load(tmp_path, "", help_table)
    assert preset_file.defaults is None
    assert preset_file.models == []


@pytest.mark.parametrize(("raw", "expected"), [
    ("u/r:q4_k_m", "u/r:Q4_K_M"),
    ("u/r:Q4_K_M", "u/r:Q4_K_M"),
    ("plain-name", "plain-name"),
    ("*", "*"),
])
def test_canonical_model_id(raw: str, expected: str) -> None:
    assert canonical_model_id(raw) == expected


def test_section_names_are_canonicalised(tmp_path: Path, help_table: FlagTable) -> None:
    preset_file = load(tmp_path, "[ u/r:q4_k_m ]\nhf-repo = u/r:q4_k_m\n", help_table)
    assert [s.name for s in preset_file.models] == ["u/r:Q4_K_M"]


def test_router_owned_keys_warn_and_are_dropped(tmp_path: Path, help_table: FlagTable) -> None:
    model_file(tmp_path)
    text = ("[*]\nport = 9999\n"
            "[a]\nmodel = m.gguf\nhost = 0.0.0.0\napi-key = secret\nLLAMA_ARG_PORT = 1\n")
    preset_file = load(tmp_path, text, help_table)
    assert preset_file.defaults is not None
    assert preset_file.defaults.args == {}
    assert preset_file.models[0].args == {"model": str(tmp_path / "m.gguf")}
    warned = [(w.origin.line, w.section, w.key) for w in preset_file.warnings]
    assert warned == [(2, "*", "port"), (5, "a", "host"), (6, "a", "api-key"),
                      (7, "a", "LLAMA_ARG_PORT")]
    text_of = str(preset_file.warnings[1])
    assert f"{tmp_path / 'presets.ini'}:5" in text_of
    assert "[a]" in text_of and "host" in text_of and "ignored" in text_of


def test_dedup_cache_models_is_a_preset_option(tmp_path: Path, help_table: FlagTable) -> None:
    model_file(tmp_path)
    preset_file = load(tmp_path, "[*]\ndedup-cache-models = true\n[a]\nmodel = m.gguf\n",
                       help_table)
    assert preset_file.defaults is not None
    assert preset_file.defaults.options == {"dedup_cache_models": True}
    assert preset_file.defaults.args == {}  # never passed to a child


def test_warm_swaps_is_a_preset_option(tmp_path: Path, help_table: FlagTable) -> None:
    model_file(tmp_path)
    preset_file = load(tmp_path, "[*]\nwarm-swaps = false\n[a]\nmodel = m.gguf\n"
                       "[b]\nmodel = m.gguf\nwarm-swaps = true\n", help_table)
    models = by_id(preset_file)
    assert not models["a"].warm_swaps and models["b"].warm_swaps
    assert "warm-swaps" not in models["a"].args  # never passed to a child
    [problem] = problems_of(tmp_path, "[a]\nmodel = m.gguf\nwarm-swaps = sometimes\n",
                            help_table)
    assert (problem.origin.line, problem.section, problem.key) == (3, "a", "warm-swaps")


def test_pin_and_min_resident_are_preset_options(tmp_path: Path, help_table: FlagTable
                                                ) -> None:
    """Residency: ``pin`` a boolean, ``min-resident`` seconds (also in ``[*]`` and by their
    pseudo-environment names), never passed to a child; a bad value names file, line and key."""
    model_file(tmp_path)
    preset_file = load(tmp_path, "[*]\nmin-resident = 30\n[a]\nmodel = m.gguf\npin = true\n"
                       "[b]\nmodel = m.gguf\n__PRESET_MIN_RESIDENT = 2.5\n"
                       "[c]\nmodel = m.gguf\n__PRESET_PIN = on\n", help_table)
    models = by_id(preset_file)
    assert (models["a"].pin, models["a"].min_resident) == (True, 30.0)
    assert (models["b"].pin, models["b"].min_resident) == (False, 2.5)
    assert models["c"].pin
    assert not {"pin", "min-resident"} & set(models["a"].args)  # never passed to a child
    path = tmp_path / "presets.ini"
    [problem] = problems_of(tmp_path, "[a]\nhf = o/r\npin = always\n", help_table)
    assert_names(problem, path, 3, "a", "pin", "bad boolean 'always'")
    [problem] = problems_of(tmp_path, "[a]\nhf = o/r\nmin-resident = 1m\n", help_table)
    assert_names(problem, path, 3, "a", "min-resident", "bad number of seconds")
    [problem] = problems_of(tmp_path, "[a]\nhf = o/r\nmin-resident = -5\n", help_table)
    assert_names(problem, path, 3, "a", "min-resident", "finite number >= 0")


def test_interactive_slots_keep_the_other_classes_a_slot(tmp_path: Path,
                                                        help_table: FlagTable) -> None:
    """``interactive-slots`` (here or in ``[*]``) must be fewer than the children's slots
    (``parallel``, llama-server's 4 when unset): refused naming its own line otherwise."""
    model_file(tmp_path)
    models = by_id(load(tmp_path, "[*]\ninteractive-slots = 1\n[a]\nmodel = m.gguf\n"
                        "parallel = 2\n[b]\nmodel = m.gguf\ninteractive-slots = 0\n", help_table))
    assert (models["a"].interactive_slots, models["a"].slots) == (1, 2)
    assert (models["b"].interactive_slots, models["b"].slots) == (0, 4)
    assert "interactive-slots" not in models["a"].args  # never passed to a child
    [problem] = problems_of(tmp_path, "[*]\nparallel = 2\n[a]\nmodel = m.gguf\n"
                            "interactive-slots = 2\n", help_table)
    assert (problem.origin.line, problem.section, problem.key) == (5, "a", "interactive-slots")
    assert "leaves no slot for the other classes" in str(problem) and "at most 1" in str(problem)
    [problem] = problems_of(tmp_path, "[*]\ninteractive-slots = 4\n[a]\nmodel = m.gguf\n",
                            help_table)  # llama-server's own 4 slots
    assert (problem.origin.line, problem.key) == (2, "interactive-slots")
    [problem] = problems_of(tmp_path, "[a]\nmodel = m.gguf\ninteractive-slots = -1\n",
                            help_table)
    assert problem.key == "interactive-slots" and ">= 0" in str(problem)


def test_alias_short_and_env_spellings_set_aliases(tmp_path: Path,
                                                   help_table: FlagTable) -> None:
    preset_file = load(tmp_path, "[a]\nhf = o/r\na = x, y\n[b]\nhf = o/s\nLLAMA_ARG_ALIAS = z\n",
                       help_table)
    models = by_id(preset_file)
    assert models["a"].aliases == ("x", "y")
    assert models["b"].aliases == ("z",)


# --- errors -----------------------------------------------------------------------------------

def assert_names(problem: PresetProblem, path: Path, line: int, section: str | None,
                 key: str | None, *fragments: str) -> None:
    text = str(problem)
    assert problem.origin == Origin(path, line)
    assert text.startswith(f"{path}:{line}:")
    assert problem.section == section
    assert problem.key == key
    if section is not None:
        assert f"[{section}]" in text
    if key is not None:
        assert f" {key}:" in text
    for fragment in fragments:
        assert fragment in text


def test_unknown_key_suggests(tmp_path: Path, help_table: FlagTable) -> None:
    [problem] = problems_of(tmp_path, "[a]\nhf = o/r\nctx-sise = 5\n", help_table)
    assert_names(problem, tmp_path / "presets.ini", 3, "a", "ctx-sise", "unknown key",
                 "did you mean ctx-size")


def test_unknown_key_suggests_preset_only_keys(tmp_path: Path, help_table: FlagTable) -> None:
    [problem] = problems_of(tmp_path, "[a]\nhf = o/r\nload-on-startp = true\n", help_table)
    assert "did you mean load-on-startup" in str(problem)


def test_unknown_key_without_close_match(tmp_path: Path, help_table: FlagTable) -> None:
    [problem] = problems_of(tmp_path, "[a]\nhf = o/r\nzzzzqqq = 5\n", help_table)
    assert_names(problem, tmp_path / "presets.ini", 3, "a", "zzzzqqq", "unknown key")
    assert "did you mean" not in str(problem)


@pytest.mark.parametrize("key", ["embeddings", "load-on-startup", "no-kv-unified"])
def test_bad_boolean(tmp_path: Path, help_table: FlagTable, key: str) -> None:
    [problem] = problems_of(tmp_path, f"[a]\nhf = o/r\n{key} = maybe\n", help_table)
    assert_names(problem, tmp_path / "presets.ini", 3, "a", key, "bad boolean 'maybe'")


@pytest.mark.parametrize(("value", "fragment"), [("soon", "bad number of seconds"),
                                                 ("-1", "finite number >= 0")])
def test_bad_seconds(tmp_path: Path, help_table: FlagTable, value: str, fragment: str) -> None:
    [problem] = problems_of(tmp_path, f"[a]\nhf = o/r\nstop-timeout = {value}\n", help_table)
    assert_names(problem, tmp_path / "presets.ini", 3, "a", "stop-timeout", fragment)


def test_nan_seconds_rejected(tmp_path: Path, help_table: FlagTable) -> None:
    problems_of(tmp_path, "[a]\nhf = o/r\nload-timeout = nan\n", help_table)


def test_key_outside_any_section(tmp_path: Path, help_table: FlagTable) -> None:
    [problem] = problems_of(tmp_path, "ctx-size = 5\n[a]\nhf = o/r\n", help_table)
    assert_names(problem, tmp_path / "presets.ini", 1, None, "ctx-size",
                 "key outside any section")


def test_repeated_section(tmp_path: Path, help_table: FlagTable) -> None:
    [problem] = problems_of(tmp_path, "[a]\nhf = o/r\n\n[a]\nc = 1\n", help_table)
    assert_names(problem, tmp_path / "presets.ini", 4, "a", None, "section repeated",
                 "line 1")


def test_repeated_section_after_canonicalisation(tmp_path: Path,
                                                 help_table: FlagTable) -> None:
    [problem] = problems_of(tmp_path, "[u/r:q4_0]\nhf = u/r:q4_0\n[u/r:Q4_0]\nc = 1\n",
                            help_table)
    assert_names(problem, tmp_path / "presets.ini", 3, "u/r:Q4_0", None, "section repeated")


def test_repeated_key(tmp_path: Path, help_table: FlagTable) -> None:
    [problem] = problems_of(tmp_path, "[a]\nhf = o/r\nc = 1\nc = 2\n", help_table)
    assert_names(problem, tmp_path / "presets.ini", 4, "a", "c", "key repeated", "line 3")


def test_model_file_missing(tmp_path: Path, help_table: FlagTable) -> None:
    [problem] = problems_of(tmp_path, "[a]\nmodel = nope.gguf\n", help_table)
    assert_names(problem, tmp_path / "presets.ini", 2, "a", "model", "file does not exist",
                 str(tmp_path / "nope.gguf"))


def test_model_path_is_a_directory(tmp_path: Path, help_table: FlagTable) -> None:
    (tmp_path / "dir.gguf").mkdir()
    [problem] = problems_of(tmp_path, "[a]\nmodel = dir.gguf\n", help_table)
    assert_names(problem, tmp_path / "presets.ini", 2, "a", "model", "file does not exist")


def test_preset_file_missing(tmp_path: Path, help_table: FlagTable) -> None:
    path = tmp_path / "absent.ini"
    with pytest.raises(PresetsInvalid) as info:
        load_preset_file(path, help_table)
    [problem] = info.value.problems
    assert problem.origin == Origin(path, 0)
    assert str(path) in str(problem)
    assert "file does not exist" in str(problem)


def test_preset_file_not_utf8(tmp_path: Path, help_table: FlagTable) -> None:
    path = tmp_path / "latin1.ini"
    path.write_bytes(b"[a]\nhf = o/r\nchat-template = \xff\xfe\xfa\n")
    with pytest.raises(PresetsInvalid, match="cannot read"):
        load_preset_file(path, help_table)


@pytest.mark.parametrize("key", ["model", "hf-repo"])
def test_source_key_in_defaults(tmp_path: Path, help_table: FlagTable, key: str) -> None:
    model_file(tmp_path)
    value = "m.gguf" if key == "model" else "o/r"
    [problem] = problems_of(tmp_path, f"[*]\n{key} = {value}\n[a]\nc = 1\n", help_table)
    assert problem.section == "*"
    assert problem.key == key
    assert str(problem).startswith(f"{tmp_path / 'presets.ini'}:")
    assert f"[*] {key}:" in str(problem)
    assert "cannot be a default" in str(problem)


def test_source_key_in_defaults_names_the_key_line(tmp_path: Path,
                                                   help_table: FlagTable) -> None:
    [problem] = problems_of(tmp_path, "[*]\nc = 1\nhf-repo = o/r\n", help_table)
    assert problem.origin.line == 3


@pytest.mark.parametrize("value", ["2", "1.0", "one"])
def test_unsupported_version(tmp_path: Path, help_table: FlagTable, value: str) -> None:
    [problem] = problems_of(tmp_path, f"version = {value}\n[a]\nhf = o/r\n", help_table)
    assert_names(problem, tmp_path / "presets.ini", 1, None, "version",
                 f"unsupported version {value!r}")


def test_unparseable_line(tmp_path: Path, help_table: FlagTable) -> None:
    [problem] = problems_of(tmp_path, "[a]\nhf = o/r\njust some words\n", help_table)
    assert_names(problem, tmp_path / "presets.ini", 3, None, None, "cannot parse line",
                 "just some words")


def test_all_problems_are_reported(tmp_path: Path, help_table: FlagTable) -> None:
    text = ("stray = 1\n"            # 1 key outside any section
            "[a]\n"                  # 2
            "hf = o/r\n"             # 3
            "ctx-sise = 5\n"         # 4 unknown key
            "embeddings = maybe\n"   # 5 bad boolean
            "c = 1\n"                # 6
            "c = 2\n"                # 7 repeated key
            "[b]\n"                  # 8
            "model = missing.gguf\n"  # 9 missing file
            "[a]\n")                 # 10 repeated section
    problems = problems_of(tmp_path, text, help_table)
    found = {(p.origin.line, p.section, p.key) for p in problems}
    assert found == {(1, None, "stray"), (4, "a", "ctx-sise"), (5, "a", "embeddings"),
                     (7, "a", "c"), (9, "b", "model"), (10, "a", None)}
    with pytest.raises(PresetsInvalid) as info:
        load_preset_file(tmp_path / "presets.ini", help_table)
    message = str(info.value)
    assert len(message.splitlines()) == len(problems) == 6
    assert "did you mean ctx-size" in message


def test_presets_invalid_is_a_value_error() -> None:
    problem = PresetProblem(Origin(Path("/x.ini"), 3), "boom", "s", "k")
    error = PresetsInvalid([problem])
    assert isinstance(error, ValueError)
    assert str(error) == "/x.ini:3: [s] k: boom"
    assert str(PresetProblem(Origin(Path("/x.ini"), 0), "gone")) == "/x.ini:0: gone"


def test_parse_ini_keeps_raw_entries(tmp_path: Path) -> None:
    path = write(tmp_path, "[s]\nno-kvu = on\nc = 5 ; x\n")
    sections, problems = parse_ini(path)
    assert problems == []
    [section] = sections
    assert section.name == "s"
    assert section.origin == Origin(path, 1)
    assert [(k, v, o.line) for k, v, o in section.entries] == [("no-kvu", "on", 2),
                                                                ("c", "5", 3)]
