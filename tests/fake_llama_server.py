#!/usr/bin/env python3
"""A fake llama.cpp ``llama-server`` for testing a process supervisor.

Spawn it exactly like the real binary::

    python tests/fake_llama_server.py --host 127.0.0.1 --port 8080 -a tiny -m model.gguf --metrics

Known llama-server flags (``-m/--model``, ``-c/--ctx-size``, ``-np/--parallel``, ``--host``,
``--port``, ``-a/--alias``, ``--metrics``, ``--embedding(s)``, ``--pooling``, ``-ngl``,
``--mmap/--no-mmap``, ``--api-key``, ``--sleep-idle-seconds``) are parsed, some with their
``LLAMA_ARG_*`` environment variables as defaults; every other flag (and the value after it) is
ignored. ``--help`` prints llama-server-style usage; ``--version`` prints ``version: 11434 (fake)``.

Fault knobs (all optional):
  --startup-delay S    every endpoint answers 503 "Loading model" for S seconds after start
  --crash-after S      os._exit(3) S seconds after the process started
  --crash-on-request   os._exit(3) when the first inference request (completion, chat, infill,
                       embeddings) arrives, before any reply
  --unavailable        every inference request is answered 503 "unavailable_error" (a child
                       that cannot take it: llama-server's answer while it loads)
  --ignore-sigterm     SIGTERM is ignored (SIG_IGN), so only SIGKILL (or SIGINT) stops it
  --fail-health        /health stays 503 forever and no ready line is written (a child stuck
                       loading, as far as a router can tell); the other endpoints work normally
  --token-delay S      seconds between generated tokens (default 0.0)
  --exit-on-start N    print a model-load error to stderr and exit with code N at once
  --die-on-slot-save   os._exit(3) halfway through writing a slot file (POST /slots/{id}
                       ?action=save): a child killed during a save

Behaviour: replies are deterministic ("tok0 tok1 ...", 8 tokens unless max_tokens/n_predict say
otherwise); the tokenizer is one token per UTF-8 byte; requests beyond the slot count (-np, 4 by
default) wait for a free slot, as in the real server; errors use llama.cpp's envelope
``{"error":{"code":N,"message":...,"type":...}}``. Like the real server, embeddings need
``--embeddings`` and that flag disables completions (501 not_supported_error otherwise), /metrics
needs ``--metrics``. GET /fake/info reports pid, argv, env var names, in-flight requests and
how many health requests it answered. With ``--slot-save-path DIR``, ``POST /slots/{id}
?action=save|restore|erase`` write, read and forget a slot's tokens as 8 bytes each (``GET
/slots`` reports them as ``n_prompt_tokens``); without it, 501 as the real server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import signal
import socket
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

T0 = time.monotonic()
LOAD_STAGE = {"stages": ["text_model"], "current": "text_model"}
BUILD = "b11434-fake"
N_CTX_TRAIN = 4096
N_EMBD = 8  # size of the fake embedding vectors
DEFAULT_PREDICT = 8  # tokens generated when the request sets no limit
QUIET_PATHS = {"/health", "/v1/health", "/models", "/v1/models", "/props", "/metrics"}
PUBLIC_PATHS = {"/health", "/v1/health", "/fake/info"}  # no API key, no loading gate (info)


def log(msg: str) -> None:
    """One stderr line, flushed at once so a supervisor reading the pipe sees it immediately."""
    print(msg, file=sys.stderr, flush=True)


def notify_router(state: str, payload: dict[str, Any]) -> None:
    """Child mode (``LLAMA_SERVER_ROUTER_PORT`` set), as llama-server: a state line on stdout."""
    if "LLAMA_SERVER_ROUTER_PORT" in os.environ:
        line = json.dumps({"state": state, "payload": payload}, separators=(",", ":"))
        print(f"cmd_child_to_router:state:{line}", flush=True)


def model_entry(state: State) -> dict[str, Any]:
    """The server's /v1/models entry (also its ``ready`` payload in child mode)."""
    size = state.model_size
    return {"id": state.model_id, "aliases": [state.model_id], "tags": [], "object": "model",
            "created": state.created, "owned_by": "llamacpp",
            "meta": {"vocab_type": 2, "n_vocab": 256, "n_ctx": state.n_ctx,
                     "n_ctx_train": N_CTX_TRAIN, "n_embd": N_EMBD, "n_params": size // 4,
                     "size": size, "ftype": "fake"}}


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

