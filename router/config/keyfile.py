"""The key files' grammar and a key's scope (configuration-level: ``settings`` reads the key
files with ``parse_file``; ``keys`` enforces the scopes).

A key given with ``--api-key`` / ``LLAMA_ROUTER_API_KEY`` has full access. A line of
``--api-key-file`` is a key, then optionally whitespace-separated ``name=value`` fields that
narrow it::

    sk-admin-1                                  # full access, as before
    sk-team-a   models=chat-*,coder  role=infer # inference with these models only
    sk-scraper  role=metrics                    # Prometheus: /metrics only

A ``#`` starts a comment at the start of a line or after whitespace; a ``#`` inside a word
(``sk-abc#def``) is refused with the line's number, as it is ambiguous: a key holding ``#`` or
a comment without its space. The same parser reads ``--peer-api-key-file`` (``parse_file``,
whose first key is the one sent to peers), so the two files follow one syntax.

``models=`` a comma list of model ids or aliases, ``*`` matching any run of characters
(default: every model). A model is in scope when a pattern matches its id or one of its
aliases. ``role=`` ``admin`` (default: every endpoint), or a comma list of ``infer``
(inference and read-only model listing) and ``metrics`` (``/metrics``).

A key's policy among the teams sharing the router (``KeyPolicy``, enforced by ``teams``)::

    sk-alice  name=alice  priority=interactive
    sk-batch  name=etl    priority=batch  max-concurrent=4  tokens-per-minute=20000

``name=`` what every view shows instead of the key (letters, digits, ``.``, ``_``, ``-``;
default ``key-N``, N the line of the file where the key first appears: each key without a
name is a team of its own); keys sharing a name are one team: one fair share, one quota, so
they must give the same policy. ``admin`` is the team of the keys given with ``--api-key``:
a file may use that name only when no key is given so (``parse_file``'s ``flag_keys``).
``priority=`` ``interactive``, ``default`` (the default) or ``batch``: the highest class its
requests may ask for. ``max-concurrent=`` requests of the team queued or running at once;
``tokens-per-minute=`` prompt and generated tokens a minute. The quotas' fields are one list
(``QUOTA_FIELDS``), each a whole number read alike into ``KeyPolicy.quotas``; what each means
is its quota kind's (``teams.quotas.QUOTA_KINDS``, one kind per field).

Each key's scope is parsed once into an immutable ``KeyScope``. Whether a scope allows a model
is cached per (scope, model). ``parse_file`` reports every bad line (``KeyFileInvalid``), not
only the first. The messages here name the file line, never the key, and an ``ApiKey``'s repr
hides it.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType

ADMIN, INFER, METRICS = "admin", "infer", "metrics"
ROLES = (ADMIN, INFER, METRICS)
# The quotas' fields, each a whole number (``KeyPolicy.quotas``), in the order ``describe``
# writes them; each is a quota kind's (teams.quotas.QUOTA_KINDS: tests hold the two alike).
QUOTA_FIELDS = ("max-concurrent", "tokens-per-minute")
FIELDS = ("models", "role", "name", "priority", *QUOTA_FIELDS)
_FIELD_NAME = re.compile(r"[a-z][a-z_-]{0,15}")
# The priority classes, highest first (``KeyPolicy.priority``: the class's rank, 0 highest).
PRIORITIES = ("interactive", "default", "batch")
INTERACTIVE = 0  # the highest class: the one a preset's ``interactive-slots`` are kept for
DEFAULT_PRIORITY = 1
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ADMIN_NAME = "admin"  # the name of the keys given with --api-key
ANONYMOUS = "anonymous"  # the one team of requests to a router without keys
_LIMIT_MAX = 10**12


@dataclass(frozen=True)
class KeyPolicy:
    """A key's place among the teams: its ``name``, the highest ``priority`` class its
    requests may ask for (an index of ``PRIORITIES``), its ``quotas``: each limit by its
    field's name (``QUOTA_FIELDS``; a quota left out: no limit)."""

    name: str = ANONYMOUS
    priority: int = DEFAULT_PRIORITY
    quotas: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:  # read-only, in the order of QUOTA_FIELDS
        order = {name: n for n, name in enumerate(QUOTA_FIELDS)}
        object.__setattr__(self, "quotas", MappingProxyType(dict(sorted(
            self.quotas.items(), key=lambda item: order.get(item[0], len(order))))))

    def __hash__(self) -> int:
        return hash((self.name, self.priority, tuple(self.quotas.items())))

    def describe(self) -> str:
        """``name=etl priority=batch max-concurrent=4`` (never the key)."""
        text = f"name={self.name} priority={PRIORITIES[self.priority]}"
        return "".join([text, *(f" {name}={limit}" for name, limit in self.quotas.items())])


