"""Helpers for tests/test_slot_state_real.py: a real llama-server started directly (no router)
with ``--slot-save-path``, and small wrappers around its ``/completion`` and ``/slots/{id}``
endpoints. The contract these pin down (b11434) is written up in that test module's docstrings.

Layout of a slot file as b11434 writes it (little-endian; llama.h and server-common.cpp):

* ``u32`` magic ``0x67677371`` (``'ggsq'``, ``LLAMA_STATE_SEQ_MAGIC``), ``u32`` version ``4``,
  ``u32`` n_words: the number of 32-bit words of the token block that follows;
* the token block (``server_tokens::serialize``): ``i32 -1`` (``LLAMA_TOKEN_NULL``), ``u32`` its
  version ``1``, ``u32`` n_tokens, the n_tokens tokens, ``u32`` the media-key count (then keys);
* the KV state of that one sequence (``llama_kv_cache::state_write``): ``u32`` n_stream, then per
  stream a ``u32`` cell count and the cells.
"""

from __future__ import annotations

import contextlib
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from support import llama_server_process, wait_until

from router.children.process import free_port

STATE_SEQ_MAGIC = 0x67677371  # 'ggsq'
STATE_SEQ_VERSION = 4
HEADER = struct.Struct("<III")  # magic, version, n_words
TOKEN_BLOCK_HEADER = struct.Struct("<iII")  # LLAMA_TOKEN_NULL, block version, n_tokens

# Only there to catch a hang: every call here takes milliseconds to seconds.
HANG_GUARD_S = 120.0

# The one message llama-server gives for every restore that fails inside llama.cpp (missing
# file, bad magic, truncated token block, layout mismatch...): the reason is only in its log.
GENERIC_RESTORE_ERROR = ("Unable to restore slot: No available space in KV cache or invalid "
                         "slot save file")


@dataclass
class Child:
    """A running llama-server: its process, URL, log and slot directory."""

    proc: Any
    url: str
    log_path: Path
    slot_dir: Path | None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_errors(self) -> list[str]:
        """The log's error lines (llama.cpp's `` E `` level), without their timestamps."""
        return [re.sub(r"^\S+ E ", "", line) for line in self.log().splitlines()
                if re.match(r"^\S+ E ", line)]

    def logged_error(self, text: str) -> bool:
        """Whether an error line with ``text`` reaches the log (within the hang guard).
        llama-server writes its log from a thread of its own: a line about a request may
        come after the answer to it, later still on a busy machine."""
        return wait_until(lambda: any(text in line for line in self.log_errors()),
                          HANG_GUARD_S, interval=0.05)

    def post(self, path: str, body: Any = None, *, timeout: float = HANG_GUARD_S,
             **kw: Any) -> httpx.Response:
        if body is not None:
            kw["json"] = body
        return httpx.post(self.url + path, timeout=timeout, **kw)

    def complete(self, prompt: str, n_predict: int = 8, **extra: Any) -> dict[str, Any]:
        """A greedy ``/completion``; the parsed answer (asserting 200)."""
        response = self.post("/completion", {"prompt": prompt, "n_predict": n_predict,
                                             "temperature": 0, "cache_prompt": True, **extra})
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    def slot(self, id_slot: int | str, action: str, filename: str | None = None,
             **kw: Any) -> httpx.Response:
        body = None if filename is None else {"filename": filename}
        return self.post(f"/slots/{id_slot}?action={action}", body, **kw)

    def slots(self) -> list[dict[str, Any]]:
        listing: list[dict[str, Any]] = httpx.get(self.url + "/slots", timeout=HANG_GUARD_S).json()
        return listing


@contextlib.contextmanager
def llama_child(binary: Path, model: Path, workdir: Path, *extra: str, ctx: int = 1024,
                parallel: int = 1, threads: int = 1,
                slot_dir: Path | None = None) -> Iterator[Child]:
    """llama-server on a free port with ``model``, ``-c ctx -np parallel -t threads`` and,
    unless ``slot_dir`` is None, ``--slot-save-path slot_dir``: healthy when yielded, stopped
    (terminated, killed if it lingers) afterwards, whatever happened."""
    port = free_port()
    argv = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-c", str(ctx), "-np", str(parallel), "-t", str(threads), "--no-webui"]
    if slot_dir is not None:
        argv += ["--slot-save-path", str(slot_dir)]
    argv += list(extra)
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / f"llama-server-{port}.log"
    with llama_server_process(argv, port, log_path) as proc:
        yield Child(proc, f"http://127.0.0.1:{port}", log_path, slot_dir)


def read_header(path: Path) -> tuple[int, int, int, int, int, int]:
    """(magic, version, n_words, token-null marker, token-block version, n_tokens)."""
    data = path.read_bytes()
    return HEADER.unpack_from(data) + TOKEN_BLOCK_HEADER.unpack_from(data, HEADER.size)


def kv_offset(path: Path) -> int:
    """Where the KV state starts in a slot file: after the header and the token block."""
    n_words: int = HEADER.unpack_from(path.read_bytes())[2]
    return HEADER.size + 4 * n_words