HELP = [  # (flags, description, env var) in llama.cpp's --help layout
    ("-h,    --help, --usage", "print usage and exit", None),
    ("--version", "show version and build info", None),
    ("-c,    --ctx-size N", "size of the prompt context (default: 4096, 0 = loaded from model)",
     "LLAMA_ARG_CTX_SIZE"),
    ("--mmap, --no-mmap", "whether to memory-map model (default: enabled)", "LLAMA_ARG_MMAP"),
    ("-ngl,  --gpu-layers, --n-gpu-layers N", "max. number of layers to store in VRAM "
     "(default: -1)", "LLAMA_ARG_N_GPU_LAYERS"),
    ("-m,    --model FNAME", "model path to load", "LLAMA_ARG_MODEL"),
    ("-a,    --alias STRING", "set alias for model name (to be used by REST API)",
     "LLAMA_ARG_ALIAS"),
    ("--host HOST", "ip address to listen, or bind to an UNIX socket if the address ends with "
     ".sock (default: 127.0.0.1)", "LLAMA_ARG_HOST"),
    ("--port PORT", "port to listen (default: 8080)", "LLAMA_ARG_PORT"),
    ("--embedding, --embeddings", "restrict to only support embedding use case; use only with "
     "dedicated embedding models (default: disabled)", "LLAMA_ARG_EMBEDDINGS"),
    ("--pooling {none,mean,cls,last,rank}", "pooling type for embeddings, use model default if "
     "unspecified", "LLAMA_ARG_POOLING"),
    ("-np,   --parallel N", "number of server slots (default: -1, -1 = auto)",
     "LLAMA_ARG_N_PARALLEL"),
    ("--threads-http N", "number of threads used to process HTTP requests (default: -1)",
     "LLAMA_ARG_THREADS_HTTP"),
    ("--api-key KEY", "API key to use for authentication (default: none)", "LLAMA_API_KEY"),
    ("--metrics", "enable prometheus compatible metrics endpoint (default: disabled)",
     "LLAMA_ARG_ENDPOINT_METRICS"),
    ("--sleep-idle-seconds SECONDS", "number of seconds of idleness after which the server "
     "will sleep (default: -1; -1 = disabled)", "LLAMA_ARG_SLEEP_IDLE_SECONDS"),
]


def help_text() -> str:
    lines = ["----- common params -----", ""]
    for flags, desc, env in HELP:
        wrapped = textwrap.wrap(desc, 70) + ([f"(env: {env})"] if env else [])
        lines.append(f"{flags:<40}{wrapped[0]}")
        lines.extend(" " * 40 + more for more in wrapped[1:])
    lines += ["", "----- fake-llama-server knobs -----", ""]
    lines += [f"{k:<40}{v}" for k, v in [
        ("--startup-delay S", "report 'Loading model' for S seconds"),
        ("--crash-after S", "exit with code 3 after S seconds"),
        ("--crash-on-request", "exit with code 3 on the first inference request"),
        ("--unavailable", "answer every inference request 503"),
        ("--ignore-sigterm", "ignore SIGTERM"),
        ("--fail-health", "/health stays 503"),
        ("--token-delay S", "delay between generated tokens (default: 0.0)"),
        ("--exit-on-start N", "fail to load the model and exit with code N"),
    ]]
    return "\n".join(lines) + "\n"


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def _env_flag(name: str) -> bool:
    return _env(name, "").lower() in {"1", "true", "on", "enabled", "yes"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse the flags we know; drop everything else (unknown flags and their values)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    takes_value: set[str] = set()
    switches: set[str] = set()

    def opt(*flags: str, **kw: Any) -> None:
        action = p.add_argument(*flags, **kw)
        (switches if action.nargs == 0 else takes_value).update(flags)

    opt("-h", "--help", "--usage", dest="help", action="store_true")
    opt("--version", action="store_true")
    opt("-m", "--model", default=_env("LLAMA_ARG_MODEL", "models/7B/ggml-model-f16.gguf"))
    opt("-a", "--alias", default=_env("LLAMA_ARG_ALIAS", ""))
    opt("--host", default=_env("LLAMA_ARG_HOST", "127.0.0.1"))
    opt("--port", type=int, default=int(_env("LLAMA_ARG_PORT", "8080")))
    opt("-c", "--ctx-size", type=int, default=int(_env("LLAMA_ARG_CTX_SIZE", "4096")))
    opt("-np", "--parallel", type=int, default=int(_env("LLAMA_ARG_N_PARALLEL", "-1")))
    opt("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers", default="-1")
    opt("--pooling", default=_env("LLAMA_ARG_POOLING", ""))
    opt("--api-key", default=_env("LLAMA_API_KEY", ""))
    opt("--threads-http", type=int, default=int(_env("LLAMA_ARG_THREADS_HTTP", "-1")))
    opt("--sleep-idle-seconds", type=float, default=-1.0)
    opt("--metrics", action="store_true", default=_env_flag("LLAMA_ARG_ENDPOINT_METRICS"))
    opt("--embedding", "--embeddings", dest="embeddings", action="store_true",
        default=_env_flag("LLAMA_ARG_EMBEDDINGS"))
    opt("--mmap", dest="mmap", action="store_true", default=True)
    opt("--no-mmap", dest="mmap", action="store_false")
    # fault knobs
    opt("--startup-delay", type=float, default=0.0)
    opt("--crash-after", type=float, default=None)
    opt("--crash-on-request", action="store_true")
    opt("--unavailable", action="store_true")
    opt("--ignore-sigterm", action="store_true")
    opt("--fail-health", action="store_true")
    opt("--token-delay", type=float, default=0.0)
    opt("--exit-on-start", type=int, default=None)
    opt("--die-on-slot-save", action="store_true")
    opt("--slot-save-path", default="")

    # Keep only known tokens, rewriting "FLAG VALUE" as "FLAG=VALUE" so that argparse never
    # mistakes an unknown flag for a known short option with a glued value (-ctk -> -c tk).
    kept: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in switches:
            kept.append(tok)
        elif tok in takes_value and i + 1 < len(argv):
            kept.append(f"{tok}={argv[i + 1]}")
            i += 1
        elif "=" in tok and tok.split("=", 1)[0] in takes_value:
            kept.append(tok)
        i += 1
    args, _ = p.parse_known_args(kept)
    return args


# --------------------------------------------------------------------------------------------
# Server state
# --------------------------------------------------------------------------------------------


class ApiError(Exception):
    """Turned into llama.cpp's error envelope by the app's exception handler."""

    def __init__(self, code: int, message: str, kind: str, **extra: Any) -> None:
        super().__init__(message)
        self.code, self.message, self.kind, self.extra = code, message, kind, extra


def error_response(code: int, message: str, kind: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message, "type": kind, **extra}},
                        status_code=code)


