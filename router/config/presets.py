"""INI presets in llama.cpp's format → frozen, validated model presets.

File format (compatible with ``llama-server --models-preset``)::

    version = 1                ; optional, before the first section
    [*]                        ; defaults for every model (also models-dir and cache models)
    ctx-size = 4096
    [qwen-7b]                  ; one section per model id
    model = /models/qwen.gguf  ; or hf-repo = owner/repo:Q4_K_M
    c = 8192                   ; any llama-server flag: long, short or LLAMA_ARG_* env form
    no-mmap = true             ; negative spellings and booleans true/false/on/off/1/0
    alias = qwen, q7           ; router-side names, comma separated
    load-on-startup = true     ; preset-only keys: see PRESET_ONLY below

Differences from llama.cpp, all in the direction of fewer surprises:

* a ``;`` or ``#`` starts an inline comment only after whitespace, so ``samplers = top_k;top_p``
  keeps its whole value; a value in double quotes keeps everything inside them;
* relative paths in ``model``/``mmproj`` resolve against the preset file's directory;
* keys outside a section, a repeated section, a repeated key, an unknown key or a bad boolean
  are errors naming file, line, section and key, not silently ignored or reinterpreted;
* router-owned keys (``host``, ``port``, ``api-key``, TLS, ``models-*``) are dropped from
  children with a warning naming the line;
* ``env = NAME=VALUE, …`` (no llama.cpp counterpart) adds to the children's environment
  (``envvars``); a section's entries go over ``[*]``'s name by name.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Final
from urllib.parse import urlsplit

from ..llama.flags import FALSEY, TRUTHY, FlagTable, Resolved
from .envvars import NO_ENV, ChildEnv, parse_env
from .policy import (
    FORCE,
    PARAMS,
    STRIP,
    UNSETTABLE,
    NotJson,
    RequestPolicy,
    is_policy_key,
    policy_value,
)

GLOBAL_SECTION = "*"
PATH_KEYS = frozenset({"model", "mmproj"})
SOURCE_KEYS = ("model", "hf-repo")
# Keys the router owns: never passed to a child from a preset.
ROUTER_OWNED = frozenset({
    "host", "port", "api-key", "api-key-file", "ssl-key-file", "ssl-cert-file", "models-dir",
    "models-max", "models-preset", "models-autoload", "alias", "reuse-port",
})

_HEADER = re.compile(r"^\[\s*([^\]]+?)\s*\]\s*(?:[;#].*)?$")
_KEY_VALUE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]*)\s*=\s*(.*)$")
_INLINE_COMMENT = re.compile(r"\s[;#]")
_TAG = re.compile(r"[-.]([A-Za-z0-9_]+)$")

# How a model's replicas share its requests (``replica-routing``): by the prompt's prefix
# (``affinity``), or to the least busy replica.
ROUTING_PREFIX: Final = "prefix"
ROUTING_LEAST_BUSY: Final = "least-busy"
ROUTINGS: Final = (ROUTING_PREFIX, ROUTING_LEAST_BUSY)
DEFAULT_SLOTS: Final = 4  # a child's slots without ``parallel`` (llama-server's -np auto)
# How a virtual model (``targets``) chooses among its targets for each request (``choose``).
CHOOSE_WARM: Final = "warm"  # the first target loaded, else the first
CHOOSE_SPILLOVER: Final = "spillover"  # the first with a slot free and a short queue
CHOOSE_FALLBACK: Final = "fallback"  # the first, then the next when one refuses
CHOICES: Final = (CHOOSE_WARM, CHOOSE_SPILLOVER, CHOOSE_FALLBACK)


@dataclass(frozen=True)
class Origin:
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True)
class PresetProblem:
    """One problem in a preset file, printed as ``file:line: [section] key: message``."""

    origin: Origin
    message: str
    section: str | None = None
    key: str | None = None

    def __str__(self) -> str:
        where = "".join([f" [{self.section}]" if self.section else "",
                         f" {self.key}" if self.key else ""])
        return f"{self.origin}:{where}{':' if where else ''} {self.message}"


class PresetsInvalid(ValueError):
    """A preset file (or several) has errors; ``problems`` lists every one."""

    def __init__(self, problems: list[PresetProblem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


# The metadata of a ``ModelPreset`` field that shapes how its children start (their command
# line, their count, the upstream they are): a change to one needs the running children
# replaced (``reconfig.needs_restart``); any other field is applied in place. A test holds it
# to the spawner (every field whose change changes ``Spawner.launch_of`` is marked so).
LAUNCH: Final = MappingProxyType({"launch": True})


@dataclass(frozen=True)
class ModelPreset:
    """One model: its llama-server args (canonical key → value) and router-side options.

    ``args`` values are strings; boolean flags hold ``"true"``/``"false"``. ``origin`` is the
    section header (or models-dir file) the model came from. The fields marked ``LAUNCH``
    shape how its children start.
    """

    id: str
    args: Mapping[str, str] = field(metadata=LAUNCH)
    source: str = "preset"
    origin: Origin | None = None
    aliases: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    load_on_startup: bool = False
    stop_timeout: float | None = None
    load_timeout: float | None = None
    wait_budget: float | None = None
    ttl: float | None = None
    # pin: never stopped to make room (the planner's evictions and drains, memory included)
    # nor by its idle TTL; only an explicit unload stops it (``scheduler``, ``liveness``).
    pin: bool = False
    # min-resident: seconds after it became loaded during which only an explicit unload
    # stops it: no eviction, drain or idle TTL (two models cannot thrash each other).
    min_resident: float = 0.0
    replicas: int = field(default=1, metadata=LAUNCH)
    # replica-routing: how requests choose among replicas (``affinity``): "prefix" (the
    # replica that served the prompt's longest prefix) or "least-busy".
    replica_routing: str = ROUTING_PREFIX
    # dedup-cache-models: hide from /models the HF-cache entries backing hf-repo and
    # spec-draft-hf (they stay usable by id); ``listed`` is False for such a hidden entry.
    dedup_cache_models: bool = False
    listed: bool = True
    # warm-swaps: with --state-dir, save this model's slots before its children stop and
    # restore them into the next ones (``warm``); false keeps none of its conversations on disk.
    warm_swaps: bool = field(default=True, metadata=LAUNCH)  # its children's slot directory
    # shared-conversations: with API keys, a saved conversation is restored for any key, not
    # only the one that made it (``conversations``: a common system prompt)
    shared_conversations: bool = field(default=False, metadata=LAUNCH)  # their RAM cache
    # interactive-slots: of each child's slots, how many only the interactive class may take
    # (``serving/slotqueue``): fewer than ``slots``, so the other classes keep at least one
    interactive_slots: int = 0
    # upstream: a remote OpenAI-compatible server (``http://host:port``) serving this model
    # instead of a child (``remote``); upstream_model: the ``model`` name sent to it (None:
    # the client's, unchanged); upstream_key: the bearer key read from upstream-api-key-file
    # (never shown: not in repr, /models or /props).
    upstream: str | None = field(default=None, metadata=LAUNCH)
    upstream_model: str | None = None
    upstream_key: str | None = field(default=None, repr=False, metadata=LAUNCH)
    # upstream-connections: connections open to the upstream at once, at most (None: as to a
    # child with llama-server's default HTTP threads, ``runtime.ModelRuntime.max_connections``).
    upstream_connections: int | None = field(default=None, metadata=LAUNCH)
    # profile-of: the model whose children serve this name (a profile: no model of its own);
    # policy: the body fields set, replaced or removed for this name's requests (``policy``).
    profile_of: str | None = None
    policy: RequestPolicy | None = None
    # targets: the names a virtual model chooses among per request (no model of its own);
    # choose: how (``CHOICES``).
    targets: tuple[str, ...] = ()
    choose: str = CHOOSE_WARM
    # env: variables added to its children's environment (``envvars``: names the router keeps
    # refused; a secret-looking name's value shown as ``***`` by its repr and in /models).
    env: ChildEnv = field(default=NO_ENV, metadata=LAUNCH)

    @property
    def model_path(self) -> str | None:
        return self.args.get("model")

    @property
    def hf_repo(self) -> str | None:
        return self.args.get("hf-repo")

    @property
    def slots(self) -> int:
        """Each child's generation slots (``parallel``; llama-server's own default else)."""
        return slots_of(self.args)

    def private_to(self, keyed: bool) -> bool:
        """Whether a request's conversations are its key's own: it came with an API key
        (``keyed``) and this model does not share them (``shared-conversations``). The one
        reading of it: the edge places such a request, the conversations label its states
        with its key's digest."""
        return keyed and not self.shared_conversations

    @property
    def prefix_routing(self) -> bool:
        """Requests choose among several replicas by their prompt's prefix (``affinity``)."""
        return self.replicas > 1 and self.replica_routing == ROUTING_PREFIX


