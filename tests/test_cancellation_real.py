"""A client that leaves a non-streamed generation frees its llama-server slot, every time.

llama-server b11434 notices a closed connection of a non-streamed request when its wait for
that request's result times out: after 1 s in which *no* result of any of its requests arrived
(``server_response::recv_with_timeout``: every result wakes every waiter, and the wait starts
over). The router closes its connection to the child within about 50 ms of its client leaving;
the child then cancels the task within about a second. Anything that makes the child produce
results more often than once a second (another client's stream, ``/slots`` polled faster than
that) postpones the check until it stops: so this test never polls ``/slots`` after the client
leaves until the child has said, in its log, that it cancelled the task.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest
from support import start_router, wait_until, write_presets

pytestmark = pytest.mark.real

TRIALS = 8
FREED_WITHIN_S = 2.0
GENERATION = json.dumps({"model": "long", "max_tokens": 30000, "ignore_eos": True,
                         "messages": [{"role": "user", "content": "Go on"}]}).encode()
RESULTS = Path("build/reliability/cancellation.json")


def _post(body: bytes, path: bytes = b"/v1/chat/completions") -> bytes:
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path, len(body), body))


class LogFollower(threading.Thread):
    """Follows a model's llama-server log (``/logs/stream?model=``) and sets ``seen`` when a
    line holds ``needle``."""

    def __init__(self, url: str, model: str, needle: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.needle = url, model, needle
        self.seen = threading.Event()
        self.ready = threading.Event()
        self.at = 0.0
        self.stop = False

    def run(self) -> None:
        with httpx.stream("GET", self.url + "/logs/stream", params={"model": self.model},
                          timeout=httpx.Timeout(60, read=None)) as response:
            self.ready.set()
            for line in response.iter_lines():
                if self.needle in line and not self.seen.is_set():
                    self.at = time.monotonic()
                    self.seen.set()
                if self.stop:
                    return


def _status(raw: socket.socket) -> int:
    """The status of the next response on ``raw``, read to its end (Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += raw.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += raw.recv(65536)
    return int(head.split()[1])


def _busy(client: httpx.Client) -> bool:
    slots = client.get("/slots", params={"model": "long"}).json()
    return any(slot["is_processing"] for slot in slots)


def _leave(raw: socket.socket, how: str) -> None:
    if how == "reset":  # an RST, as a killed client's kernel sends
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    raw.close()


def test_a_client_leaving_a_non_streamed_generation_frees_the_slot_every_time(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    presets = write_presets(tmp_path / "models.ini", "version = 1\n"
                            f"[alpha]\nmodel = {tiny_models['alpha']}\nctx-size = 1024\n"
                            f"[long]\nmodel = {tiny_models['long']}\nctx-size = 32768\n"
                            "parallel = 1\n")
    figures: list[dict[str, object]] = []
    with start_router(tmp_path, "--presets", str(presets), "--llama-server",
                      str(llama_server)) as router, router.client() as client:
        for trial in range(TRIALS):
            how = ("close", "reset", "keep-alive")[trial % 3]
            follower = LogFollower(router.url, "long", "cancel task")
            raw = socket.create_connection(("127.0.0.1", router.port))
            if trial == 0 or how == "keep-alive":
                # Refused requests first, on this very connection (the first trial is the
                # first generation of a fresh router, right after them).
                for refused in (b'{"model": "nope", "prompt": "x"}', b'{"prompt": "x"}',
                                b"{"):
                    raw.sendall(_post(refused, b"/completion"))
                    assert _status(raw) in (400, 404)
            raw.sendall(_post(GENERATION))
            assert wait_until(lambda: client.get("/models").status_code == 200 and
                              router.models()["long"]["status"]["value"] == "loaded",
                              60)  # type: ignore[index]
            follower.start()
            assert follower.ready.wait(30)
            assert wait_until(lambda: _busy(client), 30), trial
            left = time.monotonic()
            _leave(raw, how)
            assert follower.seen.wait(30), f"trial {trial}: the child never cancelled"
            assert wait_until(lambda: not _busy(client), 30)
            freed = time.monotonic() - left
            follower.stop = True
            figures.append({"trial": trial, "client": how, "cancelled_s":
                            round(follower.at - left, 3), "freed_s": round(freed, 3)})
            assert freed < FREED_WITHIN_S, figures
            assert wait_until(lambda: router.models()["long"]["status"]["in_flight"] == 0,
                              10)  # type: ignore[index]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(figures, indent=1) + "\n")
