"""Every policy decision read from the request's one reading, for every body shape, in
process: the same body in each shape (JSON small and past the scan threshold, no content type,
a form's media type, chunked) gives the same model, the same streaming (so the same class and
preemption), the same limit (so the same quota reservation) and the same slot it names; a
multipart body names none of them (llama-server reads each form field as a string), and any
other multipart spelling is refused. ``test_policy_matrix_real.py`` asserts the decisions
themselves against the real llama-server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from router.config.keyfile import KeyPolicy
from router.edge.metering import Meter
from router.errors import BadRequest
from router.http.requests import SMALL_JSON_BYTES, RequestContext
from router.teams.members import member_of
from router.teams.usage import Usage

BODY = {"model": "m", "stream": False, "n_predict": 40, "max_tokens": 9, "id_slot": 1,
        "messages": [{"role": "user", "content": "hi"}]}
SHAPES = {  # name: (content type, pad the body past the scan threshold, chunks)
    "small": ("application/json", False, 1),
    "large": ("application/json", True, 1),
    "no-type": (None, False, 1),
    "form": ("application/x-www-form-urlencoded", False, 1),
    "chunked": ("application/json", True, 7),
}


def read(body: bytes, content_type: str | None, chunks: int = 1) -> RequestContext:
    headers = [(b"content-type", content_type.encode())] if content_type else []
    request = RequestContext({"type": "http", "method": "POST", "path": "/completion",
                              "query_string": b"", "headers": headers})
    size = -(-len(body) // chunks)
    parts = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    messages = [{"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
                for i, part in enumerate(parts)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    asyncio.run(request.read(receive, 1 << 30))
    return request


def decisions(request: RequestContext, stream: bool, rate: int | None = 10**9
              ) -> tuple[Any, ...]:
    quotas = {} if rate is None else {"tokens-per-minute": rate}
    request.member = member_of(KeyPolicy("batch", priority=2, quotas=quotas), False, {})
    metered = Meter(Usage()).begin(request, "m")
    assert metered is not None
    return (request.model, request.fields.get("stream") is True, metered.preemptible,
            metered.limit, request.fields.get("id_slot"), stream)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_shape_is_decided_as_llama_server_reads_it(shape: str, stream: bool) -> None:
    content_type, large, chunks = SHAPES[shape]
    fields = {**BODY, "stream": stream}
    if large:
        fields["pad"] = "p" * SMALL_JSON_BYTES
    request = read(json.dumps(fields).encode(), content_type, chunks)
    assert (request.parsed is None) == large  # scanned, not parsed
    # n_predict over its aliases (as llama-server reads it); a stream is never preempted
    assert decisions(request, stream) == ("m", stream, not stream, 40, 1, stream)


def test_a_multipart_body_names_no_policy_field() -> None:
    form = (b'--zz\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
            b'--zz\r\nContent-Disposition: form-data; name="stream"\r\n\r\ntrue\r\n'
            b'--zz\r\nContent-Disposition: form-data; name="n_predict"\r\n\r\n40\r\n--zz--\r\n')
    request = read(form, "multipart/form-data; boundary=zz")
    assert decisions(request, False, None) == ("m", False, True, 0, None, False)
    with pytest.raises(BadRequest, match=r"^team batch has tokens-per-minute=1000000000: its "
                       r"completions take a JSON body"):  # no field could cap it
        decisions(request, False)


@pytest.mark.parametrize("media", ["Multipart/Form-Data", "multipart/form-dataX",
                                   "MULTIPART/form-data", "multipart/related"])
@pytest.mark.parametrize("large", [False, True])
def test_any_other_multipart_spelling_is_refused(media: str, large: bool) -> None:
    body = json.dumps({**BODY, "pad": "p" * (SMALL_JSON_BYTES if large else 1)}).encode()
    with pytest.raises(BadRequest, match="multipart"):
        read(body, f"{media}; boundary=zz")