@dataclass
class State:
    args: argparse.Namespace
    model_id: str
    n_slots: int
    n_ctx: int  # per slot, as reported by /v1/models
    model_size: int = 1 << 20
    created: int = field(default_factory=lambda: int(time.time()))
    busy: dict[int, int] = field(default_factory=dict)  # slot id -> task id
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    in_flight: int = 0
    next_task: int = 0
    inference_seen: bool = False
    prompt_tokens: int = 0
    predicted_tokens: int = 0
    prompt_seconds: float = 0.0
    predicted_seconds: float = 0.0
    n_decode: int = 0
    busy_slot_sum: int = 0  # sum over decode steps of busy slots, for n_busy_slots_per_decode
    health_requests: int = 0  # requests to /health and /v1/health, loading or not
    cached: dict[int, int] = field(default_factory=dict)  # slot id -> tokens it holds

    def loading(self) -> bool:
        return time.monotonic() - T0 < float(self.args.startup_delay)

    async def acquire_slot(self) -> tuple[int, int]:
        """Wait for a free slot (requests beyond -np are deferred), return (slot, task)."""
        task = self.next_task = self.next_task + 1
        while True:
            free = [s for s in range(self.n_slots) if s not in self.busy]
            if free:
                self.busy[free[0]] = task
                return free[0], task
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.waiters.append(fut)
            try:
                await fut
            finally:
                self.waiters.remove(fut)

    def release_slot(self, slot: int) -> None:
        # Synchronous on purpose: it runs in finally blocks of cancelled generators.
        self.busy.pop(slot, None)
        for fut in self.waiters:
            if not fut.done():
                fut.set_result(None)


