"""Unit tests for router.config.sources: models-dir scanning and catalogue merging."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from router.config.presets import Origin, PresetsInvalid
from router.config.sources import Catalogue, build_catalogue, safe_id, scan_models_dir
from router.llama.flags import FlagTable


def touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- scan_models_dir ---------------------------------------------------------------------------

@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    touch(root / "alpha.gguf")
    touch(root / "mmproj-alpha-f16.gguf")
    touch(root / "mtp-alpha.gguf")
    touch(root / "notes.txt")
    touch(root / "big" / "big-00001-of-00002.gguf")
    touch(root / "big" / "big-00002-of-00002.gguf")
    touch(root / "vision" / "vision-q4.gguf")
    touch(root / "vision" / "mmproj-vision-f16.gguf")
    touch(root / "empty" / "readme.md")
    touch(root / "only-projector" / "mmproj-x.gguf")
    return root


def test_scan_models_dir(models_dir: Path) -> None:
    found = {m.id: m for m in scan_models_dir(models_dir)}
    assert sorted(found) == ["alpha", "big", "vision"]
    assert dict(found["alpha"].args) == {"model": str(models_dir / "alpha.gguf")}
    assert dict(found["big"].args) == {"model": str(models_dir / "big" /
                                                    "big-00001-of-00002.gguf")}
    assert dict(found["vision"].args) == {
        "model": str(models_dir / "vision" / "vision-q4.gguf"),
        "mmproj": str(models_dir / "vision" / "mmproj-vision-f16.gguf"),
    }
    for model in found.values():
        assert model.source == "models_dir"
        assert model.origin is not None and model.origin.line == 0
    assert found["alpha"].origin == Origin(models_dir / "alpha.gguf", 0)
    assert found["big"].origin == Origin(models_dir / "big", 0)


def test_scan_picks_first_shard_whatever_the_listing_order(tmp_path: Path) -> None:
    root = tmp_path / "models"
    for n in (3, 1, 2):
        touch(root / "x" / f"x-0000{n}-of-00003.gguf")
    [model] = scan_models_dir(root)
    assert model.model_path == str(root / "x" / "x-00001-of-00003.gguf")


def test_scan_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(PresetsInvalid) as info:
        scan_models_dir(tmp_path / "nope")
    [problem] = info.value.problems
    assert problem.origin == Origin(tmp_path / "nope", 0)
    assert "models directory does not exist" in str(problem)


def test_scan_empty_directory(tmp_path: Path) -> None:
    assert scan_models_dir(tmp_path) == []


# --- build_catalogue: presets -----------------------------------------------------------------

def test_defaults_model_section_and_overrides(tmp_path: Path, help_table: FlagTable) -> None:
    touch(tmp_path / "a.gguf")
    presets = write(tmp_path / "p.ini", "[*]\nctx-size = 100\nbatch-size = 64\nembeddings = on\n"
                    "[a]\nmodel = a.gguf\nctx-size = 200\n"
                    "[b]\nhf-repo = o/r:Q4_K_M\n")
    overrides = help_table.parse_argv(["--ctx-size", "999"])
    catalogue = build_catalogue([presets], [], help_table, overrides)
    assert sorted(catalogue.models) == ["a", "b"]
    a, b = catalogue.models["a"], catalogue.models["b"]
    assert dict(a.args) == {"ctx-size": "999", "batch-size": "64", "embeddings": "true",
                            "model": str(tmp_path / "a.gguf")}
    assert dict(b.args) == {"ctx-size": "999", "batch-size": "64", "embeddings": "true",
                            "hf-repo": "o/r:Q4_K_M"}


def test_model_section_beats_defaults(tmp_path: Path, help_table: FlagTable) -> None:
    presets = write(tmp_path / "p.ini", "[*]\nctx-size = 100\nkv-unified = true\n"
                    "[a]\nhf = o/r\nc = 200\nno-kvu = true\n"
                    "[b]\nhf = o/s\n")
    catalogue = build_catalogue([presets], [], help_table)
    assert catalogue.models["a"].args["ctx-size"] == "200"
    assert catalogue.models["a"].args["kv-unified"] == "false"
    assert catalogue.models["b"].args["ctx-size"] == "100"
    assert catalogue.models["b"].args["kv-unified"] == "true"


def test_negative_override_beats_preset(tmp_path: Path, help_table: FlagTable) -> None:
    presets = write(tmp_path / "p.ini", "[a]\nhf = o/r\nkv-unified = true\n")
    overrides = help_table.parse_argv(["--no-kv-unified"])
    catalogue = build_catalogue([presets], [], help_table, overrides)
    assert catalogue.models["a"].args["kv-unified"] == "false"


def test_defaults_of_one_file_apply_to_models_of_another(tmp_path: Path,
                                                         help_table: FlagTable) -> None:
    first = write(tmp_path / "one.ini", "[*]\nbatch-size = 32\n[a]\nhf = o/a\n")
    second = write(tmp_path / "two.ini", "[b]\nhf = o/b\n")
    catalogue = build_catalogue([first, second], [], help_table)
    assert catalogue.models["b"].args["batch-size"] == "32"


def test_preset_only_options_survive(tmp_path: Path, help_table: FlagTable) -> None:
    presets = write(tmp_path / "p.ini", "[*]\nstop-timeout = 3\n"
                    "[a]\nhf = o/r\nload-on-startup = true\ntags = x, y\n")
    model = build_catalogue([presets], [], help_table).models["a"]
    assert model.load_on_startup is True
    assert model.stop_timeout == 3.0
    assert model.tags == ("x", "y")
    assert model.source == "preset"
    assert model.origin == Origin(tmp_path / "p.ini", 3)


def test_warnings_are_collected(tmp_path: Path, help_table: FlagTable) -> None:
    presets = write(tmp_path / "p.ini", "[a]\nhf = o/r\nport = 1234\n")
    catalogue = build_catalogue([presets], [], help_table)
    assert [(w.section, w.key) for w in catalogue.warnings] == [("a", "port")]
    assert "port" not in catalogue.models["a"].args


def test_no_sources_gives_an_empty_catalogue(help_table: FlagTable) -> None:
    catalogue = build_catalogue([], [], help_table)
    assert catalogue.models == {}
    assert catalogue.aliases == {}
    assert catalogue.warnings == ()


# --- build_catalogue: models dirs -------------------------------------------------------------

def test_models_dir_gets_defaults_and_overrides(tmp_path: Path, help_table: FlagTable,
                                                models_dir: Path) -> None:
    presets = write(tmp_path / "p.ini", "[*]\nctx-size = 100\nbatch-size = 64\n")
    overrides = help_table.parse_argv(["-c", "999"])
    catalogue = build_catalogue([presets], [models_dir], help_table, overrides)
    assert sorted(catalogue.models) == ["alpha", "big", "vision"]
    alpha = catalogue.models["alpha"]
    assert dict(alpha.args) == {"ctx-size": "999", "batch-size": "64",
                                "model": str(models_dir / "alpha.gguf")}
    assert alpha.source == "models_dir"


def test_preset_section_merges_into_models_dir_entry(tmp_path: Path, help_table: FlagTable,
                                                     models_dir: Path) -> None:
    presets = write(tmp_path / "p.ini", "[*]\nbatch-size = 64\n"
                    "[vision]\nctx-size = 333\nalias = eyes\nload-on-startup = true\n")
    catalogue = build_catalogue([presets], [models_dir], help_table)
    vision = catalogue.models["vision"]
    assert vision.source == "preset"
    assert vision.origin == Origin(tmp_path / "p.ini", 3)
    assert dict(vision.args) == {
        "model": str(models_dir / "vision" / "vision-q4.gguf"),
        "mmproj": str(models_dir / "vision" / "mmproj-vision-f16.gguf"),
        "ctx-size": "333",
        "batch-size": "64",
    }
    assert vision.aliases == ("eyes",)
    assert vision.load_on_startup is True
    assert catalogue.resolve("eyes") == "vision"
    # untouched models-dir entries keep their source
    assert catalogue.models["alpha"].source == "models_dir"


def test_preset_model_key_beats_models_dir_path(tmp_path: Path, help_table: FlagTable,
                                                models_dir: Path) -> None:
    touch(tmp_path / "other.gguf")
    presets = write(tmp_path / "p.ini", "[alpha]\nmodel = other.gguf\n")
    catalogue = build_catalogue([presets], [models_dir], help_table)
    assert catalogue.models["alpha"].model_path == str(tmp_path / "other.gguf")


def test_later_models_dir_wins_for_the_same_id(tmp_path: Path, help_table: FlagTable) -> None:
    touch(tmp_path / "one" / "m.gguf")
    touch(tmp_path / "two" / "m.gguf")
    catalogue = build_catalogue([], [tmp_path / "one", tmp_path / "two"], help_table)
    assert catalogue.models["m"].model_path == str(tmp_path / "two" / "m.gguf")


def test_defaults_preset_options_apply_to_models_dir(tmp_path: Path, help_table: FlagTable,
                                                     models_dir: Path) -> None:
    presets = write(tmp_path / "p.ini", "[*]\nstop-timeout = 5\nload-timeout = 60\n")
    alpha = build_catalogue([presets], [models_dir], help_table).models["alpha"]
    assert alpha.stop_timeout == 5.0
    assert alpha.load_timeout == 60.0


# --- build_catalogue: errors ------------------------------------------------------------------

def test_missing_model_source(tmp_path: Path, help_table: FlagTable) -> None:
    presets = write(tmp_path / "p.ini", "[ok]\nhf = o/r\n\n[nosrc]\nctx-size = 5\n")
    with pytest.raises(PresetsInvalid) as info:
        build_catalogue([presets], [], help_table)
    [problem] = info.value.problems
    assert problem.origin == Origin(tmp_path / "p.ini", 4)
    assert problem.section == "nosrc"
    text = str(problem)
    assert text.startswith(f"{tmp_path / 'p.ini'}:4:")
    assert "[nosrc]" in text
    assert "no model source" in text


def test_override_model_satisfies_source(tmp_path: Path, help_table: FlagTable) -> None:
    touch(tmp_path / "x.gguf")
    presets = write(tmp_path / "p.ini", "[nosrc]\nctx-size = 5\n")
    overrides = help_table.parse_argv(["-m", str(tmp_path / "x.gguf")])
    catalogue = build_catalogue([presets], [], help_table, overrides)
    assert catalogue.models["nosrc"].model_path == str(tmp_path / "x.gguf")


def test_alias_colliding_with_a_model_id(tmp_path: Path, help_table: FlagTable) -> None:
    presets = write(tmp_path / "p.ini", "[a]\nhf = o/a\nalias = b\n[b]\nhf = o/b\n")
    with pytest.raises(PresetsInvalid) as info:
        build_catalogue([presets], [], help_table)
    [problem] = info.value.problems
    assert problem.section == "a"
    assert problem.key == "alias"
    assert problem.origin == Origin(tmp_path / "p.ini", 1)
    assert "alias 'b'" in str(problem) and "model 'b'" in str(problem)


def test_alias_colliding_with_a_models_dir_id(tmp_path: Path, help_table: FlagTable,
                                              models_dir: Path) -> None:
    presets = write(tmp_path / "p.ini", "[a]\nhf = o/a\nalias = alpha\n")
    with pytest.raises(PresetsInvalid, match="alias 'alpha'"):
        build_catalogue([presets], [models_dir], help_table)


def test_alias_used_twice(tmp_path: Path, help_table: FlagTable) -> None:
    presets = write(tmp_path / "p.ini", "[a]\nhf = o/a\nalias = shared\n"
                    "[b]\nhf = o/b\nalias = shared\n")
    with pytest.raises(PresetsInvalid) as info:
        build_catalogue([presets], [], help_table)
    [problem] = info.value.problems
    assert problem.section == "b"
    assert "alias 'shared'" in str(problem)
    assert "model 'a'" in str(problem)


def test_same_section_in_two_files(tmp_path: Path, help_table: FlagTable) -> None:
    first = write(tmp_path / "one.ini", "[dup]\nhf = o/r\n")
    second = write(tmp_path / "two.ini", "\n[dup]\nhf = o/s\n")
    with pytest.raises(PresetsInvalid) as info:
        build_catalogue([first, second], [], help_table)
    [problem] = info.value.problems
    assert problem.origin == Origin(tmp_path / "two.ini", 2)
    assert problem.section == "dup"
    assert f"model also defined at {tmp_path / 'one.ini'}:1" in str(problem)


def test_problems_from_every_source_are_reported(tmp_path: Path,
                                                 help_table: FlagTable) -> None:
    first = write(tmp_path / "one.ini", "[a]\nhf = o/r\nbogus-key = 1\n")
    second = write(tmp_path / "two.ini", "[b]\nhf = o/r\nembeddings = maybe\n")
    with pytest.raises(PresetsInvalid) as info:
        build_catalogue([first, second, tmp_path / "missing.ini"], [tmp_path / "nodir"],
                        help_table)
    paths = {p.origin.path for p in info.value.problems}
    assert paths == {tmp_path / "one.ini", tmp_path / "two.ini", tmp_path / "missing.ini",
                     tmp_path / "nodir"}


# --- Catalogue ----------------------------------------------------------------------------------

def test_resolve_and_close_matches(tmp_path: Path, help_table: FlagTable) -> None:
    presets = write(tmp_path / "p.ini", "[qwen-7b]\nhf = o/q\nalias = qwen, q7\n"
                    "[llama-3b]\nhf = o/l\n")
    catalogue = build_catalogue([presets], [], help_table)
    assert catalogue.aliases == {"qwen": "qwen-7b", "q7": "qwen-7b"}
    assert catalogue.resolve("qwen-7b") == "qwen-7b"
    assert catalogue.resolve("qwen") == "qwen-7b"
    assert catalogue.resolve("q7") == "qwen-7b"
    assert catalogue.resolve("llama-3b") == "llama-3b"
    assert catalogue.resolve("gpt-4") is None
    assert catalogue.resolve("QWEN") is None
    assert catalogue.close_matches("qwen-7")[:2] == ["qwen-7b", "qwen"]
    assert "llama-3b" in catalogue.close_matches("lama-3b")
    assert catalogue.close_matches("zzzzzz") == []


def test_catalogue_direct() -> None:
    catalogue = Catalogue(models={}, aliases={"x": "y"})
    assert catalogue.resolve("x") == "y"
    assert catalogue.resolve("y") is None


# --- names that are not UTF-8 ----------------------------------------------------------------

def test_a_name_that_is_not_utf8_gets_a_safe_id(tmp_path: Path, help_table: FlagTable) -> None:
    """Served as ``bad\\xff`` with a warning; the path the child opens is the real one."""
    root = tmp_path / "models"
    root.mkdir()
    (Path(os.fsdecode(os.fsencode(root) + b"/bad\xff.gguf"))).touch()
    folder = Path(os.fsdecode(os.fsencode(root) + b"/dir\xfe\xfd"))
    touch(folder / "model.gguf")
    touch(root / "good.gguf")
    catalogue = build_catalogue([], [root], help_table, hf_cache=False)
    assert sorted(catalogue.models) == ["bad\\xff", "dir\\xfe\\xfd", "good"]
    bad = catalogue.models["bad\\xff"]
    assert os.fsencode(bad.args["model"]).endswith(b"/bad\xff.gguf")
    assert Path(bad.args["model"]).is_file()
    warned = sorted(str(w) for w in catalogue.warnings)
    assert len(warned) == 2
    assert "not valid UTF-8: served as model 'bad\\xff'" in warned[0]
    for text in warned:
        text.encode("utf-8")  # printable anywhere


@pytest.mark.parametrize(("name", "expected"), [
    ("plain", "plain"), ("modèle-ü", "modèle-ü"), (os.fsdecode(b"a\xff\xfeb"), "a\\xff\\xfeb")])
def test_safe_id(name: str, expected: str) -> None:
    assert safe_id(name) == expected
    safe_id(name).encode("utf-8")


# --- dedup-cache-models ------------------------------------------------------------------------

@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Hugging Face cache laid out as huggingface-hub writes it (``models--OWNER--REPO/
    snapshots/REVISION/FILE``): a main model in two quants and a draft model in two files."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    for repo, files in (("org--main", ("main-Q8_0.gguf", "main-Q4_K_M.gguf")),
                        ("org--draft", ("draft-Q8_0.gguf", "draft-small-Q4_0.gguf"))):
        for name in files:
            write(cache / f"models--{repo}" / "snapshots" / "abc123" / name, "gguf")
    return cache


def _listed(text: str, tmp_path: Path, table: FlagTable) -> set[str]:
    presets = write(tmp_path / "dedup.ini", text)
    catalogue = build_catalogue([presets], [], table)
    return {model_id for model_id, model in catalogue.models.items() if model.listed}


CACHE_IDS = {"org/main:Q8_0", "org/main:Q4_K_M", "org/draft:Q8_0", "org/draft:Q4_0"}


@pytest.mark.parametrize("draft_key", ["spec-draft-hf", "hfd", "hfrd", "hf-repo-draft",
                                       "LLAMA_ARG_SPEC_DRAFT_HF_REPO"])
@pytest.mark.parametrize("where", ["section", "[*]"])
def test_dedup_cache_models_hides_the_main_and_the_draft_entries(
        hf_cache: Path, tmp_path: Path, help_table: FlagTable, draft_key: str,
        where: str) -> None:
    """The draft's cache entry is hidden whatever the spelling of its key, with the option
    in the model's section or in ``[*]``; the other quants stay listed, and every entry
    stays in the catalogue (usable by its id)."""
    option = "dedup-cache-models = true\n"
    text = ("[*]\n" + (option if where == "[*]" else "")
            + "[mine]\nhf-repo = org/main:Q8_0\n"
            + f"{draft_key} = org/draft:Q8_0\n" + (option if where == "section" else ""))
    assert _listed(text, tmp_path, help_table) == {"mine", "org/main:Q4_K_M", "org/draft:Q4_0"}
    assert _listed(text.replace("true", "false"), tmp_path, help_table) == {"mine", *CACHE_IDS}


def test_dedup_cache_models_follows_the_drafts_file_and_a_draft_in_defaults(
        hf_cache: Path, tmp_path: Path, help_table: FlagTable) -> None:
    """``spec-draft-model`` with ``spec-draft-hf`` names the file in the draft's repo (as
    ``hf-file`` does for ``hf-repo``); a draft in ``[*]`` is every model's draft."""
    text = ("[*]\ndedup-cache-models = true\nspec-draft-hf = org/draft\n"
            "spec-draft-model = draft-small-Q4_0.gguf\n[mine]\nhf-repo = org/main\n"
            "hf-file = main-Q4_K_M.gguf\n")
    assert _listed(text, tmp_path, help_table) == {"mine", "org/main:Q8_0", "org/draft:Q8_0"}
