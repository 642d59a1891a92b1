"""Read what routing needs from a request: its body bytes (bounded) and its ``model``.

The body is never re-encoded: the router forwards the exact bytes it received.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from .errors import MalformedBody, PayloadTooLarge

_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_MODEL_PART = re.compile(rb'content-disposition:[^\r\n]*\bname="model"', re.IGNORECASE)


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


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
