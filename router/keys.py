"""API keys and their scopes.

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
(inference and read-only model listing) and ``metrics`` (``/metrics``). Which paths each role
reaches is in ``paths.py`` (``INFER_PATHS`` and the rest), checked by ``needed_role``.

Each key's scope is parsed once into an immutable ``KeyScope``; ``ApiKeyMiddleware`` finds it
by comparing the presented key with every key in constant time, checks the role of the
request and leaves the scope in the request's context (``requests.RequestContext.key_scope``)
for the places that know the model: the proxy (``forward._forward``) and the routes naming a
model or listing models. The role and the model are read from that same context, which the
router routes by: the key check and the router never read a request differently.
Whether a scope allows a model is cached per (scope, model). Keys are never logged: the
messages here name the file line, never the key, and an ``ApiKey``'s repr hides it.
"""

from __future__ import annotations

import difflib
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

from starlette.types import Scope

from .errors import ModelNotFound, RouterError
from .paths import (
    ADMIN_PROXIED_PREFIXES,
    ADMIN_PROXIED_WRITES,
    INFER_PATHS,
    LISTING_PATHS,
    METRICS_PATHS,
    READ_METHODS,
)
from .requests import RequestContext, context

if TYPE_CHECKING:
    from .supervisor import Supervisor
    from .view import ModelView

ADMIN, INFER, METRICS = "admin", "infer", "metrics"
ROLES = (ADMIN, INFER, METRICS)
FIELDS = ("models", "role")
_FIELD_NAME = re.compile(r"[a-z][a-z_-]{0,15}")


class Forbidden(RouterError):
    """A valid API key whose scope does not reach the path or the model."""

    status = 403
    type = "permission_error"


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

    def allows_model(self, model: ModelView) -> bool:
        return self.pattern is None or _allows(self, model.id, model.aliases)

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


_HASH_SECRET = secrets.token_bytes(32)  # made at start: key hashes mean nothing elsewhere


def key_hash(key: bytes) -> str:
    """What stands for a key where the router must remember who did something (the owner of
    a resumable stream): an HMAC of it under a secret made at start, never the key, and no
    plain hash that a guessed key could be checked against."""
    return hmac.new(_HASH_SECRET, key, hashlib.sha256).hexdigest()[:32]


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


# ---------------------------------------------------------------------------- enforcement

def needed_role(request: RequestContext) -> str:
    """The role a request needs (``admin``, ``infer`` or ``metrics``), from the path tables
    and the decoded query the router acts on."""
    path = request.path
    method = request.method
    if request.local:
        if path in METRICS_PATHS:
            return METRICS if method in READ_METHODS else ADMIN
        methods = INFER_PATHS.get(path)
        if methods is None or method not in methods:
            return ADMIN
        if path in LISTING_PATHS and request.params.get("reload"):
            return ADMIN  # GET /models?reload=1 re-reads the configuration
        return INFER
    if path in METRICS_PATHS:  # /metrics?model=: the child's own
        return METRICS if method in READ_METHODS else ADMIN
    if path.startswith(ADMIN_PROXIED_PREFIXES) or (
            path in ADMIN_PROXIED_WRITES and method not in READ_METHODS):
        return ADMIN
    return INFER


def check_path(key_scope: KeyScope, request: RequestContext) -> None:
    """Forbidden unless the key's roles reach this request."""
    role = needed_role(request)
    if role not in key_scope.grants:
        raise Forbidden(f"this API key ({key_scope.describe()}) may not use {request.method} "
                        f"{request.path[:200]}: that needs role={role}")


def key_scope_of(scope: Scope) -> KeyScope | None:
    """The scope the API key middleware left for this request; None: full access."""
    return context(scope).key_scope


def resolve_in_scope(supervisor: Supervisor, key_scope: KeyScope | None, name: str
                     ) -> ModelView:
    """``supervisor.find(name)``, for a key limited to some models only among them: a model
    outside its scope is not found, exactly as a name nobody uses (``not_found``), so a key
    cannot probe which names exist."""
    if key_scope is None or key_scope.pattern is None:
        return supervisor.find(name)
    try:
        model = supervisor.find(name)
    except ModelNotFound:
        raise not_found(supervisor, key_scope, name) from None
    if not key_scope.allows_model(model):
        raise not_found(supervisor, key_scope, name)
    return model


def not_found(supervisor: Supervisor, key_scope: KeyScope, name: str) -> ModelNotFound:
    """The 404 for ``name`` as a key limited to some models sees the router: its "did you
    mean" is drawn from the names (ids and aliases) of its models alone, so it reads the same
    whether ``name`` is another model's or nobody's."""
    names = [n for model in supervisor.views() if key_scope.allows_model(model)
             for n in (model.id, *model.aliases)]
    return ModelNotFound(name, difflib.get_close_matches(name, names, n=3, cutoff=0.5))
