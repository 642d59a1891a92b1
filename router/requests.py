"""Read what routing needs from a request: its body bytes (bounded) and its ``model``.

The body is never re-encoded: the router forwards the exact bytes it received.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.types import Receive, Scope

from .errors import ClientGone, MalformedBody, PayloadTooLarge

_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_MODEL_PART = re.compile(rb'content-disposition:[^\r\n]*\bname="model"', re.IGNORECASE)


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case) in an ASGI scope."""
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, refused with 413 past ``limit`` bytes (declared or counted)."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared.decode()} bytes exceeds the limit "
                              f"of {limit}")
    first = b""
    chunks: list[bytes] | None = None
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("client disconnected while sending its request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        if chunks is None:
            if not first:
                first = chunk
            elif chunk:
                chunks = [first, chunk]
        elif chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return first if chunks is None else b"".join(chunks)


def model_from_body(content_type: str, body: bytes) -> tuple[str | None, dict[str, Any] | None]:
    """The ``model`` named by a POST body, and the parsed JSON object when it is JSON.

    Multipart bodies are scanned for a ``model`` form field; anything else must be a JSON
    object (an empty body has no model).
    """
    if content_type.lower().startswith("multipart/form-data"):
        return _multipart_model(content_type, body), None
    if not body.strip():
        return None, None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedBody(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise MalformedBody("request body is nested too deeply to read") from None
    if not isinstance(parsed, dict):
        raise MalformedBody("request body must be a JSON object")
    model = parsed.get("model")
    return (model if isinstance(model, str) and model else None), parsed


def _multipart_model(content_type: str, body: bytes) -> str | None:
    match = _BOUNDARY.search(content_type)
    if not match:
        raise MalformedBody("multipart request without a boundary")
    delimiter = b"--" + match.group(1).encode()
    for part in body.split(delimiter):
        head, sep, value = part.partition(b"\r\n\r\n")
        if sep and _MODEL_PART.search(head) and b"filename=" not in head.lower():
            text = value.removesuffix(b"\r\n").decode("utf-8", "replace").strip()
            return text or None
    return None