@dataclass
class Section:
    name: str
    origin: Origin
    entries: list[tuple[str, str, Origin]] = field(default_factory=list)


@dataclass(frozen=True)
class ParsedSection:
    """A validated section: llama-server args and preset-only options, both as written, and
    the line of each key (``origins``)."""

    name: str
    origin: Origin
    args: dict[str, str]
    options: dict[str, object]
    origins: Mapping[str, Origin] = field(default_factory=dict)


@dataclass
class PresetFile:
    """A parsed, validated preset file: the ``[*]`` section plus one section per model."""

    path: Path
    defaults: ParsedSection | None
    models: list[ParsedSection]
    warnings: list[PresetProblem]

    def merged(self, section: ParsedSection) -> ModelPreset:
        """The model preset of ``section`` with this file's ``[*]`` underneath it."""
        base = self.defaults
        args = {**(base.args if base else {}), **section.args}
        options = merge_options(base.options if base else {}, section.options)
        return ModelPreset(id=section.name, args=MappingProxyType(args), origin=section.origin,
                           **options)  # type: ignore[arg-type]


def merge_options(base: Mapping[str, object], own: Mapping[str, object]) -> dict[str, object]:
    """Preset-only options ``own`` over ``base`` (``[*]``'s): field by field, but ``env``
    name by name and the request ``policy`` field by field of the body."""
    merged = {**base, **own}
    base_env, own_env = base.get("env"), own.get("env")
    if isinstance(base_env, ChildEnv) and isinstance(own_env, ChildEnv):
        merged["env"] = own_env.over(base_env)
    base_policy, own_policy = base.get("policy"), own.get("policy")
    if isinstance(base_policy, RequestPolicy) and isinstance(own_policy, RequestPolicy):
        merged["policy"] = own_policy.over(base_policy)
    return merged


