"""A request's ``keep_alive``: Ollama's field, honoured in every JSON request body.

``keep_alive`` sets the idle TTL of the model that serves the request, from this request until
that model next stops (``Models.keep_alive``; ``/models`` shows it in the model's entry):

* a number of seconds (``300``), or a duration as Ollama writes it (``"5m"``, ``"1h30m"``,
  ``"90s"``, ``"250ms"``, ``"300"``): the TTL;
* a negative one (``-1``, ``"-1m"``): no idle TTL (the model still yields to ``--models-max``
  and the memory budgets, as any other);
* ``0``: unload the model once its requests are done, as ``POST /models/unload`` would (a
  ``pin`` or ``min-resident`` does not hold it);
* ``null`` or no field: the TTL in force stays.

It is honoured only from a key that may load and unload models (``role=admin``; every request
of a router without keys); from another key it is ignored, as Ollama's clients send it with
every request. A value that is no duration (``true``, ``"soon"``, NaN, an array) is refused
with a 400, whatever the key. The field is read from the body as the model's request policy
left it (a preset's ``strip = keep_alive`` ignores clients' values; ``force.keep_alive``
sets one), once, through ``RequestContext.fields``: a large body is read as a small one. It
stays in the body (llama-server ignores it; a peer serving the request applies it there).
"""

from __future__ import annotations

from ..config.durations import FIELD, keep_alive_seconds
from ..config.keyfile import ADMIN, KeyScope

__all__ = ["FIELD", "keep_alive_seconds", "kept_alive", "may_keep_alive"]


def kept_alive(key_scope: KeyScope | None, value: object) -> float | None:
    """The idle TTL a request's ``keep_alive`` sets: checked whatever the key (BadRequest),
    None for ``null`` or when the key may not load and unload models."""
    seconds = keep_alive_seconds(value)
    return seconds if may_keep_alive(key_scope) else None

def may_keep_alive(key_scope: KeyScope | None) -> bool:
    """Whether a request of a key with this scope may set a model's TTL: one that may load and
    unload models (None: full access, or a router without keys)."""
    return key_scope is None or ADMIN in key_scope.grants
