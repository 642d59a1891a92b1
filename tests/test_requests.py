"""Unit tests for router.http.requests: bounded body reading and finding the ``model``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from router.errors import (
    BadRequest,
    ClientGone,
    LoadFailed,
    MalformedBody,
    ModelMissing,
    ModelNotFound,
    ModelNotLoaded,
    NestedTooDeeply,
    NotFound,
    PayloadTooLarge,
    QueueFull,
    RouterError,
    Unauthorized,
    Unavailable,
    UpstreamError,
    WaitBudgetExceeded,
    envelope,
    envelope_bytes,
)
from router.http.requests import model_from_body, read_body, with_multipart_model

# --- model_from_body: JSON -------------------------------------------------------------------


def test_json_with_model() -> None:
    body = json.dumps({"model": "qwen", "messages": []}).encode()
    model, parsed = model_from_body("application/json", body)
    assert model == "qwen"
    assert parsed == {"model": "qwen", "messages": []}


def test_json_content_type_is_not_required() -> None:
    model, parsed = model_from_body("text/plain", b'{"model": "m"}')
    assert model == "m"
    assert parsed == {"model": "m"}


def test_json_without_model() -> None:
    model, parsed = model_from_body("application/json", b'{"prompt": "hi"}')
    assert model is None
    assert parsed == {"prompt": "hi"}


@pytest.mark.parametrize("value", [42, None, ["a"], {"id": "x"}, "", True])
def test_json_with_non_string_or_empty_model(value: object) -> None:
    model, parsed = model_from_body("application/json", json.dumps({"model": value}).encode())
    assert model is None
    assert parsed == {"model": value}


@pytest.mark.parametrize("body", [b"{not json", b'{"model": "x"', b"\xff\xfe\x00garbage",
                                  b"model=qwen"])
def test_malformed_json(body: bytes) -> None:
    with pytest.raises(MalformedBody, match="not valid JSON") as info:
        model_from_body("application/json", body)
    assert info.value.status == 400


@pytest.mark.parametrize("body", [b'["model"]', b'"qwen"', b"42", b"null", b"true"])
def test_non_object_json(body: bytes) -> None:
    with pytest.raises(MalformedBody, match="must be a JSON object"):
        model_from_body("application/json", body)


@pytest.mark.parametrize("body", [b"", b"   ", b"\r\n\t"])
def test_empty_body(body: bytes) -> None:
    assert model_from_body("application/json", body) == (None, None)


def test_json_utf8_model_name() -> None:
    body = json.dumps({"model": "modèle-ü"}, ensure_ascii=False).encode()
    assert model_from_body("application/json", body)[0] == "modèle-ü"
    # A pair of surrogates escaped in JSON is one character: fine.
    assert model_from_body("application/json", b'{"model": "m\\ud83d\\ude00"}')[0] == "m\U0001f600"


@pytest.mark.parametrize("name", ["\\ud800", "x\\udfff", "\\udc00\\ud800", "a\\ud83d"])
def test_a_model_name_with_a_lone_surrogate_is_refused(name: str) -> None:
    body = b'{"model": "' + name.encode() + b'", "messages": []}'
    with pytest.raises(MalformedBody, match="not valid Unicode") as info:
        model_from_body("application/json", body)
    assert info.value.status == 400


def test_json_nested_past_the_parsers_depth_is_a_400() -> None:
    for body in (b"[" * 100_000 + b"]" * 100_000,
                 b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        with pytest.raises(NestedTooDeeply, match="nested too deeply") as info:
            model_from_body("application/json", body)
        assert info.value.status == 400


# --- model_from_body: multipart ----------------------------------------------------------------

BOUNDARY = "----llamaRouterBoundary7MA4YWxkTrZu0gW"


def multipart(parts: list[tuple[str, str | None, bytes]], boundary: str = BOUNDARY) -> bytes:
    """A multipart/form-data body from (name, filename, content) parts."""
    out = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"'
        head = f"Content-Disposition: {disposition}"
        if filename is not None:
            head += f'; filename="{filename}"\r\nContent-Type: application/octet-stream'
        out += f"--{boundary}\r\n{head}\r\n\r\n".encode() + content + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def test_multipart_with_model_field_and_file() -> None:
    body = multipart([("file", "audio.wav", b"RIFF\x00\x01binary\r\n\r\nstuff"),
                      ("model", None, b"whisper-small"),
                      ("language", None, b"en")])
    model, parsed = model_from_body(f"multipart/form-data; boundary={BOUNDARY}", body)
    assert model == "whisper-small"
    assert parsed is None


def test_multipart_quoted_boundary() -> None:
    body = multipart([("model", None, b"m1")])
    assert model_from_body(f'multipart/form-data; boundary="{BOUNDARY}"', body) == ("m1", None)


def test_the_multipart_model_is_renamed_in_place() -> None:
    """Only the ``model`` field's value changes: a file part holding the same bytes (even a
    part head inside it) and every other byte stay as they were."""
    audio = b'RIFF\x00\xff\r\nContent-Disposition: form-data; name="model"\r\n\r\nfar\r\n'
    content_type = f"multipart/form-data; boundary={BOUNDARY}"
    body = multipart([("file", "a.wav", audio), ("model", None, b"far"),
                      ("prompt", None, b"far")])
    renamed = with_multipart_model(content_type, body, "served-näme")
    expected = multipart([("file", "a.wav", audio), ("model", None, "served-näme".encode()),
                          ("prompt", None, b"far")])
    assert renamed == expected
    assert model_from_body(content_type, renamed) == ("served-näme", None)
    without = multipart([("prompt", None, b"x")])
    assert with_multipart_model(content_type, without, "y") is without
    file_only = multipart([("model", "model.bin", b"far")])
    assert with_multipart_model(content_type, file_only, "y") == file_only


def test_multipart_model_field_name_is_matched_exactly() -> None:
    """``MODEL`` is another field (llama.cpp reads form fields by their exact name): it is
    neither the model nor a second one; the header and parameter names are any case."""
    content_type = f"multipart/form-data; boundary={BOUNDARY}"
    body = multipart([("MODEL", None, b"pub"), ("model", None, b"secret")])
    assert model_from_body(content_type, body) == ("secret", None)
    for name in ("MODEL", "Model", "model "):
        assert model_from_body(content_type, multipart([(name, None, b"m")])) == (None, None)
    odd = (f"--{BOUNDARY}\r\ncontent-DISPOSITION: form-data; NAME=\"model\"\r\n\r\nm\r\n"
           f"--{BOUNDARY}\r\nContent-Disposition: form-data; x-name=\"model\"; "
           f"name=\"other\"\r\n\r\nnot\r\n--{BOUNDARY}--\r\n").encode()
    assert model_from_body(content_type, odd) == ("m", None)


def test_two_multipart_model_fields_are_refused() -> None:
    content_type = f"multipart/form-data; boundary={BOUNDARY}"
    for parts in ([("model", None, b"pub"), ("model", None, b"secret")],
                  [("model", None, b"m"), ("file", "a.wav", b"x"), ("model", None, b"m")]):
        with pytest.raises(MalformedBody, match='more than one "model" field') as info:
            model_from_body(content_type, multipart(parts))
        assert info.value.status == 400
        with pytest.raises(MalformedBody):  # nor renamed: which one would it be?
            with_multipart_model(content_type, multipart(parts), "x")


def test_a_multipart_model_field_is_added_where_asked() -> None:
    content_type = f"multipart/form-data; boundary={BOUNDARY}"
    without = multipart([("file", "a.wav", b"RIFF"), ("prompt", None, b"x")])
    added = with_multipart_model(content_type, without, "far", add=True)
    assert added == multipart([("model", None, b"far"), ("file", "a.wav", b"RIFF"),
                               ("prompt", None, b"x")])
    assert model_from_body(content_type, added) == ("far", None)
    named = multipart([("model", None, b"near")])
    assert with_multipart_model(content_type, named, "far", add=True) == \
        multipart([("model", None, b"far")])


def test_multipart_file_part_named_model_is_not_the_model() -> None:
    body = multipart([("model", "model.bin", b"not-a-name"), ("prompt", None, b"x")])
    assert model_from_body(f"multipart/form-data; boundary={BOUNDARY}", body) == (None, None)


def test_multipart_similar_field_names_do_not_match() -> None:
    body = multipart([("model_id", None, b"nope"), ("my_model", None, b"nope")])
    assert model_from_body(f"multipart/form-data; boundary={BOUNDARY}", body) == (None, None)


def test_multipart_without_model() -> None:
    body = multipart([("file", "a.wav", b"data"), ("prompt", None, b"hello")])
    assert model_from_body(f"multipart/form-data; boundary={BOUNDARY}", body) == (None, None)


def test_multipart_empty_model_field() -> None:
    body = multipart([("model", None, b"  ")])
    assert model_from_body(f"multipart/form-data; boundary={BOUNDARY}", body) == (None, None)


@pytest.mark.parametrize("media", [
    "Multipart/Form-Data", "MULTIPART/FORM-DATA", "multipart/form-dataX", "multipart/mixed",
    "multipart/form-data2", " Multipart/form-data"])
def test_multipart_only_in_llama_servers_spelling(media: str) -> None:
    """llama-server (cpp-httplib) reads a body as multipart only for exactly
    ``multipart/form-data`` and parses any other as JSON: every other ``multipart/`` spelling
    is refused (400), so that no body is read two ways (the router taking the query's model
    while a peer routes by the JSON's)."""
    body = multipart([("model", None, b"m1")])
    with pytest.raises(BadRequest, match="multipart body must be sent as exactly"):
        model_from_body(f"{media}; boundary={BOUNDARY}", body)
    with pytest.raises(BadRequest, match="multipart"):
        model_from_body(f"{media}; boundary=zz", b'{"model": "secret"}')


@pytest.mark.parametrize("media", [
    "multipart/form-data", " multipart/form-data ", "multipart/form-data\t", "multipart/form-data"])
def test_multipart_spelled_as_llama_server_reads_it(media: str) -> None:
    body = multipart([("model", None, b"m1")])
    assert model_from_body(f"{media}; boundary={BOUNDARY}", body) == ("m1", None)
    assert model_from_body(f"{media};boundary={BOUNDARY}", body) == ("m1", None)


def test_a_json_body_with_a_json_type_is_json_whatever_its_case() -> None:
    assert model_from_body("Application/JSON", b'{"model": "m"}') == ("m", {"model": "m"})


def test_multipart_without_boundary() -> None:
    with pytest.raises(MalformedBody, match="without a boundary"):
        model_from_body("multipart/form-data", multipart([("model", None, b"m")]))


def test_multipart_built_by_httpx() -> None:
    request = httpx.Request("POST", "http://x/v1/audio/transcriptions",
                            data={"model": "whisper-1", "language": "en"},
                            files={"file": ("a.wav", b"\x00\x01\x02", "audio/wav")})
    body = request.read()
    model, parsed = model_from_body(request.headers["content-type"], body)
    assert model == "whisper-1"
    assert parsed is None


# --- read_body ---------------------------------------------------------------------------------

def fake_request(chunks: list[bytes], content_length: int | str | None = None) -> Request:
    headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": headers, "query_string": b""}
    messages = [{"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
                for i, chunk in enumerate(chunks)] or [{"type": "http.request", "body": b"",
                                                        "more_body": False}]
    received: list[int] = []

    async def receive() -> dict[str, Any]:
        received.append(1)
        if len(received) > len(messages):
            raise AssertionError("read past the end of the body")
        return messages[len(received) - 1]

    return Request(scope, receive)


def _asgi(request: Request) -> tuple[Any, Any]:
    return request.scope, request.receive


async def test_read_body_joins_chunks() -> None:
    request = fake_request([b'{"model":', b' "m"', b"}"], content_length=14)
    assert await read_body(request.scope, request.receive, limit=100) == b'{"model": "m"}'


async def test_read_body_exactly_at_limit() -> None:
    request = fake_request([b"12345", b"67890"], content_length=10)
    assert await read_body(request.scope, request.receive, limit=10) == b"1234567890"


async def test_read_body_empty() -> None:
    assert await read_body(*_asgi(fake_request([])), limit=0) == b""


async def test_declared_length_over_limit_is_refused_before_reading() -> None:
    async def receive() -> dict[str, Any]:
        raise AssertionError("the body must not be read")

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(b"content-length", b"1000001")]}
    with pytest.raises(PayloadTooLarge) as info:
        await read_body(scope, receive, limit=1_000_000)
    assert info.value.status == 413
    assert "1000001" in info.value.message


