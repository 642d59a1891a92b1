"""One request as every decision sees it (``RequestContext``), and what routing reads from
it: its body bytes (bounded) and its ``model``.

A request is parsed once, at the edge (``middleware.RequestMetricsMiddleware``): its decoded
path and query, the headers decisions need, the key's scope once checked, the via chain and
the conversation id; its body and ``model`` once it is read. Whether it is public, the role it
needs, whether the key's scope allows its model, where it is routed and what the activity
record says all read this one context: two parsers of one request disagree sooner or later,
and the disagreement is an auth bypass (``?%6dodel=`` read as no model by one and as a model
by the other). Nothing else looks at the raw query bytes or parses the body again.

What two readers could read two ways is refused here, before anything acts on it (a 400
envelope): two ``X-Conversation-Id`` or ``Content-Type`` headers (``refused``), a target
with ``%uXXXX`` (llama-server's HTTP library decodes it, ``/%u0073lots`` is its ``/slots``),
percent-encoded bytes that are no UTF-8 or a control character in the path, two multipart
``model`` fields, JSON nested deeper than ``MAX_JSON_DEPTH`` (``parse_json``, the one
reader of a client's JSON), and a form body (``application/x-www-form-urlencoded``, whose
fields llama-server reads as parameters over the query) that is not JSON (on a method whose
body is not read as JSON, a 415).

Upstreams get the target the router read, not the one the client sent: encoded again from
the decoded path and query (``upstream_target``), so that llama-server reads exactly what
every decision read (each query name once, with the value the router took).

The body is never re-encoded: the router forwards the exact bytes it received, except the
value of ``model`` where the upstream must get the model the router decided (a remote
upstream's ``upstream-model``, a request the default model took, a peer's own name:
``proxy.for_remote``, ``nodes``), written where the router read it
(``jsonscan.Scanned.with_model``). A JSON body over ``SMALL_JSON_BYTES`` is scanned for
its model, not parsed (``jsonscan``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from itertools import accumulate, count
from operator import sub
from types import MappingProxyType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote_to_bytes, urlencode

from starlette.datastructures import QueryParams
from starlette.types import Receive, Scope

from ..errors import (
    BadRequest,
    ClientGone,
    MalformedBody,
    NestedTooDeeply,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from ..teams.members import FAIRNESS_HEADER, NOBODY, PRIORITY_HEADER
from . import jsonscan
from .paths import is_local
from .tail import ResponseTail

if TYPE_CHECKING:
    from ..config.keyfile import KeyScope

# The boundary parameter as cpp-httplib reads it: its name exactly ``boundary`` (after a ``;``
# and optional whitespace), its value up to the next ``;``, quotes dropped.
_BOUNDARY = re.compile(r';[ \t]*boundary[ \t]*=[ \t]*"?([^";]+)"?')
# The one media type llama-server (cpp-httplib: ``Request::is_multipart_form_data``, the media
# type before any ``;``, trimmed, compared exactly) reads a body of as multipart: every other
# body it parses as JSON. Any other ``multipart/...`` spelling (``Multipart/Form-Data``,
# ``multipart/form-dataX``) is refused (``media_kind``), so no body is read two ways.
MULTIPART = "multipart/form-data"
# The multipart ``model`` field: the header's name and the parameter's name in any case (both
# are case-insensitive), its value exactly ``model``, as llama.cpp reads form fields: a part
# named ``MODEL`` is another field, never the model.
_MODEL_PART = re.compile(rb'(?i:content-disposition):[^\r\n]*;[ \t]*(?i:name)="model"')
# JSON nested deeper than this is refused (``parse_json``, ``jsonscan``): far past what any
# API request holds, far below the interpreter's recursion limit, so that neither the parser
# nor anything that walks the parsed value (``affinity``) can overflow.
MAX_JSON_DEPTH = jsonscan.MAX_JSON_DEPTH
# A proxied JSON body up to this size is parsed (``parsed``: prefix routing reads it); a
# larger one is only scanned (``jsonscan``: its model, without building it or holding the
# event loop).
SMALL_JSON_BYTES = 256 * 1024
MAX_PARTS = 1000  # parts of a multipart body (a transcription sends a handful)
# What measuring a body's nesting keeps of it: quotes and brackets (``_too_deep``).
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_STRING = re.compile(rb'"[^"]*"')  # a string, once only quotes and brackets are left
_INNERMOST = re.compile(rb"\[\]|\{\}")  # an empty array or object: the innermost level
_RISE = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # an opening bracket counts 2, a closing 0


_NO_FIELDS: Mapping[str, Any] = MappingProxyType({})
CONTEXT = "llama_router.request"  # the ASGI scope's entry holding its RequestContext
# The ASGI scope's entry the HTTP server sets when it cut a request body that stopped
# arriving (``http11``): the app saw the client leave, the client got a 408.
BODY_TIMED_OUT = "llama_router.body_timed_out"
NO_PARAMS = QueryParams("")
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})  # methods whose body may name the model
# Sent with every request to a peer: the instance ids of the routers it passed through.
VIA_HEADER = b"x-llama-router-via"
CONVERSATION_HEADER = b"x-conversation-id"  # a resumable stream's id (``resumable``)
WAIT_BUDGET_HEADER = b"x-wait-budget"
# The headers decisions read (the first of each), kept by the one pass over the headers;
# a second X-Conversation-Id refuses the request (``RequestContext.refused``).
_KEPT = frozenset({b"authorization", b"x-api-key", b"content-type", b"content-length",
                   WAIT_BUDGET_HEADER, CONVERSATION_HEADER,
                   # who a request is for (``teams.members``)
                   PRIORITY_HEADER, FAIRNESS_HEADER,
                   # where a browser says it comes from (``cors``)
                   b"host", b"origin", b"sec-fetch-site", b"access-control-request-method"})
# A form body's media type: llama-server (cpp-httplib) folds such a body into the request's
# parameters, for any method, over the query's (``form_body``).
FORM = b"application/x-www-form-urlencoded"
# Percent-encodings llama-server's HTTP library (cpp-httplib) reads and the router does not:
# ``%uXXXX`` (its path decoder turns ``%u0073`` into ``s``; ``%U`` too, in other versions).
_PERCENT_U = re.compile(rb"%[uU][0-9A-Fa-f]{4}")
# What a decoded path may not hold: control characters (NUL included).
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class RequestContext:
    """What every decision about one request reads, parsed once (see the module docstring).

    * ``path``: the decoded path (the ASGI server's), ``params``: the decoded query (one
      ``QueryParams``; a repeated name's last value wins everywhere), ``local``: answered by
      the router itself (``paths.is_local``);
    * ``model``: the model the request names: the JSON body's ``model`` or the multipart
      ``model`` field (POST, PUT, PATCH, once ``read``), else ``?model=``; None for none;
      for a proxied request, the default model instead when it names none, or (opt-in) a
      model nobody serves (``default_to``; ``defaulted`` says so, ``named`` keeps what it
      named);
    * ``via``: the instance ids of the routers it passed through (``x-llama-router-via``, every
      such header), ``conv_id``: its ``X-Conversation-Id``, ``fetch_site``: its
      ``Sec-Fetch-Site`` in lower case (``cors``);
    * ``refused``: why the request is refused before anything acts on it (a 400 the edge
      answers, ``middleware.RequestMetricsMiddleware``): more than one
      ``X-Conversation-Id`` (the router would check one stream's owner and llama-server keep
      another) or ``Content-Type``, or a target llama-server would read otherwise than the
      router (``%uXXXX``, percent-encoded bytes that are no UTF-8, a control character in
      the path); None for none;
    * ``target()``: the target upstreams get, encoded from this reading (``upstream_target``);
    * set later: ``member`` (who it is for: its team, flow and priority class,
      ``teams.members``; ``NOBODY``, the one team of a router without keys, until the key
      check says otherwise), ``key_scope`` (the API key's scope when it is scoped; None:
      full access),
      ``key_hash`` (a keyed hash of the API key presented, ``keys.key_hash``; empty without
      keys: what owns the resumable streams it starts),
      ``body`` and ``parsed`` (the JSON object) once read, ``model_id`` (the resolved id,
      for metrics and the activity record), ``queue_s`` (its wait for the model), ``node``
      (the peer that served it);
    * the response as it went out (``sent``: every non-empty body chunk, through the ASGI
      ``send`` or a direct ``http11.BodyWriter``): ``first_sent`` (``perf_counter`` of its
      first chunk, 0 before it), how many chunks went (``chunks``: a stream's events, about
      its tokens) and its last two chunks (``sent_before``, ``sent_last``),
      which the metrics middleware reads for the time to first byte, and ``tail()``: what
      their end says (``tail.ResponseTail``: timings, tokens), read once.
    """

    __slots__ = ("_raw", "_tail", "_target", "body", "chunks", "defaulted", "first_sent",
                 "headers", "json_as_form", "key_hash", "key_scope", "local", "member",
                 "method", "model",
                 "model_id", "named", "node", "params", "parsed", "path", "queue_s", "refused",
                 "scanned", "sent_before", "sent_last", "status", "via")

    def __init__(self, scope: Scope) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        query: bytes = scope["query_string"]
        self.params = QueryParams(query) if query else NO_PARAMS
        self.model: str | None = self.params.get("model") or None if query else None
        self.local = is_local(self.path, self.params)
        raw_path: bytes = scope.get("raw_path") or self.path.encode()
        self._raw = raw_path, query
        self._target: bytes | None = None
        self.refused: BadRequest | None = (
            _unreadable_target(raw_path, query) if b"%" in raw_path or b"%" in query else None)
        kept: dict[bytes, bytes] = {}
        via: tuple[str, ...] = ()
        for name, value in scope["headers"]:
            if name in _KEPT:
                if name not in kept:
                    kept[name] = value
                elif name == CONVERSATION_HEADER:
                    self.refused = BadRequest(
                        "more than one X-Conversation-Id header: send one conversation id")
                elif name == b"content-type":
                    self.refused = BadRequest(
                        "more than one Content-Type header: send one media type")
            elif name == VIA_HEADER:
                via += tuple(hop.strip() for hop in value.decode("latin-1").split(",")
                             if hop.strip())
        self.headers = kept
        self.via = via
        self.key_scope: KeyScope | None = None
        self.member = NOBODY
        self.key_hash = ""
        self.body: bytes | None = None
        self.parsed: dict[str, Any] | None = None
        self.json_as_form = False
        self.scanned: jsonscan.Scanned | None = None
        self.model_id = ""
        self.queue_s: float | None = None
        self.node = ""
        self.defaulted = False
        self.named: str | None = None
        self.first_sent = 0.0
        self.status = 0  # the response's status, once it started
        self.chunks = 0
        self.sent_before = self.sent_last = b""
        self._tail: ResponseTail | None = None

    def sent(self, body: bytes) -> None:
        """A non-empty chunk of the response body went out. O(1), no copies: the streaming
        hot path calls it for every chunk."""
        if not self.first_sent:
            self.first_sent = time.perf_counter()
        self.chunks += 1
        self.sent_before, self.sent_last = self.sent_last, body

    def tail(self) -> ResponseTail:
        """What the end of the response says (``tail``): made once, when the response has
        ended, and read by the lease (the replica's pace) and the metrics (tokens)."""
        if self._tail is None:
            self._tail = ResponseTail(self.sent_before, self.sent_last)
        return self._tail

    def __repr__(self) -> str:  # never the credentials
        return f"<RequestContext {self.method} {self.path[:80]} model={self.model!r}>"

    def default_to(self, default: str) -> str:
        """Route this request to the default model ``default`` (``defaults.DefaultModel``
        chose it): it names none, or names one nobody serves. The name it gave stays in
        ``named``; the body is forwarded as it came."""
        self.named = self.model
        self.model = default
        self.defaulted = True
        return default

    def target(self, model: str | None = None) -> bytes:
        """The request target an upstream gets: what the router read, encoded so that
        llama-server's HTTP library reads the same (``upstream_target``); with ``model``, the
        query's ``model`` set to it (where it is, else added last)."""
        if model is not None:
            return upstream_target(self._raw[0], self.path, self.params, model)
        if self._target is None:
            self._target = upstream_target(self._raw[0], self.path, self.params)
        return self._target

    @property
    def fields(self) -> Mapping[str, Any]:
        """The body's top-level fields as llama-server reads them, the one reading every
        policy decides on (streaming, class, limits, slot, response fields), whatever the
        body's shape: the parsed JSON object, or for a large one the fields ``jsonscan`` read
        (``POLICY_FIELDS``, arrays and objects as ``COMPOUND``); empty for a multipart body
        (llama-server makes each form field a string, which it reads as no value for these)
        or none."""
        if self.parsed is not None:
            return self.parsed
        if self.scanned is not None:
            return self.scanned.fields
        return _NO_FIELDS

    @property
    def json_object(self) -> bool:
        """Whether the body was read as a JSON object (parsed, or scanned when large)."""
        return self.parsed is not None or self.scanned is not None

    def with_field(self, body: bytes, name: str, value: bytes) -> bytes | None:
        """``body`` with its top-level field ``name`` set to ``value`` (JSON already), added as
        the object's last key: the one llama-server's parser and the router's keep, whatever
        the body held before (every other byte kept). None when the body was not read as a
        JSON object in UTF-8 (multipart, none, UTF-16)."""
        if not self.json_object:
            return None
        end = jsonscan.object_end(body)
        if end is None:
            return None
        empty = body[:end].rstrip(b" \t\r\n").endswith(b"{")
        return jsonscan.add_key(body, end, empty, name, value)

    async def rewritten(self, body: bytes) -> bytes:
        """Take ``body`` (a JSON object the router wrote: a model's request policy) as the
        request's body from now on, read again as ``read`` reads one: parsed when small,
        scanned when large. Its model is the one decided already."""
        self.body = body
        self.parsed, self.scanned = None, None
        if len(body) > SMALL_JSON_BYTES:
            self.scanned = await jsonscan.scan(body)
        else:
            self.parsed = parse_json(body)
        return body

    def translated(self, path: str, body: bytes, parsed: dict[str, Any]) -> str:
        """Make this request, from now on, the proxied request ``path`` with the JSON object
        ``parsed`` (written as ``body``) that another API's request translates into (Ollama's:
        ``edge.ollama``): every later decision (route, scope, class, quotas, slot) reads that
        one request, as for a client that sent it. Returns the path it had, which the caller
        puts back when it is done (its metrics and activity are the path the client used)."""
        was, self.path = self.path, path
        self._raw = path.encode(), self._raw[1]
        self._target = None
        self.local = False
        self.body, self.parsed, self.scanned = body, parsed, None
        return was

    def json_scan(self) -> jsonscan.Scanned | None:
        """The body as ``jsonscan`` reads a JSON object (what a rename of its model writes
        with: ``proxy.with_model``), once; None when it was not read as one."""
        if self.scanned is None and self.parsed is not None and self.body:
            self.scanned = jsonscan.scan_now(self.body)
        return self.scanned

    def form_body(self) -> bool:
        """Whether the body is a form (``application/x-www-form-urlencoded``, in any case,
        whatever its parameters): llama-server would read its fields as the request's
        parameters, over the query the router decided on."""
        media = self.headers.get(b"content-type", b"").partition(b";")[0]
        return media.strip().lower() == FORM

    def credential(self) -> bytes:
        """The API key presented: ``Authorization: Bearer K`` (any other Authorization value
        as it is, so that it matches no key), else ``X-Api-Key: K``; empty for none."""
        value = self.headers.get(b"authorization")
        if value:
            return value[7:].strip() if value[:7].lower() == b"bearer " else value
        return self.headers.get(b"x-api-key", b"").strip()

    @property
    def conv_id(self) -> str | None:
        """Its one ``X-Conversation-Id``; the refusal (400) when it sent several, for a
        context no edge checked."""
        value = self.headers.get(CONVERSATION_HEADER)
        if value is None:
            return None
        if self.refused is not None:
            raise self.refused
        return value.decode("latin-1") or None

    @property
    def fetch_site(self) -> bytes | None:
        """``Sec-Fetch-Site`` in lower case (header values such as ``Cross-Site`` are compared
        case-insensitively); None without one."""
        value = self.headers.get(b"sec-fetch-site")
        return value.lower() if value is not None else None

    async def read(self, receive: Receive, limit: int, *, parse: bool = True) -> bytes:
        """The body (read once, refused with 413 past ``limit``); with ``parse``, for POST,
        PUT and PATCH, the ``model`` it names (which wins over ``?model=``) and ``parsed``.
        A body with a form's media type (``form_body``) is refused with 415 unless it was
        read as JSON (``curl -d`` sends JSON so): then ``json_as_form``, and upstreams get
        it as the JSON it is (``proxy.upstream_headers``)."""
        if self.body is None:
            self.body = body = await _read(self.headers.get(b"content-length"), receive, limit)
            if parse and self.method in BODY_METHODS:
                content_type = self.headers.get(b"content-type", b"").decode("latin-1")
                if len(body) > SMALL_JSON_BYTES and not _multipart(content_type):
                    self.scanned = await jsonscan.scan(body)  # not built: see SMALL_JSON_BYTES
                    model = _checked(self.scanned.model)
                else:
                    model, self.parsed = model_from_body(content_type, body)
                if model:
                    self.model = model
            if body and self.form_body():
                if self.parsed is None and self.scanned is None:
                    raise UnsupportedMediaType(
                        "a form body (application/x-www-form-urlencoded) is not accepted: "
                        "llama-server would read its fields as the request's parameters; "
                        "send JSON, multipart/form-data, or the parameters in the query")
                self.json_as_form = True
        return self.body


def context(scope: Scope) -> RequestContext:
    """The request's context: made once (at the edge), then the same object everywhere."""
    found: RequestContext | None = scope.get(CONTEXT)
    if found is None:
        found = scope[CONTEXT] = RequestContext(scope)
    return found


def header(scope: Scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower case) in an ASGI scope."""
    for key, value in scope["headers"]:
        if key == name:
            return value  # type: ignore[no-any-return]
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, refused with 413 past ``limit`` bytes (declared or counted)."""
    return await _read(header(scope, b"content-length"), receive, limit)


async def _read(declared: bytes | None, receive: Receive, limit: int) -> bytes:
    """The body, refused past ``limit`` (declared or counted); a ``bytearray`` when it came in
    several chunks (a ``bytes`` to every reader, never written to again)."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared.decode()} bytes exceeds the limit "
                              f"of {limit}")
    # A body in several chunks grows in one buffer as they arrive (the memory is touched a
    # chunk at a time): joining them at the end would copy it all in one step of the event
    # loop (about 170 ms for 256 MiB). The buffer is the body; nothing writes to it again.
    first = b""
    buffer: bytearray | None = None
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("client disconnected while sending its request")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        if buffer is None:
            if not first:
                first = chunk
            elif chunk:
                buffer = bytearray(first)
                buffer += chunk
        elif chunk:
            buffer += chunk
        if not message.get("more_body", False):
            return first if buffer is None else buffer  # type: ignore[return-value]


def model_from_body(content_type: str, body: bytes) -> tuple[str | None, dict[str, Any] | None]:
    """The ``model`` named by a POST body, and the parsed JSON object when it is JSON.

    Multipart bodies are scanned for a ``model`` form field; anything else must be a JSON
    object (an empty body has no model).
    """
    if _multipart(content_type):
        return _multipart_model(content_type, body), None
    if not body.strip():
        return None, None
    parsed = parse_json(body)
    if not isinstance(parsed, dict):
        raise MalformedBody("request body must be a JSON object")
    model = parsed.get("model")
    if not isinstance(model, str) or not model:
        return None, parsed
    return _checked(model), parsed


def media_kind(content_type: str) -> str:
    """How a body with ``content_type`` is read, by the router and llama-server alike:
    ``MULTIPART`` for exactly ``multipart/form-data`` (as cpp-httplib compares it: the media
    type before any ``;``, spaces and tabs trimmed, in lower case), ``"json"`` for any other
    type but ``multipart/...``; any other ``multipart/`` spelling is refused (400): the router
    and a peer or upstream that compares otherwise would read one body two ways."""
    media = content_type.partition(";")[0].strip(" \t")
    if media == MULTIPART:
        return MULTIPART
    if media[:10].lower() == "multipart/":
        raise BadRequest(
            f"the media type {media[:64]!r} is not accepted: a multipart body must be sent "
            f"as exactly {MULTIPART!r} (lower case), which is how llama-server reads one; "
            "any other spelling it would read as JSON")
    return "json"


def _multipart(content_type: str) -> bool:
    return media_kind(content_type) == MULTIPART


def _checked(model: str | None) -> str | None:
    """``model``, unless it holds a lone surrogate (``_check_unicode``)."""
    if model and not model.isascii():
        _check_unicode(model)
    return model


def parse_json(body: bytes) -> Any:
    """The JSON value of a client's ``body``: the one reader of every JSON a client sends
    (proxied bodies, loads and unloads, reload options, stream lookups).
    ``MalformedBody`` (400) when it is not JSON, ``NestedTooDeeply`` (400) when arrays and
    objects nest deeper than ``MAX_JSON_DEPTH``; never a ``RecursionError``."""
    # A body can nest no deeper than it has brackets: two counts at C speed, and most bodies
    # stop here. Only one with more brackets than the limit is measured (``_too_deep``).
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _too_deep(body):
        raise NestedTooDeeply(f"request body is nested too deeply to read (more than "
                              f"{MAX_JSON_DEPTH} levels of arrays and objects)")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedBody(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise NestedTooDeeply("request body is nested too deeply to read") from None


def _too_deep(body: bytes) -> bool:
    """Whether ``body``'s arrays and objects nest deeper than ``MAX_JSON_DEPTH``: the
    deepest point of its brackets outside strings. Linear in the body, at C speed but for one
    step per bracket left (``_deepest``). A body whose brackets do not pair up is left to the
    parser (which says what is wrong).

    Escaped backslashes, then escaped quotes, go first (left to right, as JSON pairs a run of
    backslashes), so that every quote left delimits a string; of the rest only quotes and
    brackets are kept, and the strings among them dropped."""
    if b'\\"' in body:  # (only an escaped quote could be taken for a string's end)
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    return _deepest(_STRING.sub(b"", body.translate(None, _NOT_STRUCTURE))) > MAX_JSON_DEPTH


def _deepest(brackets: bytes) -> int:
    """How deep ``brackets`` (only ``[]{}``) nest. The empty pairs go first, in one pass (each
    is one level, and most brackets of a wide body are such); then the running count of what
    is open, at each bracket left: twice the opening ones so far less the brackets so far."""
    if not brackets:
        return 0
    inner, removed = _INNERMOST.subn(b"", brackets)
    if not inner:
        return 1 if removed else 0
    rises = accumulate(inner.translate(_RISE))
    deepest: int = max(map(sub, rises, count(1)))
    return deepest + (1 if removed else 0)


def _check_unicode(name: str) -> None:
    """A name escaped in JSON as a lone surrogate (``"\\ud800"``) is no Unicode text: no
    model has it, and no answer or log line could carry it."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise MalformedBody('"model" is not valid Unicode (it holds a lone surrogate such as '
                            '\\ud800)') from None


def _multipart_model(content_type: str, body: bytes) -> str | None:
    span = _model_field(content_type, body)
    if span is None:
        return None
    return body[span[0]:span[1]].decode("utf-8", "replace").strip() or None


def with_multipart_model(content_type: str, body: bytes, model: str, *,
                         add: bool = False) -> bytes:
    """``body`` with the value of its multipart ``model`` field replaced by ``model`` (the
    field ``model_from_body`` reads); without one, unchanged, or with ``add`` given a
    ``model`` field first. Only the value's bytes change (or the new part is added)."""
    span = _model_field(content_type, body)
    if span is not None:
        return body[:span[0]] + model.encode() + body[span[1]:]
    if not add:
        return body
    match = _BOUNDARY.search(content_type)
    assert match is not None  # _model_field refused a body without one
    delimiter = b"--" + match.group(1).encode()
    part = (delimiter + b'\r\nContent-Disposition: form-data; name="model"\r\n\r\n'
            + model.encode() + b"\r\n")
    at = body.find(delimiter)
    if at < 0:  # no part at all: the field alone
        return part + delimiter + b"--\r\n"
    return body[:at] + part + body[at:]


def _unreadable_target(raw_path: bytes, query: bytes) -> BadRequest | None:
    """Why a request target (its path and query as sent, with a percent sign in one of them)
    is refused: an encoding llama-server's HTTP library decodes and the router does not
    (``%uXXXX``), or one the two decode into different text (bytes that are no UTF-8, which
    the router reads as U+FFFD and llama-server as they are), or a path with a control
    character; None when both read it alike."""
    if _PERCENT_U.search(raw_path) or _PERCENT_U.search(query):
        return BadRequest("the request target holds a %u escape (%uXXXX), which is no "
                          "percent-encoding: encode the character's UTF-8 bytes as %XX")
    try:
        path = unquote_to_bytes(raw_path).decode("utf-8")
        unquote_to_bytes(query.replace(b"+", b" ")).decode("utf-8")
    except UnicodeDecodeError:
        return BadRequest("the request target's percent-encoded bytes are not UTF-8")
    if _CONTROL.search(path):
        return BadRequest("the request path holds a control character")
    return None


def upstream_target(raw_path: bytes, path: str, params: QueryParams,
                    model: str | None = None) -> bytes:
    """The target an upstream gets for a request whose decoded ``path`` and query
    (``params``) the router decided on: read by llama-server's HTTP library (cpp-httplib:
    ``%XX`` in the path, ``%XX`` and ``+`` in the query) as exactly that. The path as sent
    when it holds no percent sign (nothing to decode, on either side), else encoded again
    from ``path``; the query encoded again from ``params``: each name once with the value the
    router read (the last), no pair without a name (the library drops those), with ``model``
    set to ``model`` when given (where it is, else added last)."""
    if not raw_path.startswith(b"/") or any(c in raw_path for c in (b" ", b"\r", b"\n")):
        raise BadRequest("malformed request target")
    target = raw_path if b"%" not in raw_path else quote(path, safe="/").encode("ascii")
    if not params and model is None:
        return target
    pairs = {name: value for name, value in params.items() if name}
    if model is not None:
        pairs["model"] = model
    return target + b"?" + urlencode(pairs).encode("ascii")


def _model_field(content_type: str, body: bytes) -> tuple[int, int] | None:
    """Where the value of the multipart ``model`` field (not a file) lies in ``body``; a
    second ``model`` field is refused (400): the router would route by one and a peer
    (llama.cpp reads the form fields into one object) by the other."""
    match = _BOUNDARY.search(content_type)
    if not match:
        raise MalformedBody("multipart request without a boundary")
    delimiter = b"--" + match.group(1).encode()
    if body.count(delimiter) > MAX_PARTS + 1:  # each part is a step below: bounded
        raise PayloadTooLarge(f"multipart body with more than {MAX_PARTS} parts")
    found: tuple[int, int] | None = None
    at = body.find(delimiter)
    while at >= 0:
        start = at + len(delimiter)
        at = body.find(delimiter, start)
        end = len(body) if at < 0 else at
        head_end = body.find(b"\r\n\r\n", start, end)
        if head_end >= 0:
            head = body[start:head_end]
            if _MODEL_PART.search(head) and b"filename=" not in head.lower():
                if found is not None:
                    raise MalformedBody('more than one "model" field in the multipart body: '
                                        "send one")
                value = head_end + 4
                if end - 2 >= value and body[end - 2:end] == b"\r\n":
                    end -= 2  # the line break before the next delimiter is not the value's
                found = value, end
    return found