def canonical_model_id(name: str) -> str:
    """Upper-case a ``repo:tag`` quant tag the way llama.cpp does (``u/r:q4_k_m`` → ``Q4_K_M``)."""
    if name in (GLOBAL_SECTION,) or ":" not in name:
        return name
    repo, _, tag = name.rpartition(":")
    match = _TAG.search(tag)
    return f"{repo}:{(match.group(1) if match else tag).upper()}"


def parse_ini(path: Path) -> tuple[list[Section], list[PresetProblem]]:
    """Split an INI file into sections of (key, value, origin); syntax problems only."""
    problems: list[PresetProblem] = []
    sections: list[Section] = []
    seen: dict[str, Origin] = {}
    try:
        text = path.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise PresetsInvalid([PresetProblem(Origin(path, 0), "file does not exist")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PresetsInvalid([PresetProblem(Origin(path, 0), f"cannot read: {exc}")]) from exc
    current: Section | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        origin = Origin(path, number)
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        header = _HEADER.match(line)
        if header:
            name = canonical_model_id(header.group(1))
            if name in seen:
                problems.append(PresetProblem(
                    origin, f"section repeated (first defined at line {seen[name].line})", name))
            seen[name] = origin
            current = Section(name, origin)
            sections.append(current)
            continue
        pair = _KEY_VALUE.match(line)
        if not pair:
            problems.append(PresetProblem(origin, f"cannot parse line: {raw.strip()!r}; "
                                          "expected [section] or key = value"))
            continue
        key, value = pair.group(1), _strip_value(pair.group(2))
        if current is None:
            if key != "version":
                problems.append(PresetProblem(
                    origin, "key outside any section; put defaults under [*] or give the model "
                    "its own [section]", key=key))
            elif value != "1":
                problems.append(PresetProblem(origin, f"unsupported version {value!r} (only 1)",
                                              key=key))
            continue
        previous = next((o for k, _, o in current.entries if k == key), None)
        if previous is not None:
            problems.append(PresetProblem(
                origin, f"key repeated (first set at line {previous.line})", current.name, key))
        current.entries.append((key, value, origin))
    return sections, problems


def _strip_value(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == '"':
        end = value.find('"', 1)
        if end > 0 and (value[end + 1:].strip() == "" or value[end + 1:].lstrip()[0] in ";#"):
            return value[1:end]
    comment = _INLINE_COMMENT.search(value)
    return value[:comment.start()].rstrip() if comment else value


def _parse_bool(value: str) -> bool:
    lowered = value.lower()
    if lowered in TRUTHY:
        return True
    if lowered in FALSEY:
        return False
    raise ValueError(f"bad boolean {value!r}: use true/false, on/off or 1/0")


def _parse_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"bad number of seconds {value!r}") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"seconds must be a finite number >= 0, got {value!r}")
    return seconds


def _parse_count(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"expected a whole number >= 1, got {value!r}")
    return int(value)


def _parse_reserve(value: str) -> int:
    if not value.isdigit():
        raise ValueError(f"expected a whole number >= 0, got {value!r}")
    return int(value)


def slots_of(args: Mapping[str, str]) -> int:
    """A child's generation slots (``parallel``), as llama-server would run it."""
    raw = args.get("parallel", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else DEFAULT_SLOTS


def _parse_routing(value: str) -> str:
    if value.lower() not in ROUTINGS:
        raise ValueError(f"bad replica routing {value!r}: use {' or '.join(ROUTINGS)}")
    return value.lower()


def _parse_choose(value: str) -> str:
    if value.lower() not in CHOICES:
        raise ValueError(f"bad choice {value!r}: use {', '.join(CHOICES)}")
    return value.lower()


def _parse_targets(value: str) -> tuple[str, ...]:
    targets = _parse_list(value)
    if not targets:
        raise ValueError("no target: list the models to choose from, a, b")
    if len(set(targets)) != len(targets):
        raise ValueError("a target is listed twice")
    return targets


def _parse_upstream(value: str) -> str:
    """``http://host[:port]`` → ``http://host:port`` (no path, query, credentials)."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"bad upstream address {value!r}: {exc}") from None
    if parts.scheme == "https":
        raise ValueError(f"https upstreams are not supported yet: {value!r}; use http:// "
                         "(on a private network, or through a TLS-terminating tunnel)")
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"bad upstream address {value!r}: expected http://host:port")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"bad upstream address {value!r}: no path or query; the request's "
                         "own path is used (e.g. /v1/chat/completions)")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"bad upstream address {value!r}: no credentials in the address; "
                         "use upstream-api-key-file")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{host}:{port or 80}"


def _parse_name(value: str) -> str:
    if not value:
        raise ValueError("expected a model name")
    return value


def read_key_file(path: Path) -> str:
    """The first line of ``path`` that is neither empty nor a ``#`` comment, stripped: a
    bearer key, so printable ASCII (checked here, when the configuration is read, rather than
    failing in the ``Authorization`` header of the first request). The key itself is never
    in a message."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"file does not exist: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if line and not line.startswith("#"):
            bad = next((i for i, c in enumerate(line, start=1) if not " " <= c <= "~"), None)
            if bad is not None:
                raise ValueError(
                    f"the key in {path} (line {number}) cannot be sent in an HTTP header: "
                    f"character {bad} is not printable ASCII (a control character or "
                    "non-ASCII)")
            return line
    raise ValueError(f"no key in {path} (its first non-comment line is the key)")


def _parse_list(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


# Preset-only keys: never passed to a child. Name → (parser, ModelPreset field).
PRESET_ONLY: dict[str, tuple[Callable[[str], object], str]] = {
    "load-on-startup": (_parse_bool, "load_on_startup"),
    "stop-timeout": (_parse_seconds, "stop_timeout"),
    "load-timeout": (_parse_seconds, "load_timeout"),
    "wait-budget": (_parse_seconds, "wait_budget"),
    "ttl": (_parse_seconds, "ttl"),
    "pin": (_parse_bool, "pin"),
    "min-resident": (_parse_seconds, "min_resident"),
    "replicas": (_parse_count, "replicas"),
    "replica-routing": (_parse_routing, "replica_routing"),
    "alias": (_parse_list, "aliases"),
    "tags": (_parse_list, "tags"),
    "dedup-cache-models": (_parse_bool, "dedup_cache_models"),
    "warm-swaps": (_parse_bool, "warm_swaps"),
    "shared-conversations": (_parse_bool, "shared_conversations"),
    "interactive-slots": (_parse_reserve, "interactive_slots"),
    "upstream": (_parse_upstream, "upstream"),
    "upstream-model": (_parse_name, "upstream_model"),
    "upstream-api-key-file": (lambda value: read_key_file(Path(value)), "upstream_key"),
    "upstream-connections": (_parse_count, "upstream_connections"),
    "profile-of": (_parse_name, "profile_of"),
    "targets": (_parse_targets, "targets"),
    "choose": (_parse_choose, "choose"),
    "env": (parse_env, "env"),
}
# Keys of a remote upstream: never defaults in [*], and only with ``upstream``.
UPSTREAM_KEYS = ("upstream", "upstream-model", "upstream-api-key-file", "upstream-connections")
_PRESET_ONLY_ENV = {"__PRESET_" + k.upper().replace("-", "_"): k for k in PRESET_ONLY}


def load_preset_file(path: Path, table: FlagTable) -> PresetFile:
    """Parse and validate one preset file; raise PresetsInvalid listing every problem."""
    path = path.expanduser().absolute()
    sections, problems = parse_ini(path)
    warnings: list[PresetProblem] = []
    defaults: ParsedSection | None = None
    models: list[ParsedSection] = []
    origins: dict[str, dict[str, Origin]] = {}
    for section in sections:
        reader = _SectionReader(section, path.parent, table, problems, warnings)
        parsed_section = reader.read()
        origins[section.name] = reader.origins
        if section.name == GLOBAL_SECTION:
            problems += _defaults_problems(parsed_section, reader.origins)
            defaults = parsed_section
        else:
            problems += _upstream_problems(section.name, parsed_section.args, reader.origins)
            problems += _profile_problems(parsed_section)
            models.append(parsed_section)
    for model in models:
        problems += _reserve_problems(model, defaults, origins)
    if problems:
        raise PresetsInvalid(problems)
    return PresetFile(path, defaults, models, warnings)


@dataclass
class _SectionReader:
    """Validates one section's entries, in line order, into llama-server args (canonical key
    → value as a child gets it) and preset-only options (ModelPreset field → parsed value).
    Problems and warnings go to the file's lists; ``origins`` maps each key read to its line."""

    section: Section
    directory: Path  # the preset file's: relative paths resolve against it
    table: FlagTable
    problems: list[PresetProblem]
    warnings: list[PresetProblem]
    args: dict[str, str] = field(default_factory=dict)
    options: dict[str, object] = field(default_factory=dict)
    origins: dict[str, Origin] = field(default_factory=dict)

    policy: dict[str, dict[str, object]] = field(default_factory=dict)

    def read(self) -> ParsedSection:
        for key, value, origin in self.section.entries:
            self._read_entry(key, value, origin)
        if self.policy:
            self.options["policy"] = RequestPolicy(
                MappingProxyType(self.policy.get(PARAMS, {})),
                MappingProxyType(self.policy.get(FORCE, {})),
                tuple(self.policy.get(STRIP, {})))
        return ParsedSection(self.section.name, self.section.origin, self.args, self.options,
                             self.origins)

    def _read_policy(self, key: str, value: str, origin: Origin) -> None:
        """A request policy entry (``policy``): ``params.NAME``, ``force.NAME`` or ``strip``."""
        self.origins[key] = origin
        if key == STRIP:
            for name in _parse_list(value):
                self.policy.setdefault(STRIP, {})[name] = None
            return
        kind = PARAMS if key.startswith(PARAMS) else FORCE
        name = key[len(kind):]
        if not name:
            self._problem(origin, f"'{kind}' names no field: write {kind}FIELD = VALUE", key)
        elif name in UNSETTABLE:
            self._problem(origin, f"'{name}' cannot be set by a preset: the router decides "
                          "it (the model a request names, whether it streams)", key)
        else:
            try:
                self.policy.setdefault(kind, {})[name] = policy_value(value)
            except NotJson as exc:
                self._problem(origin, f"'{value}': {exc}", key)

    def _problem(self, origin: Origin, message: str, key: str) -> None:
        self.problems.append(PresetProblem(origin, message, self.section.name, key))

    def _read_entry(self, key: str, value: str, origin: Origin) -> None:
        if key == "version":
            self._problem(origin, "'version' belongs before the first section", key)
            return
        if is_policy_key(key):
            self._read_policy(key, value, origin)
            return
        preset_key = _PRESET_ONLY_ENV.get(key, key)
        resolved = self.table.lookup(key)
        if resolved is not None and resolved.option.key in PRESET_ONLY:
            preset_key = resolved.option.key  # a, LLAMA_ARG_ALIAS, LLAMA_ARG_TAGS
        if preset_key in PRESET_ONLY:
            self._read_preset_option(preset_key, key, value, origin)
        elif resolved is None:
            close = self.table.suggest(key, extra=list(PRESET_ONLY))
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            self._problem(origin, f"unknown key (not a llama-server flag nor a preset key){hint}",
                          key)
        elif resolved.option.key in ROUTER_OWNED:
            self.warnings.append(PresetProblem(
                origin, "ignored: the router sets this itself for every child",
                self.section.name, key))
        else:
            self._read_child_arg(resolved, key, value, origin)

    def _read_preset_option(self, preset_key: str, key: str, value: str,
                            origin: Origin) -> None:
        parser, attr = PRESET_ONLY[preset_key]
        if preset_key == "upstream-api-key-file":  # relative to the preset's directory
            value = str((self.directory / Path(value).expanduser()).absolute())
        elif preset_key == "env":  # a LLAMA_ARG_* name's refusal names its preset key
            parser = functools.partial(parse_env, table=self.table)
        try:
            parsed = parser(value)
        except ValueError as exc:
            self._problem(origin, str(exc), key)
        else:
            if attr != "_ignored":
                self.options[attr] = parsed
        self.origins[preset_key] = origin

    def _read_child_arg(self, resolved: Resolved, key: str, value: str,
                        origin: Origin) -> None:
        """A llama-server flag: a boolean becomes "true"/"false" (its negative spelling
        inverted), a model file's path becomes absolute and must exist."""
        option = resolved.option
        if not option.takes_value:
            try:
                flag_on = _parse_bool(value)
            except ValueError as exc:
                self._problem(origin, str(exc), key)
                return
            value = "true" if flag_on != resolved.negated else "false"
        elif option.key in PATH_KEYS:
            value = str((self.directory / Path(value).expanduser()).absolute())
            if not Path(value).is_file():
                self._problem(origin, f"file does not exist: {value}", key)
        self.args[option.key] = value
        self.origins[option.key] = origin


# The keys a profile's section may hold: its names and its request policy (``policy``); a
# virtual model's: its names, its targets and how it chooses.
PROFILE_KEYS = ("profile-of", "alias", "tags")
VIRTUAL_KEYS = ("targets", "choose", "alias", "tags")


def _profile_problems(section: ParsedSection) -> list[PresetProblem]:
    """A profile (``profile-of``) or a virtual model (``targets``) has no model of its own:
    its section holds no model source, no llama-server flag and no other preset key (its
    base's or its targets' children serve it)."""
    origins = section.origins
    kind = next((key for key in ("profile-of", "targets") if key in origins), None)
    if kind is None:
        return [PresetProblem(origins["choose"], "'choose' needs 'targets': the models a "
                              "virtual model chooses among", section.name, "choose")] \
            if "choose" in origins else []
    allowed = PROFILE_KEYS if kind == "profile-of" else VIRTUAL_KEYS
    problems = []
    for key, origin in origins.items():
        if key in SOURCE_KEYS or key == "upstream" or (key in ("profile-of", "targets") \
                and key != kind):
            problems.append(PresetProblem(
                origins[kind], f"'{kind}' cannot be set together with '{key}' (line "
                f"{origin.line}): a {'profile' if kind == 'profile-of' else 'virtual model'} "
                "has no model of its own", section.name, kind))
        elif key not in allowed and (kind == "targets" or not is_policy_key(key)):
            problems.append(PresetProblem(origin, (
                "a profile runs on its base's children: set this in the base's section (a "
                "profile holds only profile-of, alias, tags, params., force. and strip)"
                if kind == "profile-of" else
                "a virtual model runs on its targets' children: set this in their sections "
                "(a virtual model holds only targets, choose, alias and tags)"),
                section.name, key))
    return problems


def _defaults_problems(section: ParsedSection,
                       origins: Mapping[str, Origin]) -> list[PresetProblem]:
    """``[*]`` sits under every model, so it names no model source, no remote upstream and
    no profile's base."""
    keys = [key for key in SOURCE_KEYS if key in section.args]
    keys += [key for key in (*UPSTREAM_KEYS, "profile-of", "targets", "choose")
             if key in origins]
    return [PresetProblem(origins[key], f"'{key}' cannot be a default for every model",
                          section.name, key) for key in keys]


def _reserve_problems(section: ParsedSection, defaults: ParsedSection | None,
                      origins: Mapping[str, Mapping[str, Origin]]) -> list[PresetProblem]:
    """``interactive-slots`` (here or in ``[*]``) must leave the other classes a slot."""
    key = "interactive-slots"
    where = section if key in origins[section.name] else defaults
    if where is None or key not in origins[where.name]:
        return []
    reserved = where.options.get("interactive_slots")  # absent: refused as it was read
    args = {**(defaults.args if defaults else {}), **section.args}
    slots = slots_of(args)
    if not isinstance(reserved, int) or reserved < slots:
        return []
    return [PresetProblem(origins[where.name][key],
                          f"'interactive-slots = {reserved}' leaves no slot for the other "
                          f"classes: [{section.name}]'s children have {slots} (parallel); "
                          f"at most {slots - 1}", section.name, key)]


def _upstream_problems(name: str, args: Mapping[str, str],
                       origins: Mapping[str, Origin]) -> list[PresetProblem]:
    """A remote upstream has no local model file; its other keys need ``upstream``."""
    problems: list[PresetProblem] = []
    if "upstream" in origins:
        for key in SOURCE_KEYS:
            if key in args:
                problems.append(PresetProblem(
                    origins[key], f"'{key}' cannot be set with 'upstream' (line "
                    f"{origins['upstream'].line}): a remote upstream serves the model",
                    name, key))
        if "env" in origins:
            problems.append(PresetProblem(origins["env"], "a remote upstream has no child to "
                                          "set an environment for", name, "env"))
    else:
        for key in UPSTREAM_KEYS[1:]:
            if key in origins:
                problems.append(PresetProblem(origins[key], "only for a model with "
                                              "'upstream = http://host:port'", name, key))
    return problems
