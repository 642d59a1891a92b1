"""A model's request policy, as its preset says it: the body fields the router sets, replaces
or removes before the model's children see a request.

    [qwen-code]
    profile-of = qwen                                  ; served by [qwen]'s children
    params.temperature = 0.2                           ; a default: the client's value wins
    params.chat_template_kwargs = {"enable_thinking": false}
    force.top_k = 20                                   ; always: the client's value is replaced
    strip = logit_bias, n_probs                        ; removed before the child sees them

A value is read as JSON when it is JSON (a number, ``true``, an object, a quoted string), else
as the string it is. ``model`` and ``stream`` cannot be set: the router decides the model, and
whether a request streams shapes how it is relayed and metered.

``RequestPolicy.apply`` is pure: the body's top-level object in, the object the child gets
out, or None when no rule changes anything (the body then goes byte for byte).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

PARAMS: Final = "params."
FORCE: Final = "force."
STRIP: Final = "strip"
# Fields a policy may not set: the router decides them (the model, and whether it streams).
UNSETTABLE: Final = frozenset({"model", "stream"})


def is_policy_key(key: str) -> bool:
    """Whether a preset key belongs to the request policy."""
    return key.startswith((PARAMS, FORCE)) or key == STRIP


class NotJson(ValueError):
    """A policy value that Python's JSON reader takes but JSON has not (``NaN``,
    ``Infinity``, a number too large for a double): llama-server would refuse every body."""


def policy_value(raw: str) -> Any:
    """A policy entry's value: JSON when it reads as JSON, else the string as written.
    NotJson for ``NaN``, ``Infinity`` and numbers past a double, anywhere in the value."""
    try:
        return json.loads(raw, parse_constant=_not_json, parse_float=_finite)
    except NotJson:
        raise
    except ValueError:
        return raw


def _not_json(constant: str) -> Any:
    raise NotJson(f"{constant} is not a JSON value: llama-server would refuse every request "
                  "body holding it (quote it to send the string)")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NotJson(f"{text} is past the largest number JSON readers take")
    return value


@dataclass(frozen=True)
class RequestPolicy:
    """Defaults (``params``: set where the client left the field out), overrides (``force``:
    always set) and removals (``strip``) of a request body's top-level fields."""

    params: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    force: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    strip: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.params or self.force or self.strip)

    def over(self, under: RequestPolicy | None) -> RequestPolicy:
        """This policy over ``under`` (``[*]``'s), field by field; ``strip`` lists join."""
        if under is None:
            return self
        return RequestPolicy(MappingProxyType({**under.params, **self.params}),
                             MappingProxyType({**under.force, **self.force}),
                             tuple(dict.fromkeys((*under.strip, *self.strip))))

    def apply(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """The object the child gets for a request ``body``: the stripped fields removed, the
        defaults set where absent, the forced ones set; None when nothing changes."""
        changed = any(name in body for name in self.strip) or any(
            name not in body for name in self.params) or any(
            name not in body or type(body[name]) is not type(value) or body[name] != value
            for name, value in self.force.items())
        if not changed:
            return None
        result = {name: value for name, value in body.items() if name not in self.strip}
        for name, value in self.params.items():
            result.setdefault(name, value)
        result.update(self.force)
        return result

    def describe(self) -> dict[str, Any]:
        """For ``/models``: what the policy does."""
        return {**({"params": dict(self.params)} if self.params else {}),
                **({"force": dict(self.force)} if self.force else {}),
                **({"strip": list(self.strip)} if self.strip else {})}
