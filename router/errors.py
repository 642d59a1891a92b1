"""Errors the router produces, and the one wire envelope they all use.

Every error the router itself answers with is the OpenAI envelope::

    {"error": {"code": <status>, "message": <str>, "type": <str>}}

Hierarchy::

    RouterError                      500 server_error
    ├── InternalError                500  an unexpected failure (a bug): its type only
    ├── BadRequest                   400 invalid_request_error
    │   ├── ModelMissing             400  no "model" in the request
    │   ├── ModelNotLoaded           400  autoload disabled and model not running (as llama.cpp)
    │   └── MalformedBody            400  body is not valid JSON / form
    │       └── NestedTooDeeply      400  JSON nested past the parser's depth
    ├── Unauthorized                 401 authentication_error
    ├── NotFound                     404 not_found_error
    │   └── ModelNotFound            404  unknown model id (names close matches)
    ├── MethodNotAllowed             405 invalid_request_error
    ├── PayloadTooLarge              413 invalid_request_error
    ├── UnsupportedMediaType         415 invalid_request_error
    ├── QueueFull                    429 rate_limit_error
    ├── ClientGone                   499  client disconnected first (never sent)
    ├── UpstreamError                502 server_error   child unreachable / died mid-request
    └── Unavailable                  503 unavailable_error
        ├── LoadFailed               503  child exited or timed out while loading
        ├── WaitBudgetExceeded       503  waited longer than the request's budget
        └── ShuttingDown             503  arrived during, or outlived, the shutdown grace period

Children's own error responses are passed through untouched; these classes are only for
what the router decides itself. Map foreign exceptions (httpx, OSError) to these once, at
the boundary where they happen, with ``raise ... from exc``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar

from starlette.types import Scope, Send


class RouterError(Exception):
    """Base class: carries an HTTP status, an OpenAI error type and a message."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}

    def envelope(self) -> dict[str, Any]:
        return envelope(self.status, self.message, self.type)


class InternalError(RouterError):
    """A failure the router did not expect (a bug): the client is told its type only, the
    traceback goes to the log."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(f"internal error: {type(exc).__name__}")


class BadRequest(RouterError):
    status = 400
    type = "invalid_request_error"


class ModelMissing(BadRequest):
    def __init__(self, hint: str = "") -> None:
        super().__init__('model name is missing from the request: set "model" in the JSON body, '
                         'the "model" form field, or ?model= on GET' + hint)


class MalformedBody(BadRequest):
    pass


class NestedTooDeeply(MalformedBody):
    """JSON nested deeper than the parser goes (instead of its ``RecursionError``)."""


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"

    def __init__(self, message: str = "Invalid API Key") -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class NotFound(RouterError):
    status = 404
    type = "not_found_error"


class ModelNotFound(NotFound):
    def __init__(self, model: str, close: list[str]) -> None:
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        super().__init__(f"model '{model}' not found{hint}")
        self.model = model


class MethodNotAllowed(RouterError):
    status = 405
    type = "invalid_request_error"


class PayloadTooLarge(RouterError):
    status = 413
    type = "invalid_request_error"


class UnsupportedMediaType(RouterError):
    status = 415
    type = "invalid_request_error"


class QueueFull(RouterError):
    status = 429
    type = "rate_limit_error"


class ClientGone(RouterError):
    """The client disconnected before its answer (nobody listens: it is never sent)."""

    status = 499
    type = "client_closed_request"


class UpstreamError(RouterError):
    status = 502
    type = "server_error"


class Unavailable(RouterError):
    status = 503
    type = "unavailable_error"


class ModelNotLoaded(BadRequest):
    def __init__(self, model: str) -> None:
        super().__init__(f"model '{model}' is not loaded and autoload is disabled for this "
                         "request; load it with POST /models/load")


class LoadFailed(Unavailable):
    pass


class WaitBudgetExceeded(Unavailable):
    pass


class ModelUnloaded(Unavailable):
    """The model was unloaded (``POST /models/unload``) while the request ran."""

    def __init__(self, model: str) -> None:
        super().__init__(f"model '{model}' was unloaded while this request was running",
                         headers={"Retry-After": "1"})


class ShuttingDown(Unavailable):
    """The router is shutting down: the request came after the first signal, or it was still
    running when the grace period ended (``shutdown.Shutdown``)."""


_TYPES_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    501: "not_supported_error",
    502: "server_error",
    503: "unavailable_error",
}


class ConfigurationError(Exception):
    """Settings that are well-formed but do not fit this machine (e.g. a GPU that is not
    there); the CLI prints it and exits 2. Not a request's error: no envelope."""


def envelope(status: int, message: str, type_: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope for ``status``; the type follows the status by default."""
    return {"error": {"code": status, "message": message,
                      "type": type_ or _TYPES_BY_STATUS.get(status, "server_error")}}


def envelope_bytes(status: int, message: str, type_: str | None = None) -> bytes:
    return json.dumps(envelope(status, message, type_)).encode()


async def send_error(send: Send, exc: RouterError) -> None:
    """Answer with the error's envelope and headers, in plain ASGI."""
    body = envelope_bytes(exc.status, exc.message, exc.type)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def send_unexpected(send: Send, scope: Scope, exc: Exception) -> None:
    """Answer a failure that nothing answered (a bug): its traceback to the log, the 500
    envelope naming its type to the client, in plain ASGI."""
    logging.getLogger("router.edge").exception(
        "unhandled error on %s %s", scope["method"], scope["path"], exc_info=exc)
    await send_error(send, InternalError(exc))


class QuotaExceeded(RouterError):
    """A request over its team's quota (``teams.quotas``): 429 with ``Retry-After``."""

    status = 429
    type = "rate_limit_error"