def write_slot_file(path: str, data: bytes, *, die_halfway: bool) -> None:
    """A slot save (tiny files: written at once)."""
    with open(path, "wb") as f:
        if die_halfway:
            f.write(data[: len(data) // 2])
            f.flush()
            crash("during a slot save")
        f.write(data)


def slot_file_size(path: str) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def crash(reason: str) -> None:
    log(f"fake-llama-server: simulated crash ({reason}), exit code 3")
    os._exit(3)


async def generate(state: State, n_prompt: int, n_predict: int,
                   disconnected: Callable[[], Awaitable[bool]] | None = None,
                   ) -> AsyncGenerator[str, None]:
    """Yield the deterministic reply one token at a time while holding a slot."""
    slot, task = await state.acquire_slot()
    log(f"slot launch_slot_: id {slot:2d} | task {task} | processing task")
    state.cached[slot] = n_prompt + n_predict
    state.prompt_tokens += n_prompt
    state.prompt_seconds += n_prompt * 1e-4
    done = False
    try:
        for i in range(n_predict):
            t = time.monotonic()
            await asyncio.sleep(state.args.token_delay if i else 0)
            if disconnected is not None and await disconnected():
                break
            state.predicted_tokens += 1
            state.n_decode += 1
            state.busy_slot_sum += len(state.busy)
            state.predicted_seconds += time.monotonic() - t
            yield f"tok{i}" if i == 0 else f" tok{i}"
        else:
            done = True
    finally:
        state.release_slot(slot)
        if done:
            log(f"slot      release: id {slot:2d} | task {task} | stop processing")
        else:
            log(f"srv          stop: cancel task, id_task = {task}")


def timings(n_prompt: int, n_pred: int, seconds: float) -> dict[str, float]:
    p_ms, g_ms = max(n_prompt * 0.1, 0.001), max(seconds * 1000, 0.001)
    return {"cache_n": 0, "prompt_n": n_prompt, "prompt_ms": p_ms,
            "prompt_per_token_ms": p_ms / max(n_prompt, 1),
            "prompt_per_second": n_prompt * 1000 / p_ms, "predicted_n": n_pred,
            "predicted_ms": g_ms, "predicted_per_token_ms": g_ms / max(n_pred, 1),
            "predicted_per_second": n_pred * 1000 / g_ms}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class TrackedStream(StreamingResponse):
    """SSE response that ends the request's in-flight count when the stream ends or the client
    goes away (starlette cancels the body iterator on http.disconnect)."""

    def __init__(self, body: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._body, self._on_close = body, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self._body.aclose()  # runs generator finally blocks if parked at a yield


# --------------------------------------------------------------------------------------------
# Request helpers
# --------------------------------------------------------------------------------------------


async def read_json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise ApiError(500, f"[json.exception.parse_error.101] {exc}", "server_error") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_request_error")
    return body


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def render_chatml(messages: list[Any]) -> str:
    """The Qwen2 ChatML template, including its default system message."""
    msgs = [m for m in messages if isinstance(m, dict)]
    out = "" if msgs and msgs[0].get("role") == "system" else \
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
    for m in msgs:
        out += f"<|im_start|>{m.get('role', 'user')}\n{text_of(m.get('content'))}<|im_end|>\n"
    return out + "<|im_start|>assistant\n"


def prompt_text(prompt: Any) -> str:
    if isinstance(prompt, list):  # token ids, or a list of prompts (only the first is used)
        if all(isinstance(t, int) for t in prompt):
            return bytes(t % 256 for t in prompt).decode(errors="replace")
        return prompt_text(prompt[0]) if prompt else ""
    return prompt if isinstance(prompt, str) else ""


def predict_count(body: dict[str, Any], *keys: str) -> tuple[int, bool]:
    """(number of tokens to generate, whether the request set the limit)."""
    for key in keys:
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            return v, True
    return DEFAULT_PREDICT, False


def embed(text: str) -> list[float]:
    vec = [(b - 127.5) / 127.5 for b in hashlib.sha256(text.encode()).digest()[:N_EMBD]]
    norm = math.sqrt(sum(x * x for x in vec)) or 1.0
    return [round(x / norm, 6) for x in vec]


# --------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------


def build_app(state: State) -> ASGIApp:
    args = state.args

    def check_ctx(n_prompt: int) -> None:
        if n_prompt > state.n_ctx:
            raise ApiError(400, f"request ({n_prompt} tokens) exceeds the available context size "
                           f"({state.n_ctx} tokens), try increasing it",
                           "exceed_context_size_error", n_prompt_tokens=n_prompt, n_ctx=state.n_ctx)

    def inference(handler: Callable[[Request], Awaitable[Response]],
                  ) -> Callable[[Request], Awaitable[Response]]:
        """Crash knob, mode checks and in-flight accounting shared by inference endpoints."""

        async def wrapped(request: Request) -> Response:
            if args.crash_on_request and not state.inference_seen:
                crash("--crash-on-request")
            state.inference_seen = True
            if args.unavailable:
                raise ApiError(503, "Loading model", "unavailable_error")
            is_embd = "embedding" in request.url.path
            if is_embd and not args.embeddings:
                raise ApiError(501, "This server does not support embeddings. Start it with "
                               "`--embeddings`", "not_supported_error")
            if not is_embd and args.embeddings:
                raise ApiError(501, "This server does not support completions. Start it without "
                               "`--embeddings`", "not_supported_error")
            state.in_flight += 1
            handed_off = False
            try:
                resp = await handler(request)
                handed_off = isinstance(resp, TrackedStream)
                return resp
            finally:
                if not handed_off:
                    state.in_flight -= 1

        return wrapped

    def end_stream() -> None:
        state.in_flight -= 1

    async def collect(request: Request, n_prompt: int, n_predict: int,
                      ) -> tuple[str, int, float]:
        """Run a non-streamed generation: (text, tokens, seconds). Stops if the client left."""
        t = time.monotonic()
        gen = generate(state, n_prompt, n_predict, request.is_disconnected)
        async with contextlib.aclosing(gen):
            toks = [tok async for tok in gen]
        return "".join(toks), len(toks), time.monotonic() - t

    # ---- chat / OpenAI completions ---------------------------------------------------------
    async def chat(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise ApiError(400, "'messages' is required", "invalid_request_error")
        return await openai_reply(request, body, render_chatml(body["messages"]), chat=True)

    async def oai_completions(request: Request) -> Response:
        body = await read_json(request)
        return await openai_reply(request, body, prompt_text(body.get("prompt")), chat=False)

    async def openai_reply(request: Request, body: dict[str, Any], prompt: str,
                           chat: bool) -> Response:
        n_prompt = len(prompt.encode())
        check_ctx(n_prompt)
        n_predict, limited = predict_count(body, "max_completion_tokens", "max_tokens",
                                           "n_predict")
        finish = "length" if limited else "stop"
        model = body.get("model") or state.model_id
        head = {"created": int(time.time()), "model": model, "system_fingerprint": BUILD,
                "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex}
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str | None, fin: str | None, first: bool = False) -> dict[str, Any]:
            if not chat:
                return {"text": text or "", "index": 0, "logprobs": None, "finish_reason": fin}
            if body.get("stream"):
                delta: dict[str, Any] = {"role": "assistant", "content": None} if first else \
                    ({} if text is None else {"content": text})
                return {"finish_reason": fin, "index": 0, "delta": delta}
            return {"finish_reason": fin, "index": 0,
                    "message": {"role": "assistant", "content": text}}

        def usage(n: int) -> dict[str, Any]:
            return {"completion_tokens": n, "prompt_tokens": n_prompt,
                    "total_tokens": n + n_prompt, "prompt_tokens_details": {"cached_tokens": 0}}

        if not body.get("stream"):
            text, n, secs = await collect(request, n_prompt, n_predict)
            return JSONResponse({"choices": [choice(text, finish)], **head, "object": kind,
                                 "usage": usage(n), "timings": timings(n_prompt, n, secs)})

        async def events() -> AsyncGenerator[str, None]:
            t, n = time.monotonic(), 0
            obj = kind + ".chunk" if chat else kind
            if chat:
                yield sse({"choices": [choice(None, None, first=True)], **head, "object": obj})
            async with contextlib.aclosing(generate(state, n_prompt, n_predict)) as gen:
                async for tok in gen:
                    n += 1
                    yield sse({"choices": [choice(tok, None)], **head, "object": obj})
            tim = timings(n_prompt, n, time.monotonic() - t)
            yield sse({"choices": [choice(None, finish)], **head, "object": obj, "timings": tim})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield sse({"choices": [], **head, "object": obj, "usage": usage(n)})
            yield "data: [DONE]\n\n"

        return TrackedStream(events(), end_stream)

    # ---- native /completion and /infill ----------------------------------------------------
    async def native(request: Request) -> Response:
        body = await read_json(request)
        prompt = prompt_text(body.get("prompt"))
        if request.url.path == "/infill":
            prompt = f"{body.get('input_prefix', '')}{prompt}{body.get('input_suffix', '')}"
        n_prompt = len(prompt.encode())
        check_ctx(n_prompt)
        n_predict, limited = predict_count(body, "n_predict", "max_tokens")
        model = body.get("model") or state.model_id
        base: dict[str, Any] = {"index": 0, "tokens": [], "id_slot": 0, "model": model,
                                "tokens_evaluated": n_prompt}

        def final(content: str, n: int, secs: float) -> dict[str, Any]:
            return {**base, "content": content, "stop": True, "tokens_predicted": n,
                    "prompt": prompt, "has_new_line": False, "truncated": False,
                    "stop_type": "limit" if limited else "eos", "stopping_word": "",
                    "tokens_cached": n_prompt + n, "timings": timings(n_prompt, n, secs),
                    "generation_settings": {"n_predict": n_predict, "n_ctx": state.n_ctx}}

        if not body.get("stream"):
            return JSONResponse(final(*await collect(request, n_prompt, n_predict)))

        async def events() -> AsyncGenerator[str, None]:
            t, n = time.monotonic(), 0
            async with contextlib.aclosing(generate(state, n_prompt, n_predict)) as gen:
                async for tok in gen:
                    n += 1
                    yield sse({**base, "content": tok, "stop": False, "tokens_predicted": n})
            yield sse(final("", n, time.monotonic() - t))  # native streams have no [DONE]

        return TrackedStream(events(), end_stream)

    # ---- embeddings, tokenizer, template ---------------------------------------------------
    async def embeddings(request: Request) -> Response:
        body = await read_json(request)
        raw = body.get("input", body.get("content", ""))
        raw = raw if isinstance(raw, list) and raw and not isinstance(raw[0], int) else [raw]
        texts = [prompt_text(x) for x in raw]
        n_tok = sum(len(x.encode()) for x in texts)
        if request.url.path != "/v1/embeddings":  # native shape: one pooled vector per input
            return JSONResponse([{"index": i, "embedding": [embed(x)]} for i, x in
                                 enumerate(texts)])
        return JSONResponse({"model": body.get("model") or state.model_id, "object": "list",
                             "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok},
                             "data": [{"index": i, "object": "embedding", "embedding": embed(x)}
                                      for i, x in enumerate(texts)]})

    async def tokenize(request: Request) -> Response:
        body = await read_json(request)
        ids = list(text_of(body.get("content", "")).encode())
        if body.get("with_pieces"):
            return JSONResponse({"tokens": [{"id": b, "piece": chr(b) if b < 128 else [b]}
                                            for b in ids]})
        return JSONResponse({"tokens": ids})

    async def detokenize(request: Request) -> Response:
        toks = (await read_json(request)).get("tokens") or []
        data = bytes(t for t in toks if isinstance(t, int) and 0 <= t < 256)
        return JSONResponse({"content": data.decode(errors="replace")})

    async def apply_template(request: Request) -> Response:
        body = await read_json(request)
        if not isinstance(body.get("messages"), list):
            raise ApiError(400, "'messages' is required", "invalid_request_error")
        return JSONResponse({"prompt": render_chatml(body["messages"])})

    # ---- introspection ---------------------------------------------------------------------
    async def health(_: Request) -> Response:
        if args.fail_health or state.loading():
            return error_response(503, "Loading model", "unavailable_error")
        return JSONResponse({"status": "ok"})

    async def models(_: Request) -> Response:
        mid = state.model_id
        return JSONResponse({
            "models": [{"name": mid, "model": mid, "modified_at": "", "size": "", "digest": "",
                        "type": "model", "description": "", "tags": [""],
                        "capabilities": ["embedding" if args.embeddings else "completion"],
                        "parameters": "", "details": {"parent_model": "", "format": "gguf",
                        "family": "", "families": [""], "parameter_size": "",
                        "quantization_level": ""}}],
            "object": "list", "data": [model_entry(state)]})

    async def props(_: Request) -> Response:
        return JSONResponse({
            "default_generation_settings": {"params": {"n_predict": -1, "temperature": 0.8,
                                                       "stream": False}, "n_ctx": state.n_ctx},
            "total_slots": state.n_slots, "model_alias": state.model_id,
            "model_path": args.model,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": args.metrics,
            "chat_template": "{% for message in messages %}<|im_start|>...{% endfor %}",
            "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "build_info": BUILD,
            "is_sleeping": False})

    async def props_post(_: Request) -> Response:
        return error_response(501, "This server does not support changing global properties. "
                              "Start it with `--props`", "not_supported_error")

    async def slots(request: Request) -> Response:
        if request.query_params.get("fail_on_no_slot") and len(state.busy) >= state.n_slots:
            return error_response(503, "no slot available", "unavailable_error")
        return JSONResponse([{"id": s, "id_task": state.busy.get(s, -1), "n_ctx": state.n_ctx,
                              "speculative": False, "is_processing": s in state.busy,
                              "n_prompt_tokens": state.cached.get(s, 0)}
                             for s in range(state.n_slots)])

    async def slot_action(request: Request) -> Response:
        if not args.slot_save_path:
            return error_response(501, "This server does not support slots action. Start it "
                                  "with `--slot-save-path`", "not_supported_error")
        slot = int(request.path_params["slot"])
        action = request.query_params.get("action")
        if action == "erase":
            state.cached.pop(slot, None)
            return JSONResponse({"id_slot": slot, "n_erased": 0})
        filename = (await request.json()).get("filename", "")
        path = os.path.join(args.slot_save_path, filename)
        if action == "save":
            tokens = state.cached.get(slot, 0)
            data = b"\x01" * (8 * tokens)
            write_slot_file(path, data, die_halfway=args.die_on_slot_save)
            return JSONResponse({"id_slot": slot, "filename": filename, "n_saved": tokens,
                                 "n_written": len(data), "timings": {"save_ms": 0.1}})
        if action == "restore":
            size = slot_file_size(path)
            if size is None:
                return error_response(400, "Unable to restore slot: No available space in KV "
                                      "cache or invalid slot save file",
                                      "invalid_request_error")
            state.cached[slot] = size // 8
            return JSONResponse({"id_slot": slot, "filename": filename,
                                 "n_restored": size // 8, "n_read": size,
                                 "timings": {"restore_ms": 0.1}})
        return error_response(400, "Invalid action", "invalid_request_error")

    async def metrics(_: Request) -> Response:
        if not args.metrics:
            return error_response(501, "This server does not support metrics endpoint. Start it "
                                  "with `--metrics`", "not_supported_error")
        rows: list[tuple[str, str, str, float]] = [
            ("prompt_tokens_total", "counter", "Number of prompt tokens processed.",
             state.prompt_tokens),
            ("prompt_tokens_cached_total", "counter",
             "Number of prompt tokens reused from the cache", 0),
            ("prompt_seconds_total", "counter", "Prompt process time", state.prompt_seconds),
            ("tokens_predicted_total", "counter", "Number of generation tokens processed.",
             state.predicted_tokens),
            ("tokens_predicted_seconds_total", "counter", "Predict process time",
             state.predicted_seconds),
            ("n_decode_total", "counter", "Total number of llama_decode() calls",
             state.n_decode),
            ("n_busy_slots_per_decode", "counter",
             "Average number of busy slots per llama_decode() call",
             state.busy_slot_sum / max(state.n_decode, 1)),
            ("requests_processing", "gauge", "Number of requests processing.", len(state.busy)),
            ("requests_deferred", "gauge", "Number of requests deferred.", len(state.waiters)),
        ]
        text = "".join(f"# HELP llamacpp:{n} {h}\n# TYPE llamacpp:{n} {t}\nllamacpp:{n} "
                       f"{v if isinstance(v, int) else f'{v:.6g}'}\n" for n, t, h, v in rows)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def fake_info(_: Request) -> Response:
        return JSONResponse({"pid": os.getpid(), "argv": sys.argv, "env_keys": sorted(os.environ),
                             "in_flight": state.in_flight, "busy_slots": len(state.busy),
                             "loading": state.loading(), "model_id": state.model_id,
                             "health_requests": state.health_requests})

    async def not_found(_: Request, __: Exception) -> Response:
        return error_response(404, "File Not Found", "not_found_error")

    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc.code, exc.message, exc.kind, **exc.extra)

    get, post = ["GET"], ["POST"]
    routes = [Route(p, health, methods=get) for p in ("/health", "/v1/health")]
    routes += [Route(p, models, methods=get) for p in ("/models", "/v1/models", "/api/tags")]
    routes += [Route("/props", props, methods=get), Route("/props", props_post, methods=post),
               Route("/slots", slots, methods=get), Route("/metrics", metrics, methods=get),
               Route("/slots/{slot:int}", slot_action, methods=post),
               Route("/fake/info", fake_info, methods=get)]
    for paths, fn in [
        (("/v1/chat/completions", "/chat/completions"), chat),
        (("/v1/completions",), oai_completions),
        (("/completion", "/completions", "/infill"), native),
        (("/v1/embeddings", "/embeddings", "/embedding"), embeddings),
    ]:
        routes += [Route(p, inference(fn), methods=post) for p in paths]
    routes += [Route("/tokenize", tokenize, methods=post),
               Route("/detokenize", detokenize, methods=post),
               Route("/apply-template", apply_template, methods=post)]
    inner = Starlette(routes=routes, exception_handlers={
        404: not_found, 405: not_found, ApiError: api_error})
    return Gate(inner, state)


class Gate:
    """Outer ASGI layer: API key check, 503 while loading, one log line per request."""

    def __init__(self, app: ASGIApp, state: State) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, status = scope["path"], 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        args = self.state.args
        key = args.api_key
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        given = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ")
        if path in ("/health", "/v1/health"):
            self.state.health_requests += 1  # also those answered "Loading model"
        try:
            if key and path not in PUBLIC_PATHS and given != key:
                resp: ASGIApp = error_response(401, "Invalid API Key", "authentication_error")
            elif self.state.loading() and path != "/fake/info":
                resp = error_response(503, "Loading model", "unavailable_error")
            else:
                resp = self.app
            await resp(scope, receive, send_wrapper)
        finally:
            if path not in QUIET_PATHS:
                host = (scope.get("client") or ("?", 0))[0]
                log(f"srv  log_server_r: request: {scope['method']} {path} {host} {status}")


# --------------------------------------------------------------------------------------------
# Process / uvicorn plumbing
# --------------------------------------------------------------------------------------------


class FakeServer(uvicorn.Server):
    """uvicorn.Server with our own signal handling (so --ignore-sigterm really ignores it)."""

    def __init__(self, config: uvicorn.Config, state: State) -> None:
        super().__init__(config)
        self.state = state

    def install_signal_handlers(self) -> None:
        def on_signal(signum: int, _frame: object) -> None:
            if self.should_exit:
                log("Received second interrupt, terminating immediately.")
                os._exit(1)
            log("srv    operator(): operator(): cleaning up before exit...")
            self.should_exit = self.force_exit = True  # don't wait for open streams

        signal.signal(signal.SIGINT, on_signal)
        ignore = self.state.args.ignore_sigterm
        signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else on_signal)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        self.install_signal_handlers()
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        args = self.state.args
        try:
            await super().startup(sockets)
        except SystemExit:  # uvicorn exits 3 on bind errors; llama-server exits 1
            log(f"main: couldn't bind HTTP server socket, hostname: {args.host}, "
                f"port: {args.port}")
            raise SystemExit(1) from None
        self.install_signal_handlers()  # again, in case anything replaced them during startup
        port = args.port
        with contextlib.suppress(Exception):  # the real port when --port 0 was given
            port = self.servers[0].sockets[0].getsockname()[1]
        log(f"main: HTTP server is listening, hostname: {args.host}, port: {port}, "
            "http threads: 4")
        loop = asyncio.get_running_loop()
        loop.call_later(max(0.0, args.startup_delay - (time.monotonic() - T0)),
                        self.loaded, args.host, port)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        # Leave now: letting asyncio.run() cancel still-open streams makes uvicorn print
        # tracebacks, and the real server does not drain in-flight generations either.
        log("main: exiting")
        os._exit(0)

    def loaded(self, host: str, port: int) -> None:
        log(f"srv    load_model: initializing, n_slots = {self.state.n_slots}, "
            f"n_ctx_slot = {self.state.n_ctx}")
        notify_router("loading", {**LOAD_STAGE, "value": 1.0})
        log("main: model loaded")
        if not self.state.args.fail_health:
            notify_router("ready", model_entry(self.state))
        log(f"main: server is listening on http://{host}:{port} - starting the main loop")
        log("srv  update_slots: all slots are idle")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.help:
        sys.stdout.write(help_text())
        return 0
    if args.version:
        log(f"version: 11434 (fake)\nbuilt with python {sys.version.split()[0]} for fake")
        return 0
    log(f"build: 11434 (fake) with python {sys.version.split()[0]} for fake")
    log(f"srv    load_model: loading model '{args.model}'")
    if args.exit_on_start is not None:
        log(f"llama_model_load: error loading model: fake failure (--exit-on-start) '{args.model}'")
        log(f"common_init_from_params: error: failed to load model '{args.model}'")
        log("main: exiting due to model loading error")
        return int(args.exit_on_start)
    if args.crash_after is not None:
        delay = max(0.0, args.crash_after - (time.monotonic() - T0))
        timer = threading.Timer(delay, crash, args=("--crash-after",))
        timer.daemon = True
        timer.start()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    explicit_np = args.parallel > 0
    n_slots = args.parallel if explicit_np else 4
    n_ctx_total = args.ctx_size if args.ctx_size > 0 else N_CTX_TRAIN
    # with an explicit -np the context is split between slots; auto (-1) means a unified cache
    state = State(args=args, model_id=args.alias or args.model, n_slots=n_slots,
                  n_ctx=max(1, n_ctx_total // n_slots) if explicit_np else n_ctx_total)
    if os.path.isfile(args.model):
        state.model_size = os.path.getsize(args.model)
    notify_router("loading", {**LOAD_STAGE, "value": 0.0})
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level="warning",
                            lifespan="off", http="h11", ws="none", access_log=False)
    FakeServer(config, state).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
