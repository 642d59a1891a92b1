"""Where models come from: preset files and models directories, merged into one catalogue.

Merge order (as llama.cpp): models-dir entries first; a preset section with the same id merges
into that entry key by key (source becomes ``preset``); ``[*]`` sits under every model; the
router's pass-through args (after ``--`` on its command line) override everything.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

from ..llama.flags import FlagTable, Option
from .downloads import HfRef, ResolveError, cached_models, resolve_cached
from .envvars import NO_ENV
from .presets import (
    SOURCE_KEYS,
    ModelPreset,
    Origin,
    ParsedSection,
    PresetFile,
    PresetProblem,
    PresetsInvalid,
    load_preset_file,
    merge_options,
)

_DRAFT_PREFIXES = ("mtp-", "dspark-", "dflash-")


def safe_id(name: str) -> str:
    """A model id for a file name: the name itself, except that bytes that are not UTF-8
    (which Python keeps as lone surrogates, and no JSON or HTTP answer can carry) are written
    ``\\xNN``: ``bad\\xff`` for a file ``bad<0xff>.gguf``."""
    if name.isascii():
        return name
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def scan_models_dir(directory: Path,
                    warnings: list[PresetProblem] | None = None) -> list[ModelPreset]:
    """Models in ``directory`` by llama.cpp's layout rules.

    * a top-level ``NAME.gguf`` is model ``NAME`` (``mmproj*`` and draft files skipped);
    * a subfolder ``NAME/`` is model ``NAME``: its ``*-00001-of-N.gguf`` first shard or its one
      other GGUF is the model, a file with ``mmproj`` in its name is the projector.

    A name that is not valid UTF-8 is served under ``safe_id`` (its child still opens the
    file by its real name), with a warning added to ``warnings``.
    """
    directory = directory.expanduser().absolute()
    if not directory.is_dir():
        raise PresetsInvalid([PresetProblem(Origin(directory, 0),
                                            "models directory does not exist")])
    models: list[ModelPreset] = []
    for entry in sorted(directory.iterdir()):
        args: dict[str, str] = {}
        if entry.is_file() and entry.name.endswith(".gguf"):
            if "mmproj" in entry.name or entry.name.startswith(_DRAFT_PREFIXES):
                continue
            model_id = entry.name.replace(".gguf", "")
            args["model"] = str(entry)
        elif entry.is_dir():
            model_id = entry.name
            ggufs = sorted(p for p in entry.iterdir() if p.name.endswith(".gguf"))
            mains = [p for p in ggufs
                     if "mmproj" not in p.name and not p.name.startswith(_DRAFT_PREFIXES)]
            shards = [p for p in mains if "-00001-of-" in p.name]
            unsplit = [p for p in mains if "-of-" not in p.name]
            main = shards[0] if shards else (unsplit[0] if unsplit else None)
            if main is None:
                continue
            args["model"] = str(main)
            projectors = [p for p in ggufs if "mmproj" in p.name]
            if projectors:
                args["mmproj"] = str(projectors[0])
        else:
            continue
        if safe_id(model_id) != model_id:
            model_id = safe_id(model_id)
            if warnings is not None:
                warnings.append(PresetProblem(Origin(Path(safe_id(str(entry))), 0),
                                              f"the name is not valid UTF-8: served as model "
                                              f"'{model_id}'"))
        models.append(ModelPreset(id=model_id, args=MappingProxyType(args), source="models_dir",
                                  origin=Origin(entry, 0)))
    return models


@dataclass(frozen=True)
class Catalogue:
    """Every known model by id, plus the alias → id map used for routing; and the names with
    no model of their own (``names``, with their aliases): profiles (``profile-of``: served by
    another model's children) and virtual models (``targets``: one of several models, chosen
    per request)."""

    models: dict[str, ModelPreset]
    aliases: dict[str, str] = field(default_factory=dict)
    warnings: tuple[PresetProblem, ...] = ()
    names: dict[str, ModelPreset] = field(default_factory=dict)
    name_aliases: dict[str, str] = field(default_factory=dict)

    def resolve(self, name: str) -> str | None:
        """Canonical id for a model id or alias, or None (a profile's or a virtual model's
        name is no model's)."""
        if name in self.models:
            return name
        return self.aliases.get(name)

    def named(self, name: str) -> ModelPreset | None:
        """The profile or virtual model a name (its id or an alias) is, or None."""
        found = self.names.get(name)
        if found is None and name in self.name_aliases:
            found = self.names[self.name_aliases[name]]
        return found

    def profile(self, name: str) -> ModelPreset | None:
        """The profile a name is, or None."""
        found = self.named(name)
        return found if found is not None and found.profile_of is not None else None

    def virtual(self, name: str) -> ModelPreset | None:
        """The virtual model a name is, or None."""
        found = self.named(name)
        return found if found is not None and found.targets else None

    @property
    def profiles(self) -> list[ModelPreset]:
        return [p for p in self.names.values() if p.profile_of is not None]

    @property
    def virtuals(self) -> list[ModelPreset]:
        return [p for p in self.names.values() if p.targets]

    def close_matches(self, name: str) -> list[str]:
        return difflib.get_close_matches(
            name, [*self.models, *self.aliases, *self.names, *self.name_aliases], n=3,
            cutoff=0.5)


def scan_hf_cache() -> list[ModelPreset]:
    """Complete GGUF models in the Hugging Face cache, with llama.cpp's ``repo:TAG`` ids."""
    models = []
    for model_id, paths, _ in cached_models():
        args = {"model": str(paths[0])}
        if len(paths) > 1 and "mmproj" in paths[-1].name.lower():
            args["mmproj"] = str(paths[-1])
        models.append(ModelPreset(id=model_id, args=MappingProxyType(args), source="cache",
                                  origin=Origin(paths[0], 0)))
    return models


def _with_cached_files(model: ModelPreset) -> ModelPreset:
    """An hf-repo preset whose files are complete in the HF cache points at them."""
    if model.hf_repo is None or model.model_path is not None:
        return model
    try:
        hit = resolve_cached(HfRef.parse(model.hf_repo), model.args.get("hf-file"))
    except ResolveError:
        return model
    if hit is None:
        return model
    resolution, paths = hit
    args = {**model.args, "model": str(paths[0])}
    if resolution.mmproj is not None:
        args["mmproj"] = str(paths[-1])
    return replace(model, args=MappingProxyType(args))


def build_catalogue(preset_paths: Iterable[Path], models_dirs: Iterable[Path],
                    table: FlagTable, overrides: list[tuple[Option, str]] | None = None,
                    *, hf_cache: bool = True) -> Catalogue:
    """Load every source and merge them; raise PresetsInvalid listing every problem."""
    problems: list[PresetProblem] = []
    files = _load_preset_files(preset_paths, table, problems)
    dir_warnings: list[PresetProblem] = []
    merged = _scan_model_files(models_dirs, hf_cache, problems, dir_warnings)
    if problems:
        raise PresetsInvalid(problems)

    global_args, global_options = _global_defaults(files)
    for model_id, model in merged.items():  # models-dir entries get [*]'s preset-only keys too
        merged[model_id] = replace(model, **global_options)  # type: ignore[arg-type]
    named = _named_sections(files)
    _merge_preset_sections(files, merged, problems)
    override_args = {option.key: value for option, value in overrides or []}
    final, aliases = _final_models(merged, global_args, override_args, problems)
    name_aliases = _checked_names(named, final, aliases, problems)
    if problems:
        raise PresetsInvalid(problems)
    for model_id in _cache_entries_backing_dedup_presets(final, table):
        final[model_id] = replace(final[model_id], listed=False)
    warnings = (*dir_warnings, *(w for f in files for w in f.warnings))
    return Catalogue(final, aliases, warnings,
                     {pid: replace(preset, profile_of=aliases.get(preset.profile_of or "",
                                                                  preset.profile_of))
                      for pid, (preset, _) in sorted(named.items())},  # its base by id
                     name_aliases)


def _named_sections(files: list[PresetFile]) -> dict[str, tuple[ModelPreset, ParsedSection]]:
    """The profiles (``profile-of``) and virtual models (``targets``) of every file, taken
    out of the files' models: each a preset with no arguments, its names, and a profile's
    request policy (``[*]``'s under its own) or a virtual model's targets."""
    named: dict[str, tuple[ModelPreset, ParsedSection]] = {}
    for preset_file in files:
        for section in [s for s in preset_file.models
                        if "profile_of" in s.options or "targets" in s.options]:
            preset_file.models.remove(section)
            own = preset_file.merged(section)
            named[section.name] = (ModelPreset(
                id=section.name, args=MappingProxyType({}), origin=section.origin,
                aliases=own.aliases, tags=own.tags, profile_of=own.profile_of,
                policy=own.policy if own.profile_of else None, targets=own.targets,
                choose=own.choose), section)
    return named


def _checked_names(named: dict[str, tuple[ModelPreset, ParsedSection]],
                   models: dict[str, ModelPreset], aliases: dict[str, str],
                   problems: list[PresetProblem]) -> dict[str, str]:
    """Each profile's base is a model (not a profile, not missing), a virtual model's
    targets are no virtual model (a target no model here has is a peer's), and their names
    are no model's; their aliases (alias → id)."""
    found: dict[str, str] = {}
    virtual = {n for n, (p, _) in named.items() if p.targets} | {
        a for n, (p, _) in named.items() if p.targets for a in p.aliases}
    for profile_id, (profile, section) in named.items():
        if profile.targets:
            problems += [PresetProblem(section.origins.get("targets", section.origin),
                                       f"'{target}' is itself a virtual model: a target must "
                                       "be a model or a profile", profile_id, "targets")
                         for target in profile.targets if target in virtual]
        else:
            problems += _base_problems(profile, section, named, models, aliases)
        for name in (profile_id, *profile.aliases):
            if name in models or name in aliases or name in found:
                problems.append(PresetProblem(
                    section.origin, f"'{name}' is already the name or an alias of another "
                    "model or profile", profile_id))
            elif name != profile_id:
                found[name] = profile_id
    return found


def _base_problems(profile: ModelPreset, section: ParsedSection,
                   named: dict[str, tuple[ModelPreset, ParsedSection]],
                   models: dict[str, ModelPreset], aliases: dict[str, str]
                   ) -> list[PresetProblem]:
    """A profile's base must be a model: not a profile or virtual model, not missing."""
    line = section.origins.get("profile-of", section.origin)
    base = profile.profile_of or ""
    if base in named or any(base in p.aliases for p, _ in named.values()):
        return [PresetProblem(line, f"'{base}' is itself a profile or a virtual model: a "
                              "profile's base must be a model", profile.id, "profile-of")]
    if base not in models and base not in aliases:
        return [PresetProblem(line, f"no model named '{base}'", profile.id, "profile-of")]
    return []


def _load_preset_files(paths: Iterable[Path], table: FlagTable,
                       problems: list[PresetProblem]) -> list[PresetFile]:
    """Every preset file that is valid; the problems of the others go to ``problems``."""
    files: list[PresetFile] = []
    for path in paths:
        try:
            files.append(load_preset_file(path, table))
        except PresetsInvalid as exc:
            problems.extend(exc.problems)
    return files


def _scan_model_files(models_dirs: Iterable[Path], hf_cache: bool,
                      problems: list[PresetProblem],
                      warnings: list[PresetProblem]) -> dict[str, ModelPreset]:
    """The models of the HF cache, then of each models directory, by id: a later one of the
    same id replaces an earlier one."""
    found: dict[str, ModelPreset] = {}
    if hf_cache:
        for model in scan_hf_cache():
            found[model.id] = model
    for directory in models_dirs:
        try:
            for model in scan_models_dir(directory, warnings):
                found[model.id] = model
        except PresetsInvalid as exc:
            problems.extend(exc.problems)
    return found


def _global_defaults(files: list[PresetFile]) -> tuple[dict[str, str], dict[str, object]]:
    """The ``[*]`` sections of every file, later files over earlier: (args, options)."""
    global_args: dict[str, str] = {}
    global_options: dict[str, object] = {}
    for preset_file in files:
        if preset_file.defaults is not None:
            global_args.update(preset_file.defaults.args)
            global_options = merge_options(global_options, preset_file.defaults.options)
    return global_args, global_options


def _merge_preset_sections(files: list[PresetFile], merged: dict[str, ModelPreset],
                           problems: list[PresetProblem]) -> None:
    """Put each preset section into ``merged``, over a scanned model of the same id key by
    key; a model defined twice, or a remote upstream over a local file, is a problem."""
    seen_in: dict[str, Origin] = {}
    for preset_file in files:
        for section in preset_file.models:
            if section.name in seen_in:
                problems.append(PresetProblem(
                    section.origin, f"model also defined at {seen_in[section.name]}",
                    section.name))
                continue
            seen_in[section.name] = section.origin
            own = preset_file.merged(section)
            base = merged.get(section.name)
            if base is not None and own.upstream is not None:
                problems.append(PresetProblem(
                    section.origin, f"'upstream' cannot be set for a model that has a local "
                    f"file ({base.source}: {base.model_path or base.hf_repo})", section.name,
                    "upstream"))
            elif base is not None:
                own = replace(own, args=MappingProxyType({**base.args, **own.args}))
            merged[section.name] = own


def _final_models(merged: dict[str, ModelPreset], global_args: dict[str, str],
                  override_args: dict[str, str], problems: list[PresetProblem]
                  ) -> tuple[dict[str, ModelPreset], dict[str, str]]:
    """Every model by id, in id order, with its final args (``[*]`` under its own, the
    command line's over both), and the aliases (alias → id)."""
    final: dict[str, ModelPreset] = {}
    aliases: dict[str, str] = {}
    for model_id in sorted(merged):
        model = merged[model_id]
        if model.upstream is not None:  # served remotely: no llama-server arguments, one
            final[model_id] = replace(model, args=MappingProxyType({}), replicas=1,
                                      env=NO_ENV)  # no child, no environment
            _add_aliases(model, merged, aliases, problems)
            continue
        args = {**global_args, **model.args, **override_args}
        if not any(key in args for key in SOURCE_KEYS) and model.origin is not None:
            problems.append(PresetProblem(
                model.origin, "no model source: set 'model = /path/file.gguf' or "
                "'hf-repo = owner/repo:QUANT'", model_id))
        final[model_id] = _with_cached_files(replace(model, args=MappingProxyType(args)))
        _add_aliases(model, merged, aliases, problems)
    return final, aliases


def _add_aliases(model: ModelPreset, merged: dict[str, ModelPreset], aliases: dict[str, str],
                 problems: list[PresetProblem]) -> None:
    for alias in model.aliases:
        if alias in merged or alias in aliases:
            owner = alias if alias in merged else aliases[alias]
            problems.append(PresetProblem(
                model.origin or Origin(Path("?"), 0),
                f"alias '{alias}' is already the name or an alias of model '{owner}'",
                model.id, "alias"))
        else:
            aliases[alias] = model.id


# llama-server's options for a model file from the Hugging Face cache, by their environment
# names (as llama.cpp's own deduplication names them, server-models.cpp): (repo, file in it).
_HF_SOURCES = (("LLAMA_ARG_HF_REPO", "LLAMA_ARG_HF_FILE"),
               ("LLAMA_ARG_SPEC_DRAFT_HF_REPO", "LLAMA_ARG_SPEC_DRAFT_MODEL"))


def _hf_source_keys(table: FlagTable) -> list[tuple[str, str | None]]:
    """The preset keys (canonical spellings: ``hf-repo``, ``hf-repo-draft``) of each
    ``_HF_SOURCES`` pair this llama-server has."""
    keys: list[tuple[str, str | None]] = []
    for repo_env, file_env in _HF_SOURCES:
        repo, file = table.by_canonical(repo_env), table.by_canonical(file_env)
        if repo is not None:
            keys.append((repo.key, file.key if file is not None else None))
    return keys


def _cache_entries_backing_dedup_presets(models: dict[str, ModelPreset],
                                         table: FlagTable) -> set[str]:
    """Ids of the HF-cache entries whose files a ``dedup-cache-models`` preset uses through
    ``hf-repo`` or the draft's ``spec-draft-hf`` (in whichever spelling, in its section or
    ``[*]``): llama.cpp hides them from its model list."""
    sources = _hf_source_keys(table)
    used: set[str] = set()
    for model in models.values():
        if not model.dedup_cache_models or model.source == "cache":
            continue
        for repo_key, file_key in sources:
            repo = model.args.get(repo_key)
            if not repo:
                continue
            with contextlib.suppress(ResolveError):
                hit = resolve_cached(HfRef.parse(repo),
                                     model.args.get(file_key) if file_key else None)
                if hit is not None:
                    used.add(str(hit[1][0]))
    return {model_id for model_id, model in models.items()
            if model.source == "cache" and model.model_path in used}