UNLIMITED = KeyPolicy()
ADMIN_POLICY = KeyPolicy(ADMIN_NAME)


@dataclass(frozen=True)
class KeyScope:
    """What one key may do: its roles, and its model patterns (None: every model)."""

    roles: frozenset[str]
    models: tuple[str, ...] | None = None
    grants: frozenset[str] = field(init=False, compare=False, repr=False)
    pattern: re.Pattern[str] | None = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "grants", frozenset(ROLES) if ADMIN in self.roles
                           else self.roles)
        object.__setattr__(self, "pattern", None if self.models is None else re.compile(
            "|".join(".*".join(map(re.escape, p.split("*"))) for p in self.models)))

    @property
    def full(self) -> bool:
        """Admin for every model: the access of a key given without a scope."""
        return ADMIN in self.roles and self.models is None

    def allows(self, model_id: str, aliases: tuple[str, ...] = ()) -> bool:
        """Whether the model with this id and these aliases is in scope."""
        return self.pattern is None or _allows(self, model_id, aliases)

    def describe(self) -> str:
        """``role=infer models=chat-*`` (never the key)."""
        text = "role=" + ",".join(r for r in ROLES if r in self.roles)
        return text if self.models is None else f"{text} models={','.join(self.models)}"


@lru_cache(maxsize=4096)
def _allows(scope: KeyScope, model_id: str, aliases: tuple[str, ...]) -> bool:
    assert scope.pattern is not None
    return any(scope.pattern.fullmatch(name) for name in (model_id, *aliases))


FULL = KeyScope(frozenset({ADMIN}))


class ApiKey(str):
    """A key (the string itself) with its scope and its policy; its repr hides the key."""

    scope: KeyScope
    policy: KeyPolicy

    def __new__(cls, key: str, scope: KeyScope = FULL, policy: KeyPolicy = ADMIN_POLICY
                ) -> ApiKey:
        self = super().__new__(cls, key)
        self.scope = scope
        self.policy = policy
        return self

    def __repr__(self) -> str:
        return f"ApiKey(<hidden>, {self.scope.describe()}, {self.policy.describe()})"


def scope_of(key: str) -> KeyScope:
    """The scope of a key: full access unless it is an ``ApiKey`` with a narrower one."""
    return key.scope if isinstance(key, ApiKey) else FULL


def policy_of(key: str) -> KeyPolicy:
    """The policy of a key: ``admin``'s, unlimited, unless it is an ``ApiKey`` with its own."""
    return key.policy if isinstance(key, ApiKey) else ADMIN_POLICY


# ------------------------------------------------------------------------------- parsing

def parse_line(line: str, number: int = 1) -> ApiKey | None:
    """One line of a key file; ``number``: the line where its key first appears in the file
    (1 for the first), which names the key's team when the line gives no ``name=``
    (``key-N``). None for a blank or comment line; ValueError with the problem (never quoting
    the key, nor anything that may be part of one) for a bad line."""
    words = _words(line)
    if not words:
        return None
    key, *fields = words
    name = key.split("=", 1)[0]
    if "=" in key and name in FIELDS:
        raise ValueError(f"starts with the field {name}= where the key belongs "
                         "(the key comes first, then its fields)")
    values = _fields(fields)
    models = _parse_models(values["models"]) if "models" in values else None
    roles = _parse_roles(values["role"]) if "role" in values else frozenset({ADMIN})
    return ApiKey(key, KeyScope(roles, models), _parse_policy(values, line_number=number))


def _fields(words: list[str]) -> dict[str, str]:
    """The ``name=value`` fields after the key (its words 2 and on), by name."""
    values: dict[str, str] = {}
    for position, word in enumerate(words, start=2):  # the word's place on the line
        name, equals, value = word.partition("=")
        if not equals:
            raise ValueError(f"word {position} is not a name=value field (a key is one word; "
                             f"the fields after it are {' and '.join(f + '=' for f in FIELDS)})")
        if name not in FIELDS:
            shown = f"'{name}'" if _FIELD_NAME.fullmatch(name) else f"of word {position}"
            raise ValueError(f"unknown field {shown} (known: {', '.join(FIELDS)})")
        if name in values:
            raise ValueError(f"{name}= given twice")
        values[name] = value
    return values


def _parse_policy(values: dict[str, str], *, line_number: int) -> KeyPolicy:
    name = values.get("name", f"key-{line_number}")
    if not NAME.fullmatch(name):
        raise ValueError("name= needs 1 to 64 letters, digits, '.', '_' or '-', starting with "
                         "a letter or digit")
    priority = values.get("priority", PRIORITIES[DEFAULT_PRIORITY])
    if priority not in PRIORITIES:
        raise ValueError(f"priority= must be one of {', '.join(PRIORITIES)}")
    return KeyPolicy(name, PRIORITIES.index(priority),
                     {n: _limit(values[n], n) for n in QUOTA_FIELDS if n in values})


