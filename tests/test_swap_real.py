"""Swapping models under load with the real llama-server: a model drained for a waiting swap
while more requests arrive for it, the pattern of a chat UI (a long background request on one
model while the user's next turn goes to another), and a seeded random soak of model switching.

With ``--models-max 1`` a long request keeps model A busy; a request for B waits; past the
fairness bound A drains; a short request for A arrives and queues behind; when the long
request ends, both waiters must be answered (not left until their wait budgets run out with
A left ``draining`` for ever)."""

from __future__ import annotations

import collections
import functools
import json
import os
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import RouterProcess, start_router, wait_until, write_presets

pytestmark = pytest.mark.real

# How long after the long request ends its waiters may still take: a model load (well under
# a second for a tiny model, about a second for SmolLM2) plus a generous margin for a loaded
# 2-core machine.
AFTER_LONG_BOUND_S = 30.0
# The long request aims to run this long (its length comes from SmolLM2's measured speed).
LONG_REQUEST_S = 6.0
ROUNDS = 3
# A long request that ended before the scenario around it was set up (the machine sped up
# after SmolLM2's speed was measured) is no test of the scenario: it is run again, this many
# times at most, each time twice as long.
SETUP_ATTEMPTS = 3


def chat(model: str, tokens: int = 16, content: str = "Hello", **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": tokens,
            "messages": [{"role": "user", "content": content}], **extra}


@dataclass
class Outcome:
    status: int | None = None  # None: no answer (the client gave up, or the request failed)
    content: str = ""  # the generated text
    error: dict[str, Any] | None = None  # the error envelope: the body's, or a stream's event
    done: bool = False  # a stream ended with [DONE]
    exception: str | None = None
    disconnected: bool = False  # the client left on purpose
    headers_s: float | None = None  # seconds to the response's headers
    total_s: float | None = None