async def test_streamed_body_over_limit() -> None:
    request = fake_request([b"a" * 6, b"b" * 6, b"c" * 6])  # no Content-Length (chunked)
    with pytest.raises(PayloadTooLarge, match="exceeds the limit of 10 bytes"):
        await read_body(request.scope, request.receive, limit=10)


async def test_streamed_body_over_limit_despite_small_declared_length() -> None:
    request = fake_request([b"a" * 8, b"b" * 8], content_length=5)
    with pytest.raises(PayloadTooLarge):
        await read_body(request.scope, request.receive, limit=10)


async def test_disconnect_while_reading_the_body() -> None:
    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"", "headers": []}
    with pytest.raises(ClientGone):
        await read_body(scope, receive, limit=10)


async def test_non_numeric_content_length_falls_back_to_counting() -> None:
    request = fake_request([b"abc"], content_length="bogus")
    assert await read_body(request.scope, request.receive, limit=3) == b"abc"


# --- errors: the envelope of everything the router answers itself ------------------------------

def test_model_missing() -> None:
    error = ModelMissing()
    assert isinstance(error, BadRequest)
    assert error.status == 400
    body = error.envelope()
    assert set(body) == {"error"}
    assert body["error"]["code"] == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert '"model"' in body["error"]["message"]