def _limit(value: str, field_name: str) -> int:
    if not value.isascii() or not value.isdigit() or not 0 < int(value) <= _LIMIT_MAX:
        raise ValueError(f"{field_name}= must be a whole number from 1 to {_LIMIT_MAX} "
                         "(leave it out for no limit)")
    return int(value)


def _words(line: str) -> list[str]:
    """The words of a line before its comment: a word starting with ``#`` begins it."""
    words: list[str] = []
    for number, word in enumerate(line.split(), start=1):
        if word.startswith("#"):
            break
        if "#" in word:
            raise ValueError(f"'#' inside word {number}: a comment starts with '#' at the start "
                             "of a line or after a space, and a key may not hold '#'")
        words.append(word)
    return words


def _parse_models(value: str) -> tuple[str, ...]:
    patterns = tuple(value.split(","))
    if not value or any(not p for p in patterns):
        raise ValueError("models= needs a comma list of model ids or aliases, without empty "
                         "entries (leave models= out for every model)")
    return patterns


def _parse_roles(value: str) -> frozenset[str]:
    roles = value.split(",")
    unknown = [r for r in roles if r not in ROLES]
    if not value or unknown:
        shown = f" '{unknown[0]}'" if unknown and unknown[0] else ""
        raise ValueError(f"role= has an unknown role{shown} (roles: admin, or infer and/or "
                         "metrics as a comma list)")
    if ADMIN in roles and len(set(roles)) > 1:
        raise ValueError("role=admin already includes every role: give it alone")
    return frozenset(roles)


class KeyFileInvalid(ValueError):
    """A key file with bad lines: ``problems`` holds every one as (line number, problem), in
    the file's order; the message is the first as ``line N: problem``, and how many more."""

    def __init__(self, problems: list[tuple[int, str]]) -> None:
        self.problems = problems
        number, first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"line {number}: {first}{more}")


def parse_file(text: str, flag_keys: Collection[str] | None = None) -> list[ApiKey]:
    """Every key of a key file, in its order; ``KeyFileInvalid`` with every bad line (a key
    given twice with different scopes or policies, a name shared with another policy among
    them). ``flag_keys``: the keys given with ``--api-key`` (full access, team ``admin``): a
    file may not give one of them a scope, and while there is one, it may not use the name
    ``admin``; None (a caller that does not know them): the name is refused as well."""
    keys: list[ApiKey] = []
    problems: list[tuple[int, str]] = []
    seen: dict[str, tuple[int, KeyScope, KeyPolicy]] = {}
    teams: dict[str, tuple[int, KeyPolicy]] = {}
    first_lines: dict[str, int] = {}  # each key's first line: its default name's
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            words = _words(line)
            first = first_lines.setdefault(words[0], number) if words else number
            key = parse_line(line, first)
            if key is not None:
                _check_against_others(key, number, seen, teams, flag_keys)
        except ValueError as exc:
            problems.append((number, str(exc)))
            continue
        if key is not None:
            keys.append(key)
    if problems:
        raise KeyFileInvalid(problems)
    return keys


def _check_against_others(key: ApiKey, number: int,
                          seen: dict[str, tuple[int, KeyScope, KeyPolicy]],
                          teams: dict[str, tuple[int, KeyPolicy]],
                          flag_keys: Collection[str] | None) -> None:
    """ValueError if the key on line ``number`` contradicts an earlier line (``seen`` keys,
    ``teams`` by name, both recorded here once it does not) or the ``flag_keys``."""
    if flag_keys and key in flag_keys and not key.scope.full:
        raise ValueError(f"a key with a scope ({key.scope.describe()}) is also given by "
                         "--api-key / LLAMA_ROUTER_API_KEY, which gives full access: give "
                         "each key once")
    name = key.policy.name
    if (flag_keys is None or flag_keys) and name == ADMIN_NAME:
        raise ValueError(f"name={ADMIN_NAME} is the name of the keys given with --api-key: "
                         "choose another")
    earlier = seen.get(str(key))
    if earlier is not None and earlier[1:] != (key.scope, key.policy):
        raise ValueError(f"the key of line {earlier[0]} again, with another scope or policy: "
                         "give each key once")
    team = teams.get(name)
    if team is not None and team[1] != key.policy:
        raise ValueError(f"name={name} is also the name of line {team[0]} with another "
                         "policy: keys sharing a name share one fair share and one quota, so "
                         "give them the same priority= and limits")
    seen.setdefault(str(key), (number, key.scope, key.policy))
    teams.setdefault(name, (number, key.policy))