def error_of(body: bytes) -> dict[str, Any]:
    """The error envelope of an answer that is not a 200 (its text if it has none)."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return {"message": body[:300].decode(errors="replace")}
    return error if isinstance(error, dict) else {"message": str(error)}


class Request(threading.Thread):
    """One chat completion in the background. ``first_chunk`` is set when a stream's first
    event arrives; ``read_events``: leave a stream after that many events (a client that
    disconnects); ``timeout``: seconds the client waits for any byte."""

    def __init__(self, url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None,
                 timeout: float = 180.0, read_events: int | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers or {}
        self.timeout, self.read_events = timeout, read_events
        self.outcome = Outcome()
        self.first_chunk = threading.Event()
        self.finished = threading.Event()
        self.ended_at = 0.0  # time.monotonic() when it ended

    def run(self) -> None:
        started = time.monotonic()
        try:
            with httpx.Client(base_url=self.url,
                              timeout=httpx.Timeout(self.timeout, connect=10.0)) as client:
                if self.body.get("stream"):
                    self._stream(client, started)
                else:
                    response = client.post("/v1/chat/completions", json=self.body,
                                           headers=self.headers)
                    self.outcome.headers_s = time.monotonic() - started
                    self.outcome.status = response.status_code
                    if response.status_code == 200:
                        reply = response.json()
                        self.outcome.content = reply["choices"][0]["message"]["content"] or ""
                    else:
                        self.outcome.error = error_of(response.content)
        except Exception as exc:  # recorded, and asserted on by the test
            self.outcome.exception = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended_at = time.monotonic()
            self.outcome.total_s = self.ended_at - started
            self.first_chunk.set()
            self.finished.set()

    def _stream(self, client: httpx.Client, started: float) -> None:
        with client.stream("POST", "/v1/chat/completions", json=self.body,
                           headers=self.headers) as response:
            self.outcome.headers_s = time.monotonic() - started
            self.outcome.status = response.status_code
            if response.status_code != 200:
                self.outcome.error = error_of(response.read())
                return
            events = 0
            cut: str | None = None  # an event the stream's end cut short
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                self.first_chunk.set()
                data = line[len("data: "):]
                if data == "[DONE]":
                    self.outcome.done = True
                    continue
                try:
                    event = json.loads(data)
                except json.JSONDecodeError:
                    # A stream the router ends on purpose or after a crash may end inside an
                    # event: that event comes cut short, then the error event (proxy.relay).
                    cut = data
                    continue
                if "error" in event:
                    self.outcome.error = event["error"]
                    continue
                for choice in event.get("choices", []):
                    self.outcome.content += (choice.get("delta") or {}).get("content") or ""
                events += 1
                if self.read_events is not None and events >= self.read_events:
                    self.outcome.disconnected = True
                    return
            if cut is not None and self.outcome.error is None:
                raise ValueError(f"an event cut short with no error event after it: {cut[:80]}")


def statuses(router: RouterProcess) -> dict[str, dict[str, Any]]:
    return {model: data["status"] for model, data in router.models().items()}  # type: ignore[misc]


def show(router: RouterProcess) -> str:
    """The scheduling fields of every model in ``/models``, for failure messages."""
    try:
        found = statuses(router)
    except (httpx.HTTPError, ValueError) as exc:
        return f"/models failed: {exc}"
    parts = []
    for model, status in sorted(found.items()):
        flags = [f for f in ("draining", "stopping", "failed") if status.get(f)]
        parts.append(f"{model} {{{status['value']}, in_flight {status.get('in_flight', 0)}, "
                     f"waiting {status.get('waiting', 0)}{''.join(', ' + f for f in flags)}}}")
    return "; ".join(parts)


def settled(router: RouterProcess) -> bool:
    """Nothing draining, stopping, waiting or in flight."""
    return all(not s.get("draining") and not s.get("stopping") and not s.get("waiting")
               and not s.get("in_flight") for s in statuses(router).values())


def answered(request: Request, what: str, router: RouterProcess) -> str:
    """The content of a request that must have been answered 200 with a real answer."""
    outcome = request.outcome
    assert outcome.exception is None, f"{what}: {outcome.exception}; /models: {show(router)}"
    assert outcome.status == 200, f"{what}: {outcome.status} {outcome.error}; " \
        f"/models: {show(router)}"
    assert outcome.error is None, f"{what}: error event {outcome.error}"
    if request.body.get("stream"):
        assert outcome.done, f"{what}: the stream did not end with [DONE]"
    assert outcome.content.strip(), f"{what}: an empty answer"
    return outcome.content


def long_tokens(client: httpx.Client, seconds: float = LONG_REQUEST_S) -> int:
    """Tokens SmolLM2 generates in about ``seconds`` on this machine now, from the timings of
    a 64-token reply (this also loads it)."""
    reply = client.post("/v1/chat/completions", json=chat("smollm2", 64, ignore_eos=True),
                        timeout=120)
    assert reply.status_code == 200, reply.text
    rate = float(reply.json()["timings"]["predicted_per_second"])
    return max(300, min(3000, int(rate * seconds)))


def swap_presets(tmp_path: Path, smollm2: Path, tiny: Path) -> Path:
    return write_presets(tmp_path / "swap.ini",
                         f"[smollm2]\nmodel = {smollm2}\nctx-size = 4096\nparallel = 1\n"
                         f"[tiny]\nmodel = {tiny}\nctx-size = 1024\nparallel = 1\n")


SWAP_ARGS = ("--models-max", "1", "--fairness", "1", "--wait-budget", "90",
             "--shutdown-grace", "5")


def wait_for_waiter(router: RouterProcess, model: str, request: Request,
                    in_flight_before: int = 0) -> bool:
    """Until ``request`` waits for ``model`` (or got past waiting: in flight, or answered)."""
    def there() -> bool:
        status = statuses(router)[model]
        return (status.get("waiting", 0) >= 1 or status.get("in_flight", 0) > in_flight_before
                or request.finished.is_set())
    return wait_until(there, 30, interval=0.05)


def draining_or_ended(router: RouterProcess, model: str, request: Request) -> bool:
    return bool(statuses(router)[model].get("draining")) or request.finished.is_set()


def test_swap_while_busy_answers_both_waiters(tmp_path: Path, llama_server: Path,
                                              smollm2: Path,
                                              tiny_models: dict[str, Path]) -> None:
    presets = swap_presets(tmp_path, smollm2, tiny_models["alpha"])
    with start_router(tmp_path, "--presets", str(presets), *SWAP_ARGS) as router, \
            router.client() as client:
        tokens = long_tokens(client)
        for round_ in range(1, ROUNDS + 1):
            for attempt in range(1, SETUP_ATTEMPTS + 1):
                where = f"round {round_} of {ROUNDS}, attempt {attempt}"
                if swap_round(router, client, tokens, where,
                              last_attempt=attempt == SETUP_ATTEMPTS):
                    break
                tokens *= 2


def too_soon(router: RouterProcess, requests: dict[str, Request], what: str,
             last_attempt: bool) -> None:
    """A round whose long request ended before the scenario was set up: each of its
    ``requests`` (by description) must still be answered and the router settle; it fails the
    test on the last attempt, else the caller runs the round again, longer."""
    for description, request in requests.items():
        request.join(180)
        answered(request, description, router)
    assert wait_until(lambda: settled(router), 15, interval=0.1), \
        f"{what}; then not settled: {show(router)}"
    first = next(iter(requests.values()))
    assert not last_attempt, f"{what}: {first.outcome}"
    print(f"{what}; again with twice as many")


def swap_round(router: RouterProcess, client: httpx.Client, tokens: int, where: str, *,
               last_attempt: bool) -> bool:
    """One round of the scenario; False if the long request ended before the scenario was
    set up (every request still answered, nothing left waiting): run it again, longer."""
    # 1. A long request keeps smollm2 busy.
    long = Request(router.url, chat("smollm2", tokens, "Tell me a long story.",
                                    stream=True, ignore_eos=True))
    long.start()
    assert long.first_chunk.wait(120), f"{where}: the long request never started"
    assert long.outcome.status == 200, f"{where}: {long.outcome}"
    # 2. A request for tiny waits; past the fairness bound smollm2 drains.
    tiny = Request(router.url, chat("tiny", 16))
    tiny.start()
    assert wait_for_waiter(router, "tiny", tiny), f"{where}: {show(router)}"
    assert wait_until(functools.partial(draining_or_ended, router, "smollm2", long),
                      30, interval=0.05), \
        f"{where}: smollm2 never drained: {show(router)}"
    # 3. A short request for smollm2 arrives while it drains.
    short = Request(router.url, chat("smollm2", 8, "Say hello."))
    short.start()
    assert wait_for_waiter(router, "smollm2", short, in_flight_before=1), \
        f"{where}: {show(router)}"
    if long.finished.is_set():  # too soon: the scenario did not happen
        too_soon(router, {f"{where}: the long request": long,
                          f"{where}: the request for tiny": tiny,
                          f"{where}: the short request for smollm2": short},
                 f"{where}: the long request ({tokens} tokens) ended before the scenario was "
                 f"set up", last_attempt)
        return False
    during = show(router)
    # 4. The long request ends, complete.
    long.join(180)
    answered(long, f"{where}: the long request", router)
    ended = time.monotonic()
    # 5. Both waiters are answered: a load or two later, not when their budgets end.
    for request in (tiny, short):
        request.join(max(0.0, ended + AFTER_LONG_BOUND_S - time.monotonic()))
    waiting = [name for name, r in (("tiny", tiny), ("smollm2", short)) if r.is_alive()]
    assert not waiting, (
        f"{where}: {AFTER_LONG_BOUND_S:g} s after the long request ended, the "
        f"requests for {waiting} still wait; /models: {show(router)} "
        f"(while the long request ran: {during})")
    answered(tiny, f"{where}: the request for tiny", router)
    answered(short, f"{where}: the short request for smollm2", router)
    print(f"{where}: the long request ({tokens} tokens) took "
          f"{long.outcome.total_s:.1f} s; after it ended, tiny was answered in "
          f"{tiny.ended_at - ended:.1f} s, the short smollm2 request in "
          f"{short.ended_at - ended:.1f} s")
    # 6. Nothing is left draining or waiting, and both models answer again.
    assert wait_until(lambda: settled(router), 15, interval=0.1), \
        f"{where}: not settled: {show(router)}"
    for model in ("tiny", "smollm2"):
        again = client.post("/v1/chat/completions", json=chat(model, 8), timeout=120)
        assert again.status_code == 200, f"{where}: {model}: {again.text}"
        assert again.json()["choices"][0]["message"]["content"].strip()
    assert not any(s.get("draining") for s in statuses(router).values()), show(router)
    return True


TITLE_PROMPT = ("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat "
                "history.\n### Chat History:\n<chat_history>\nUSER: What is the capital of "
                "France?\nASSISTANT: {answer}\n</chat_history>")


def test_chat_ui_pattern(tmp_path: Path, llama_server: Path, smollm2: Path,
                         tiny_models: dict[str, Path]) -> None:
    """What a chat UI such as Open WebUI does: after the first answer of model A it generates
    the chat's title with A in the background (streamed, here a long one), while the user
    switches to model B for the next turn (streamed); then the chat's tags with A; then the
    user goes back to A."""
    presets = swap_presets(tmp_path, smollm2, tiny_models["beta"])
    with start_router(tmp_path, "--presets", str(presets), *SWAP_ARGS) as router, \
            router.client() as client:
        tokens = long_tokens(client)
        question = {"role": "user", "content": "What is the capital of France?"}
        turn1 = client.post("/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "temperature": 0, "max_tokens": 32, "messages": [question]})
        assert turn1.status_code == 200, turn1.text
        answer = turn1.json()["choices"][0]["message"]["content"]
        history = [question, {"role": "assistant", "content": answer}]

        for attempt in range(1, SETUP_ATTEMPTS + 1):
            if chat_ui_turns(router, client, tokens, answer, history,
                             last_attempt=attempt == SETUP_ATTEMPTS):
                break
            tokens *= 2


def chat_ui_turns(router: RouterProcess, client: httpx.Client, tokens: int, answer: str,
                  history: list[dict[str, str]], *, last_attempt: bool) -> bool:
    """The title, the user's turn on tiny, the tags and the next turn; False if the title
    ended before the turn on tiny waited for it (both still answered): run it again, longer."""
    title = Request(router.url, {
        "model": "smollm2", "stream": True, "ignore_eos": True,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": TITLE_PROMPT.format(answer=answer)}]})
    title.start()
    assert title.first_chunk.wait(120), "the title request never started"
    turn2 = Request(router.url, {
        "model": "tiny", "stream": True, "max_tokens": 64,
        "messages": [*history, {"role": "user", "content": "And of Germany?"}]})
    turn2.start()
    assert wait_for_waiter(router, "tiny", turn2), show(router)
    if title.finished.is_set():  # too soon: the turn on tiny did not wait behind it
        too_soon(router, {"the title request": title, "the user's turn": turn2},
                 f"the title ({tokens} tokens) ended too soon", last_attempt)
        return False
    during = show(router)

    title.join(180)
    answered(title, "the title request", router)
    ended = time.monotonic()
    # Then the chat's tags, with A again (Open WebUI runs its background tasks one after
    # the other): it arrives as A is drained or stopped for the user's turn.
    tags = Request(router.url, {
        "model": "smollm2", "max_tokens": 16,
        "messages": [{"role": "user", "content": "Generate 1-3 tags for this chat: "
                      f"What is the capital of France? {answer}"}]})
    tags.start()
    for request in (turn2, tags):
        request.join(max(0.0, ended + AFTER_LONG_BOUND_S - time.monotonic()))
    waiting = [name for name, r in (("the user's turn on tiny", turn2),
                                    ("the tags on smollm2", tags)) if r.is_alive()]
    assert not waiting, (
        f"{AFTER_LONG_BOUND_S:g} s after the title ended, {waiting} still wait; "
        f"/models: {show(router)} (while the title streamed: {during})")
    answered(turn2, "the user's turn on tiny", router)
    answered(tags, "the tags request", router)
    print(f"title: {title.outcome.total_s:.1f} s; after it, the turn on tiny was answered "
          f"in {turn2.ended_at - ended:.1f} s, the tags in {tags.ended_at - ended:.1f} s")
    assert wait_until(lambda: settled(router), 15, interval=0.1), show(router)

    turn3 = client.post("/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "max_tokens": 16,
        "messages": [*history, {"role": "user", "content": "Thanks!"}]})
    assert turn3.status_code == 200, turn3.text
    assert not any(s.get("draining") for s in statuses(router).values()), show(router)
    return True


# ------------------------------------------------------------------------------- the soak

SOAK_MODELS = ("alpha", "beta", "gamma", "long")
SOAK_WAIT_BUDGET_S = 8.0
HANG_BOUND_S = 30.0  # past its wait budget, a request must have been answered by then
# A non-streamed answer arrives only once generated: its bound adds the generation at this
# slowest rate (a tiny model on a busy 2-core machine; 6,000 tokens took over 30 s).
SLOWEST_TOKENS_PER_S = 20.0
KINDS = {  # kind: weight
    "short": 5, "long": 2, "stream": 3, "stream-long": 2, "stream-leave": 2, "give-up": 1}


def soak_request(url: str, rng: random.Random) -> tuple[str, str, float, Request]:
    model = rng.choice(SOAK_MODELS)
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    budget = rng.choice([None, None, 2.0, 4.0])
    headers = {} if budget is None else {"X-Wait-Budget": f"{budget:g}"}
    long_tokens_max = 6000 if model == "long" else 900
    tokens = rng.randint(300, long_tokens_max) if "long" in kind or "leave" in kind \
        else rng.randint(4, 48)
    body = chat(model, tokens, rng.choice(["Hello", "Write a poem.", "Count to ten."]),
                ignore_eos=True)
    if kind.startswith("stream"):
        body["stream"] = True
    waits = budget or SOAK_WAIT_BUDGET_S
    generating = 0.0 if kind.startswith("stream") else tokens / SLOWEST_TOKENS_PER_S
    request = Request(url, body, headers=headers,
                      timeout=(rng.uniform(0.2, 2.0) if kind == "give-up"
                               else waits + HANG_BOUND_S + generating),
                      read_events=rng.randint(1, 5) if kind == "stream-leave" else None)
    return model, kind, waits, request


def classify(kind: str, waits: float, outcome: Outcome) -> str:
    """One word for what happened to a request; the test lists which are failures."""
    if outcome.exception is not None:
        if kind == "give-up" and "Timeout" in outcome.exception:
            return "gave-up"
        return "hang" if "Timeout" in outcome.exception else "transport-error"
    if outcome.disconnected:
        return "left"
    status = outcome.status
    message = str((outcome.error or {}).get("message", ""))
    if status == 200:
        if outcome.error is not None:  # a stream's final error event
            code = (outcome.error or {}).get("code")
            return f"stream-error-{code}" + ("-unloaded" if "unload" in message else "")
        if "stream" in kind and not outcome.done:
            return "stream-cut"
        return "200"
    if status == 503:
        if "wait budget" in message:
            too_late = (outcome.headers_s or 0) > waits + 10
            return "503-budget-late" if too_late else "503-budget"
        return "503-unloaded" if "unload" in message else "503-other"
    return str(status)


ALLOWED = {"200", "gave-up", "left", "503-budget", "503-unloaded", "503-other",
           "stream-error-503", "stream-error-503-unloaded"}


def test_seeded_soak_of_model_switching(tmp_path: Path, llama_server: Path,
                                        tiny_models: dict[str, Path]) -> None:
    seed = int(os.environ.get("LLAMA_ROUTER_SOAK_SEED") or random.SystemRandom().randrange(1 << 32))
    seconds = float(os.environ.get("LLAMA_ROUTER_SOAK_SECONDS") or 60)
    rerun = f"seed {seed} (rerun with LLAMA_ROUTER_SOAK_SEED={seed})"
    print(f"soak: {rerun}, {seconds:g} s of traffic")
    text = "[*]\nctx-size = 2048\nparallel = 2\n"
    for name in SOAK_MODELS:
        text += f"[{name}]\nmodel = {tiny_models[name]}\n"
        if name == "long":
            text += "ctx-size = 16384\n"  # 8192 tokens a slot
    presets = write_presets(tmp_path / "soak.ini", text)
    outcomes: list[tuple[str, str, str, Outcome]] = []  # (model, kind, class, outcome)
    admin: list[tuple[str, str, int | str, str]] = []  # (action, model, status, message)
    lock = threading.Lock()
    with start_router(tmp_path, "--presets", str(presets), "--models-max", "2",
                      "--fairness", "1", "--wait-budget", f"{SOAK_WAIT_BUDGET_S:g}",
                      "--shutdown-grace", "5") as router:
        stop_at = time.monotonic() + seconds

        def client_loop(worker: int) -> None:
            rng = random.Random(f"{seed}:{worker}")
            while time.monotonic() < stop_at:
                model, kind, waits, request = soak_request(router.url, rng)
                request.run()  # in this thread
                with lock:
                    outcomes.append((model, kind, classify(kind, waits, request.outcome),
                                     request.outcome))
                time.sleep(rng.uniform(0.0, 0.3))

        def admin_loop() -> None:
            rng = random.Random(f"{seed}:admin")
            with httpx.Client(base_url=router.url, timeout=60) as client:
                while time.monotonic() < stop_at:
                    time.sleep(rng.uniform(1.0, 4.0))
                    action, model = rng.choice(["load", "unload"]), rng.choice(SOAK_MODELS)
                    try:
                        response = client.post(f"/models/{action}", json={"model": model})
                        status: int | str = response.status_code
                        message = response.text[:200]
                    except httpx.HTTPError as exc:
                        status, message = type(exc).__name__, str(exc)
                    with lock:
                        admin.append((action, model, status, message))

        threads = [threading.Thread(target=client_loop, args=(i,), daemon=True)
                   for i in range(5)]
        threads.append(threading.Thread(target=admin_loop, daemon=True))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(1.0, stop_at + SOAK_WAIT_BUDGET_S + 2 * HANG_BOUND_S
                            - time.monotonic()))
        stuck = sum(thread.is_alive() for thread in threads)

        counts = collections.Counter(cls for _, _, cls, _ in outcomes)
        by_kind = collections.Counter(f"{kind}:{cls}" for _, kind, cls, _ in outcomes)
        admin_counts = collections.Counter(f"{a}:{s}" for a, _, s, _ in admin)
        print(f"soak {rerun}: {len(outcomes)} requests: {dict(sorted(counts.items()))}")
        print(f"  by kind: {dict(sorted(by_kind.items()))}")
        print(f"  admin: {dict(sorted(admin_counts.items()))}")
        messages = collections.Counter(str((o.error or {}).get("message", ""))[:120]
                                       for _, _, cls, o in outcomes if cls.startswith(("503",
                                                                                      "stream")))
        for message, n in messages.most_common(8):
            print(f"  {n} x {message}")

        assert not stuck, f"{rerun}: {stuck} client threads never finished; {show(router)}"
        # After the traffic: nothing draining, nothing waiting or in flight, within a bound.
        assert wait_until(lambda: settled(router), 30, interval=0.2), \
            f"{rerun}: not settled 30 s after the traffic stopped: {show(router)}"
        bad = [(model, kind, cls, o) for model, kind, cls, o in outcomes if cls not in ALLOWED]
        bad_admin = [a for a in admin if not (a[2] == 200 or a[2] == 400)]
        # Every model answers a request.
        with router.client() as client:
            for model in SOAK_MODELS:
                reply = client.post("/v1/chat/completions", json=chat(model, 8), timeout=120)
                assert reply.status_code == 200, f"{rerun}: {model}: {reply.text}; {show(router)}"
        assert not any(s.get("draining") for s in statuses(router).values()), \
            f"{rerun}: {show(router)}"
        assert not bad, (f"{rerun}: {len(bad)} requests failed "
                         f"({dict(collections.Counter(cls for _, _, cls, _ in bad))}); first: "
                         + "; ".join(f"{m} {k} {c} {o.status} {o.error or o.exception}"
                                     for m, k, c, o in bad[:5]))
        assert not bad_admin, f"{rerun}: load/unload answers: {bad_admin[:5]}"