def test_model_not_found_lists_close_matches() -> None:
    error = ModelNotFound("qwen-7", ["qwen-7b", "qwen"])
    assert isinstance(error, NotFound)
    assert error.model == "qwen-7"
    assert error.envelope() == {"error": {
        "code": 404, "type": "not_found_error",
        "message": "model 'qwen-7' not found; did you mean 'qwen-7b', 'qwen'?"}}


def test_model_not_found_without_close_matches() -> None:
    assert ModelNotFound("x", []).envelope()["error"]["message"] == "model 'x' not found"


def test_payload_too_large() -> None:
    assert PayloadTooLarge("too big").envelope() == {"error": {
        "code": 413, "message": "too big", "type": "invalid_request_error"}}


def test_upstream_error() -> None:
    assert UpstreamError("child died").envelope() == {"error": {
        "code": 502, "message": "child died", "type": "server_error"}}


def test_load_failed() -> None:
    error = LoadFailed("exited with code 1")
    assert isinstance(error, Unavailable)
    assert error.envelope() == {"error": {
        "code": 503, "message": "exited with code 1", "type": "unavailable_error"}}


def test_unauthorized() -> None:
    assert Unauthorized().envelope() == {"error": {
        "code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
    assert Unauthorized("nope").envelope()["error"]["message"] == "nope"


@pytest.mark.parametrize(("error", "status", "type_"), [
    (RouterError("x"), 500, "server_error"),
    (MalformedBody("x"), 400, "invalid_request_error"),
    (QueueFull("x"), 429, "rate_limit_error"),
    (ModelNotLoaded("m"), 400, "invalid_request_error"),
    (WaitBudgetExceeded("x"), 503, "unavailable_error"),
])
def test_other_errors(error: RouterError, status: int, type_: str) -> None:
    body = error.envelope()["error"]
    assert (body["code"], body["type"]) == (status, type_)
    assert body["message"] == error.message == str(error)


def test_error_headers() -> None:
    assert QueueFull("busy", headers={"Retry-After": "1"}).headers == {"Retry-After": "1"}
    assert UpstreamError("x").headers == {}


@pytest.mark.parametrize(("status", "type_"), [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "invalid_request_error"), (429, "rate_limit_error"),
    (501, "not_supported_error"), (502, "server_error"), (503, "unavailable_error"),
    (418, "server_error"),
])
def test_envelope_type_follows_status(status: int, type_: str) -> None:
    assert envelope(status, "m") == {"error": {"code": status, "message": "m", "type": type_}}


def test_envelope_explicit_type_and_bytes() -> None:
    assert envelope(400, "m", "custom")["error"]["type"] == "custom"
    assert json.loads(envelope_bytes(404, "gone")) == envelope(404, "gone")
