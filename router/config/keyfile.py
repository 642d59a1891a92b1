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

Each key's scope is parsed once into an immutable ``KeyScope``. Whether a scope allows a model
is cached per (scope, model). The messages here name the file line, never the key, and an
``ApiKey``'s repr hides it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

ADMIN, INFER, METRICS = "admin", "infer", "metrics"
ROLES = (ADMIN, INFER, METRICS)
FIELDS = ("models", "role")
_FIELD_NAME = re.compile(r"[a-z][a-z_-]{0,15}")


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
    """A key (the string itself) with its scope; its repr hides the key."""

    scope: KeyScope

    def __new__(cls, key: str, scope: KeyScope = FULL) -> ApiKey:
        self = super().__new__(cls, key)
        self.scope = scope
        return self

    def __repr__(self) -> str:
        return f"ApiKey(<hidden>, {self.scope.describe()})"


def scope_of(key: str) -> KeyScope:
    """The scope of a key: full access unless it is an ``ApiKey`` with a narrower one."""
    return key.scope if isinstance(key, ApiKey) else FULL


# ------------------------------------------------------------------------------- parsing

def parse_line(line: str) -> ApiKey | None:
    """One line of a key file: None for a blank or comment line; ValueError with the problem
    (never quoting the key, nor anything that may be part of one) for a bad line."""
    words = _words(line)
    if not words:
        return None
    key, *fields = words
    name = key.split("=", 1)[0]
    if "=" in key and name in FIELDS:
        raise ValueError(f"starts with the field {name}= where the key belongs "
                         "(the key comes first, then its fields)")
    values: dict[str, str] = {}
    for number, word in enumerate(fields, start=2):
        name, equals, value = word.partition("=")
        if not equals:
            raise ValueError(f"word {number} is not a name=value field (a key is one word; "
                             f"the fields after it are {' and '.join(f + '=' for f in FIELDS)})")
        if name not in FIELDS:
            shown = f"'{name}'" if _FIELD_NAME.fullmatch(name) else f"of word {number}"
            raise ValueError(f"unknown field {shown} (known: {', '.join(FIELDS)})")
        if name in values:
            raise ValueError(f"{name}= given twice")
        values[name] = value
    models = _parse_models(values["models"]) if "models" in values else None
    roles = _parse_roles(values["role"]) if "role" in values else frozenset({ADMIN})
    return ApiKey(key, KeyScope(roles, models))


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


def parse_file(text: str) -> list[ApiKey]:
    """Every key of a key file; ValueError ``line N: problem`` for the first bad line, or a
    key given twice with different scopes."""
    keys: list[ApiKey] = []
    seen: dict[str, tuple[int, KeyScope]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            key = parse_line(line)
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
        if key is None:
            continue
        earlier = seen.setdefault(str(key), (number, key.scope))
        if earlier[1] != key.scope:
            raise ValueError(f"line {number}: the key of line {earlier[0]} again, with another "
                             "scope: give each key once")
        keys.append(key)
    return keys
