"""Contract tests for llama-server's slot files (b11434), the ground under a coming "warm swap":
before the router stops a model's child it saves each slot's KV cache
(``--slot-save-path DIR`` and ``POST /slots/{id}?action=save {"filename": ...}``), and once a
new child of the same model is up it restores them (``action=restore``) so that the next turn
of each conversation comes from the prompt cache.

Each test starts llama-server directly (no router) and states in its docstring what it pins
down. The headline facts, for the router's design:

* save/restore work across processes: a restored slot serves the same prompt with
  ``cache_n == prompt_n - 1`` and the very continuation a fresh process computes;
* a restore checks the KV *layout* only (layer count, K/V types, V transposition, stream count,
  room in the context), never *which model* or which RoPE settings wrote it: another model file
  of the same shape restores with 200 and then answers wrongly. The router must fingerprint
  (model file, arguments) itself;
* every refusal inside llama.cpp is the same 400 ``GENERIC_RESTORE_ERROR``, the reason only in
  the child's log, and it empties the slot;
* a file truncated inside its KV data **aborts the child** (SIGABRT, a failed GGML_ASSERT),
  and garbled KV bytes restore silently: the router must check a file (size, checksum) before
  it restores it;
* a save or restore of a busy slot waits (deferred task, no timeout) until its request ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from slotstate import (
    GENERIC_RESTORE_ERROR,
    HANG_GUARD_S,
    STATE_SEQ_MAGIC,
    STATE_SEQ_VERSION,
    Child,
    kv_offset,
    llama_child,
    read_header,
)

from router.llama.tinymodel import write_tiny_model

pytestmark = pytest.mark.real

# 400 tokens with the tiny models' byte-level tokenizer; the context (1024) holds it with room.
PROMPT = "hello world " * 50
CTX = 1024
SAVE_KEYS = {"id_slot", "filename", "n_saved", "n_written", "timings"}
RESTORE_KEYS = {"id_slot", "filename", "n_restored", "n_read", "timings"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight models. n_embd 128 with 4 heads: a head size of 32, so that q8_0 K
    cache (block size 32) can be tried; the 64-wide default tiny model refuses ``-ctk q8_0`` at
    start ("K cache type q8_0 with block size 32 does not divide n_embd_head_k=16").
    ``twin`` has the same shape as ``base`` but other weights; ``deep`` has a third layer;
    ``long`` (the default shape, a 32k training context) streams long generations."""
    directory = tmp_path_factory.mktemp("slot-models")
    return {
        "base": write_tiny_model(directory / "base.gguf", seed=1, name="base", n_embd=128),
        "twin": write_tiny_model(directory / "twin.gguf", seed=2, name="twin", n_embd=128),
        "deep": write_tiny_model(directory / "deep.gguf", seed=1, name="deep", n_embd=128,
                                 n_layer=3),
        "long": write_tiny_model(directory / "long.gguf", seed=3, name="long",
                                 n_ctx_train=32768),
    }


@dataclass
class Saved:
    """A slot file written by ``base`` at ``-c 1024 -np 1`` after serving PROMPT once."""

    path: Path
    content: str  # the greedy continuation of PROMPT that base computed from scratch
    prompt_n: int
    save: dict[str, Any]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, llama_server: Path,
          models: dict[str, Path]) -> Saved:
    work = tmp_path_factory.mktemp("saved")
    slot_dir = work / "slots"
    slot_dir.mkdir()
    with llama_child(llama_server, models["base"], work, ctx=CTX, slot_dir=slot_dir) as child:
        answer = child.complete(PROMPT)
        assert answer["timings"]["cache_n"] == 0
        response = child.slot(0, "save", "base.bin")
        assert response.status_code == 200, response.text
    return Saved(slot_dir / "base.bin", answer["content"], answer["timings"]["prompt_n"],
                 response.json())


def place(saved: Saved, slot_dir: Path, name: str = "conv.bin") -> Path:
    slot_dir.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copyfile(saved.path, slot_dir / name))


def fresh_answer(child: Child, prompt: str = PROMPT) -> dict[str, Any]:
    """``prompt`` computed from scratch in ``child``: its slot 0 erased first."""
    assert child.slot(0, "erase").status_code == 200
    answer = child.complete(prompt)
    assert answer["timings"]["cache_n"] == 0, answer["timings"]
    return answer


# ------------------------------------------------------------------------------ 1. save


def test_save_writes_the_slot_to_the_named_file(tmp_path: Path, llama_server: Path,
                                                models: dict[str, Path]) -> None:
    """``POST /slots/0?action=save {"filename": "conv.bin"}`` after a completion: 200 with
    exactly ``{"id_slot": 0, "filename": "conv.bin", "n_saved", "n_written",
    "timings": {"save_ms"}}``. ``n_saved`` counts the slot's tokens, prompt and answer but the
    last sampled token (never decoded): ``prompt_n + predicted_n - 1``. ``n_written`` is the
    file's size in bytes. The file is ``DIR/conv.bin`` itself (no temporary name, nothing
    else in DIR), begins with magic ``'ggsq'``, version 4 and the token list, and holds about
    ``n_layer * 2 * n_embd_kv * 2`` bytes of f16 K/V per token. The slot is left as it was: the
    same prompt again still comes from the cache."""
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    with llama_child(llama_server, models["base"], tmp_path, ctx=CTX, slot_dir=slot_dir) as child:
        answer = child.complete(PROMPT)
        timings = answer["timings"]
        assert timings["cache_n"] == 0
        started = time.monotonic()
        response = child.slot(0, "save", "conv.bin")
        wall_ms = (time.monotonic() - started) * 1000
        assert response.status_code == 200, response.text
        body = response.json()
        assert set(body) == SAVE_KEYS, body
        assert set(body["timings"]) == {"save_ms"}, body
        assert body["id_slot"] == 0 and body["filename"] == "conv.bin"
        assert body["n_saved"] == timings["prompt_n"] + timings["predicted_n"] - 1, (body, timings)

        assert sorted(p.name for p in slot_dir.iterdir()) == ["conv.bin"]
        path = slot_dir / "conv.bin"
        assert path.stat().st_size == body["n_written"]
        magic, version, n_words, null, block_version, n_tokens = read_header(path)
        assert (magic, version) == (STATE_SEQ_MAGIC, STATE_SEQ_VERSION)
        assert (null, block_version, n_tokens) == (-1, 1, body["n_saved"])
        assert n_words == n_tokens + 4  # marker, version, count, tokens, media-key count
        # 2 layers x (K + V) x 64 (2 KV heads x 32) x 2 bytes (f16) per token, plus cell metadata
        kv_per_token = 2 * 2 * 64 * 2
        kv_bytes = body["n_written"] - kv_offset(path)
        assert body["n_saved"] * kv_per_token < kv_bytes < body["n_saved"] * (kv_per_token + 64)

        again = child.complete(PROMPT)
        assert again["timings"]["cache_n"] == timings["prompt_n"] - 1
        assert again["content"] == answer["content"]
        print(f"\n[tiny save] {body['n_saved']} tokens -> {body['n_written']} bytes, "
              f"save_ms {body['timings']['save_ms']:.3f}, HTTP round trip {wall_ms:.1f} ms")


# ------------------------------------------------------------------------------ 2. restore


def test_restore_into_a_fresh_process_serves_the_prompt_from_the_cache(
        tmp_path: Path, llama_server: Path, models: dict[str, Path], saved: Saved) -> None:
    """A new process of the same model and arguments, ``POST /slots/0?action=restore
    {"filename": "conv.bin"}``: 200 with exactly ``{"id_slot": 0, "filename",
    "n_restored" (= the save's n_saved), "n_read" (= its n_written), "timings":
    {"restore_ms"}}``. The same prompt then reports ``timings.cache_n == prompt_n - 1`` and
    ``prompt_n == 1`` (the last prompt token is always decoded again) and gives the very
    continuation the first process computed from scratch. The next turn (prompt + answer +
    more) reuses the whole restored prefix and continues exactly as a process without the
    restore, which decodes everything (``cache_n == 0``)."""
    slot_dir = tmp_path / "slots"
    place(saved, slot_dir)
    next_turn = PROMPT + saved.content + " and then"
    with llama_child(llama_server, models["base"], tmp_path, ctx=CTX, slot_dir=slot_dir) as child:
        response = child.slot(0, "restore", "conv.bin")
        assert response.status_code == 200, response.text
        body = response.json()
        assert set(body) == RESTORE_KEYS, body
        assert set(body["timings"]) == {"restore_ms"}, body
        assert body["id_slot"] == 0 and body["filename"] == "conv.bin"
        assert body["n_restored"] == saved.save["n_saved"]
        assert body["n_read"] == saved.save["n_written"]

        answer = child.complete(PROMPT)
        assert answer["timings"]["cache_n"] == saved.prompt_n - 1, answer["timings"]
        assert answer["timings"]["prompt_n"] == 1
        assert answer["content"] == saved.content

        assert child.slot(0, "restore", "conv.bin").status_code == 200
        warm = child.complete(next_turn)
        print(f"\n[tiny restore] {body['n_restored']} tokens, {body['n_read']} bytes, "
              f"restore_ms {body['timings']['restore_ms']:.3f}")

    with llama_child(llama_server, models["base"], tmp_path, ctx=CTX, slot_dir=slot_dir) as cold:
        baseline = cold.complete(next_turn)
    assert baseline["timings"]["cache_n"] == 0
    total = baseline["timings"]["prompt_n"]
    assert warm["timings"]["cache_n"] >= saved.prompt_n, warm["timings"]
    assert warm["timings"]["cache_n"] + warm["timings"]["prompt_n"] == total
    assert warm["content"] == baseline["content"]


def test_two_slots_restore_into_either_slot_and_requests_find_them(
        tmp_path: Path, llama_server: Path, models: dict[str, Path]) -> None:
    """``-np 2``: each slot saves to its own file; a file is not tied to the slot that wrote it
    (slot 0's file restores into slot 1 and the reverse). Afterwards requests that name no
    slot land, by prompt similarity, on the slot that holds their conversation
    (``id_slot`` in the answer) and reuse all of it."""
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    first, second = "alpha conversation " * 20, "a different talk about bravo " * 15
    with llama_child(llama_server, models["base"], tmp_path, ctx=2 * CTX, parallel=2,
                     slot_dir=slot_dir) as child:
        one = child.complete(first, id_slot=0)
        two = child.complete(second, id_slot=1)
        assert child.slot(0, "save", "one.bin").status_code == 200
        assert child.slot(1, "save", "two.bin").status_code == 200
    with llama_child(llama_server, models["base"], tmp_path, ctx=2 * CTX, parallel=2,
                     slot_dir=slot_dir) as child:
        assert child.slot(1, "restore", "one.bin").json()["id_slot"] == 1
        assert child.slot(0, "restore", "two.bin").json()["id_slot"] == 0
        again_one = child.complete(first + " more")
        again_two = child.complete(second + " more")
    assert again_one["id_slot"] == 1 and again_two["id_slot"] == 0
    assert again_one["timings"]["cache_n"] == one["timings"]["prompt_n"]
    assert again_two["timings"]["cache_n"] == two["timings"]["prompt_n"]


# ------------------------------------------------------------------------------ 3. configurations


@dataclass(frozen=True)
class Config:
    name: str
    model: str = "base"
    extra: tuple[str, ...] = ()
    ctx: int = CTX
    parallel: int = 1
    accepted: bool = True
    same_answer: bool = True  # accepted only: the restored KV continues as a fresh computation
    log: str = ""  # refused only: the reason, found only in the child's log


CONFIGS = [
    # Accepted, and the restored KV is right.
    Config("larger-ctx", ctx=2048),
    Config("smaller-ctx-that-still-fits", ctx=512),
    Config("np2-kv-unified", extra=("--kv-unified",), ctx=2048, parallel=2),
    Config("no-cache-ram", extra=("--cache-ram", "0")),
    # Accepted, and the restored KV is wrong: nothing in the file says which model wrote it.
    Config("other-model-same-shape", model="twin", same_answer=False),
    Config("other-rope-freq-base", extra=("--rope-freq-base", "100"), same_answer=False),
    # Refused, with one generic message.
    Config("ctx-too-small", ctx=256, accepted=False,
           log="state_read_meta: not enough cells in kv cache"),
    Config("ctk-q8_0", extra=("-ctk", "q8_0"), accepted=False,
           log="state_read_data: mismatched key type (8 != 1, layer 0)"),
    Config("flash-attn-off", extra=("-fa", "off"), accepted=False,
           log="state_read_data: incompatible V transposition"),
    Config("np2", ctx=2048, parallel=2, accepted=False, log="n_stream mismatch"),
    Config("other-layer-count", model="deep", accepted=False,
           log="state_read_data: mismatched layer count (2 instead of 3)"),
]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_restore_under_another_configuration(
        config: Config, tmp_path: Path, llama_server: Path, models: dict[str, Path],
        saved: Saved) -> None:
    """A file saved by ``base -c 1024 -np 1`` (defaults otherwise: f16 K/V, flash attention
    ``auto``, which is on for CPU) restored into a child started otherwise.

    llama.cpp checks the layout only: layer count, K and V types and row sizes, V
    transposition (flash attention on or off), the number of KV streams (``-np N`` without
    ``--kv-unified`` has N streams, ``-np 1`` or ``--kv-unified`` one) and room for the cells
    (the slot's context may differ as long as the tokens fit). A refusal is ``400
    {"error": {"code": 400, "message": GENERIC_RESTORE_ERROR, "type":
    "invalid_request_error"}}`` whatever the reason, which only the log says; the child keeps
    serving and the slot is empty. Nothing checks the model's identity or its RoPE settings:
    another model file of the same shape, or another ``--rope-freq-base``, restores with 200,
    the prompt "hits" the cache, and the continuation differs from what that child computes
    from scratch."""
    slot_dir = tmp_path / "slots"
    place(saved, slot_dir)
    short = "hello world " * 5  # fits even the 256-token context
    with llama_child(llama_server, models[config.model], tmp_path, *config.extra,
                     ctx=config.ctx, parallel=config.parallel, slot_dir=slot_dir) as child:
        response = child.slot(0, "restore", "conv.bin")
        if not config.accepted:
            assert response.status_code == 400, response.text
            assert response.json() == {"error": {"code": 400, "message": GENERIC_RESTORE_ERROR,
                                                 "type": "invalid_request_error"}}
            assert child.logged_error(config.log), child.log_errors()
            answer = child.complete(short)
            assert answer["timings"]["cache_n"] == 0
            print(f"\n[{config.name}] refused: {config.log}")
            return
        assert response.status_code == 200, response.text
        assert response.json()["n_restored"] == saved.save["n_saved"]
        restored = child.complete(PROMPT)
        assert restored["timings"]["cache_n"] == saved.prompt_n - 1, restored["timings"]
        fresh = fresh_answer(child)
    assert (restored["content"] == fresh["content"]) is config.same_answer, (restored, fresh)
    print(f"\n[{config.name}] accepted; restored continuation {restored['content']!r}, "
          f"from scratch {fresh['content']!r}")


# ------------------------------------------------------------------------------ 4. bad files


@dataclass(frozen=True)
class Damage:
    name: str
    outcome: str  # "refused" (400), "accepted" (200) or "abort" (the child dies)
    log: str = ""
    message: str = GENERIC_RESTORE_ERROR


DAMAGES = [
    Damage("missing", "refused", "failed to open"),
    Damage("empty", "refused", "unknown (magic, version) for sequence state file"),
    Damage("random-bytes", "refused", "unknown (magic, version) for sequence state file"),
    Damage("header-only", "refused", "token count in sequence state file exceeds the file size"),
    Damage("directory", "refused", "Is a directory"),
    Damage("bad-token-ids", "refused", message="Unable to restore slot: Invalid tokens in slot "
                                               "save file"),
    Damage("garbled-kv-bytes", "accepted"),
    Damage("trailing-bytes", "accepted"),
    Damage("truncated-by-one-byte", "abort", "GGML_ASSERT(nread <= state_size) failed"),
    Damage("truncated-in-the-kv-half", "abort", "GGML_ASSERT(nread <= state_size) failed"),
]


def damage(kind: str, good: bytes, path: Path) -> None:
    rng = random.Random(kind)
    start = kv_offset(path)
    if kind == "missing":
        path.unlink()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "random-bytes":
        path.write_bytes(rng.randbytes(len(good)))
    elif kind == "header-only":
        path.write_bytes(good[:12])
    elif kind == "directory":
        path.unlink()
        path.mkdir()
    elif kind == "bad-token-ids":
        data = bytearray(good)
        data[24:64] = b"\xff\xff\xff\x7f" * 10  # ten token ids far past the vocabulary
        path.write_bytes(bytes(data))
    elif kind == "garbled-kv-bytes":
        # inside the last layer's V rows (the file's last ~52 KB): values, not a header
        data = bytearray(good)
        data[-3072:-1024] = rng.randbytes(2048)
        path.write_bytes(bytes(data))
    elif kind == "trailing-bytes":
        path.write_bytes(good + bytes(16))
    elif kind == "truncated-by-one-byte":
        path.write_bytes(good[:-1])
    elif kind == "truncated-in-the-kv-half":
        path.write_bytes(good[:(start + len(good)) // 2])
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("case", DAMAGES, ids=[d.name for d in DAMAGES])
def test_restore_of_a_damaged_file(case: Damage, tmp_path: Path, llama_server: Path,
                                   models: dict[str, Path], saved: Saved) -> None:
    """Restoring a missing, empty, random or damaged file into a slot that already holds PROMPT.

    * refused, 400 ``invalid_request_error`` with GENERIC_RESTORE_ERROR (the reason in the log
      only), or, for token ids outside the vocabulary, ``"Unable to restore slot: Invalid
      tokens in slot save file"``. The child keeps serving; the slot is emptied (PROMPT again
      is decoded from scratch): a failed restore loses what the slot held.
    * accepted, 200 with the full ``n_restored``: garbled KV bytes (silently wrong cache), and
      trailing bytes after the state (ignored; ``n_read`` is the original size).
    * abort: a file cut short anywhere in its KV data kills the child with SIGABRT
      (``GGML_ASSERT(nread <= state_size)`` in llama-context.cpp); the request's connection
      drops without an answer."""
    slot_dir = tmp_path / "slots"
    path = place(saved, slot_dir)
    good = path.read_bytes()
    damage(case.name, good, path)
    with llama_child(llama_server, models["base"], tmp_path, ctx=CTX, slot_dir=slot_dir) as child:
        assert child.complete(PROMPT)["content"] == saved.content
        if case.outcome == "abort":
            with pytest.raises(httpx.RemoteProtocolError):
                child.slot(0, "restore", "conv.bin")
            assert child.proc.wait(HANG_GUARD_S) == -signal.SIGABRT
            assert case.log in child.log(), child.log()[-3000:]
            print(f"\n[{case.name}] child aborted: {case.log}")
            return
        response = child.slot(0, "restore", "conv.bin")
        if case.outcome == "refused":
            assert response.status_code == 400, response.text
            assert response.json() == {"error": {"code": 400, "message": case.message,
                                                 "type": "invalid_request_error"}}
            assert not case.log or child.logged_error(case.log), child.log_errors()
            again = child.complete(PROMPT)
            assert again["timings"]["cache_n"] == 0
            assert again["content"] == saved.content
            print(f"\n[{case.name}] refused: {case.message} / log: {case.log}")
            return
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["n_restored"] == saved.save["n_saved"]
        assert body["n_read"] == saved.save["n_written"]
        again = child.complete(PROMPT)
        assert again["timings"]["cache_n"] == saved.prompt_n - 1
        if case.name == "trailing-bytes":
            assert again["content"] == saved.content
        print(f"\n[{case.name}] accepted; continuation {again['content']!r} "
              f"(from scratch: {saved.content!r})")


# ------------------------------------------------------------------------------ 5. validation

REFUSED_NAMES = ["../x", "..", ".", "a..b", "a/b", "a\\b", "", "x" * 256, "a:b", "a*b", "a?b",
                 'a"b', "a<b", "a|b", "trailing.", " leading", "trailing ", "tab\there",
                 "nul\x00", "\u2215slash"]
ACCEPTED_NAMES = ["x" * 255, "é.bin", "a b.bin", ".hidden", "UPPER-lower_1.2.bin"]
INVALID_FILENAME = {"error": {"code": 400, "message": "Invalid filename",
                              "type": "invalid_request_error"}}


def test_filenames_slot_ids_actions_and_bodies_are_validated(
        tmp_path: Path, llama_server: Path, models: dict[str, Path]) -> None:
    """Filenames (save and restore alike) are bare names checked by ``fs_validate_filename``:
    refused with ``400 {"error": {"code": 400, "message": "Invalid filename", "type":
    "invalid_request_error"}}`` are the empty name, names over 255 bytes, any ``/`` or ``\\``
    (so absolute paths too), any ``..``, ``.`` itself, control characters, ``: * ? " < > |``,
    a leading or trailing space, a trailing dot, and look-alikes such as U+2215. Accepted: up
    to 255 bytes, UTF-8, inner spaces, a leading dot. A refused name writes nothing anywhere.

    Slot ids are parsed with ``std::stoi`` and then taken modulo the slot count as an unsigned
    number: ``/slots/3`` with ``-np 2`` is slot 1 (the answer echoes ``"id_slot": 3``), and so
    is ``/slots/-1``; ``1.5`` or ``1abc`` is slot 1 (the leading number); only an id that does not
    start with a number (or is out of int range, or empty) is ``400 "Invalid slot ID"``.
    An unknown or missing ``action`` is ``400 "Invalid action"``. A missing body, a body without
    ``filename`` or a non-string one is a 400 carrying nlohmann::json's exception text."""
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    outside = tmp_path / "x"
    with llama_child(llama_server, models["base"], tmp_path, ctx=2 * CTX, parallel=2,
                     slot_dir=slot_dir) as child:
        child.complete(PROMPT, id_slot=1)  # slot 1 holds PROMPT, slot 0 nothing
        for name in REFUSED_NAMES:
            for action in ("save", "restore"):
                response = child.slot(1, action, name)
                assert (response.status_code, response.json()) == (400, INVALID_FILENAME), name
        assert child.slot(0, "save", str(tmp_path / "abs.bin")).json() == INVALID_FILENAME
        assert not outside.exists() and not (tmp_path / "abs.bin").exists()
        assert list(slot_dir.iterdir()) == []
        for name in ACCEPTED_NAMES:
            response = child.slot(1, "save", name)
            assert response.status_code == 200, (name, response.text)
            assert response.json()["filename"] == name
            assert child.slot(1, "restore", name).status_code == 200
        assert sorted(p.name for p in slot_dir.iterdir()) == sorted(ACCEPTED_NAMES)

        n_slot1 = child.slots()[1]["n_prompt_tokens"]
        assert n_slot1 > 0
        for alias in ("3", "-1", "5"):
            body = child.slot(alias, "save", "alias.bin").json()
            assert (body["id_slot"], body["n_saved"]) == (int(alias), n_slot1), body
        assert child.slot(2, "save", "alias.bin").json()["n_saved"] == 0  # 2 % 2 == 0
        for bad_id in ("x", "99999999999", ""):
            response = child.slot(bad_id, "save", "id.bin")
            assert response.status_code == 400, response.text
            assert response.json()["error"]["message"] == "Invalid slot ID", bad_id
        for prefixed in ("1.5", "1abc"):  # std::stoi reads the leading number and stops there
            assert child.slot(prefixed, "save", "id.bin").json()["id_slot"] == 1
        for query in ("?action=bogus", "", "?action=SAVE"):
            response = child.post(f"/slots/0{query}", {"filename": "a.bin"})
            assert response.status_code == 400
            assert response.json()["error"]["message"] == "Invalid action", query

        no_body = child.post("/slots/0?action=save")
        assert no_body.status_code == 400
        assert no_body.json()["error"]["message"].startswith("[json.exception.parse_error.101]")
        no_name = child.post("/slots/0?action=save", {})
        assert no_name.status_code == 400
        assert no_name.json()["error"]["message"] == \
            "[json.exception.out_of_range.403] key 'filename' not found"
        not_string = child.post("/slots/0?action=restore", {"filename": 3})
        assert not_string.status_code == 400
        assert "type must be string" in not_string.json()["error"]["message"]
        # erase takes no body at all, and ignores one
        assert child.post("/slots/0?action=erase", {"filename": "../x"}).status_code == 200
        assert child.complete("still serving")["content"]
        print(f"\n[validation] bad slot id 'x' -> {child.slot('x', 'save', 'a').text}")


NOT_SUPPORTED = {"error": {"code": 501, "message": "This server does not support slots action. "
                                                   "Start it with `--slot-save-path`",
                           "type": "not_supported_error"}}


def test_without_slot_save_path_the_actions_are_not_supported(
        tmp_path: Path, llama_server: Path, models: dict[str, Path]) -> None:
    """Without ``--slot-save-path`` every action (save, restore, erase, even an invalid one) is
    ``501 not_supported_error`` "This server does not support slots action. Start it with
    `--slot-save-path`", while ``GET /slots`` still lists the slots. ``--no-slots`` hides
    ``GET /slots`` (501) but does not disable the actions. A ``--slot-save-path`` that is not
    an existing directory stops llama-server at start: exit status 1, "error while handling
    argument "--slot-save-path": not a directory: PATH"."""
    with llama_child(llama_server, models["base"], tmp_path, ctx=CTX) as child:
        child.complete(PROMPT)
        for action in ("save", "restore", "erase", "bogus"):
            response = child.slot(0, action, "a.bin")
            assert (response.status_code, response.json()) == (501, NOT_SUPPORTED), action
        assert httpx.get(child.url + "/slots", timeout=HANG_GUARD_S).status_code == 200

    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    with llama_child(llama_server, models["base"], tmp_path, "--no-slots", ctx=CTX,
                     slot_dir=slot_dir) as child:
        assert httpx.get(child.url + "/slots", timeout=HANG_GUARD_S).status_code == 501
        assert child.slot(0, "save", "a.bin").status_code == 200

    missing = tmp_path / "no-such-dir"
    started = subprocess.run([str(llama_server), "-m", str(models["base"]), "--port", "0",
                              "--slot-save-path", str(missing)],
                             capture_output=True, text=True, timeout=HANG_GUARD_S, check=False)
    assert started.returncode == 1
    assert (f'error while handling argument "--slot-save-path": not a directory: {missing}'
            in started.stdout + started.stderr)


# ------------------------------------------------------------------------------ 6. busy, erase


class Stream(threading.Thread):
    """A streamed greedy /completion of ``n_predict`` tokens; ``started`` once tokens flow."""

    def __init__(self, url: str, prompt: str, n_predict: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.n_predict = url, prompt, n_predict
        self.started = threading.Event()
        self.final: dict[str, Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            body = {"prompt": self.prompt, "n_predict": self.n_predict, "stream": True,
                    "temperature": 0, "ignore_eos": True}
            with httpx.stream("POST", self.url + "/completion", json=body,
                              timeout=HANG_GUARD_S) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        self.started.set()
                        if event.get("stop"):
                            self.final = event
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.started.set()


def busy(child: Child, prompt: str, n_predict: int) -> Stream:
    stream = Stream(child.url, prompt, n_predict)
    stream.start()
    assert stream.started.wait(HANG_GUARD_S)
    assert stream.error is None, stream.error
    assert child.slots()[0]["is_processing"], "the stream ended before the slot action was sent"
    return stream


def test_save_and_restore_of_a_busy_slot_wait_for_its_request(
        tmp_path: Path, llama_server: Path, models: dict[str, Path]) -> None:
    """A save sent while the slot generates is deferred until that request ends (no error, no
    partial state, no timeout of its own): it answers with ``n_saved == prompt_n + predicted_n
    - 1`` of the whole request. A restore sent while the slot generates waits likewise, the
    running request completes untouched, and then the slot holds the restored state."""
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    n_predict = 3000  # seconds on a 2-core machine: long enough to be sure it is busy
    with llama_child(llama_server, models["long"], tmp_path, ctx=4096,
                     slot_dir=slot_dir) as child:
        stream = busy(child, "once upon a time", n_predict)
        started = time.monotonic()
        response = child.slot(0, "save", "busy.bin")
        waited = time.monotonic() - started
        stream.join(HANG_GUARD_S)
        assert stream.error is None and stream.final is not None, stream.error
        timings = stream.final["timings"]
        assert timings["predicted_n"] == n_predict
        assert response.status_code == 200, response.text
        assert response.json()["n_saved"] == timings["prompt_n"] + n_predict - 1

        other = busy(child, "a different story " * 3, n_predict)
        response = child.slot(0, "restore", "busy.bin")
        other.join(HANG_GUARD_S)
        assert other.error is None and other.final is not None, other.error
        assert other.final["timings"]["predicted_n"] == n_predict
        assert response.status_code == 200, response.text
        assert child.slots()[0]["n_prompt_tokens"] == response.json()["n_restored"]
        print(f"\n[busy] save waited {waited:.2f} s for a {n_predict}-token generation "
              f"({timings['predicted_ms'] / 1000:.2f} s)")


def test_erase_empties_the_slot_and_keeps_files(tmp_path: Path, llama_server: Path,
                                                 models: dict[str, Path]) -> None:
    """``POST /slots/0?action=erase`` (no body): 200 ``{"id_slot": 0, "n_erased": N}`` with the
    tokens the slot held (0 when already empty); the slot's next request is decoded from
    scratch; the slot-save-path is untouched (erase and restore never delete files). Saving
    over an existing name replaces the file without complaint. An empty slot saves (200,
    ``n_saved`` 0, a 36-byte file with ``-np 1``) and that file restores (200, ``n_restored``
    0): in effect an erase."""
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()
    with llama_child(llama_server, models["base"], tmp_path, ctx=CTX, slot_dir=slot_dir) as child:
        empty = child.slot(0, "save", "empty.bin").json()
        # header 12 + token block 16 (marker, version, 0 tokens, 0 media) + n_stream + 0 cells
        assert (empty["n_saved"], empty["n_written"]) == (0, 36)
        answer = child.complete(PROMPT)
        saved = child.slot(0, "save", "conv.bin").json()
        erased = child.slot(0, "erase")
        assert erased.status_code == 200
        assert erased.json() == {"id_slot": 0, "n_erased": saved["n_saved"]}
        assert child.slot(0, "erase").json() == {"id_slot": 0, "n_erased": 0}
        assert (slot_dir / "conv.bin").stat().st_size == saved["n_written"]
        assert child.complete(PROMPT)["timings"]["cache_n"] == 0

        assert child.slot(0, "restore", "conv.bin").status_code == 200
        assert (slot_dir / "conv.bin").exists()
        restored = child.slot(0, "restore", "empty.bin").json()
        assert restored["n_restored"] == 0
        assert child.complete(PROMPT)["timings"]["cache_n"] == 0

        child.complete(PROMPT + answer["content"])
        overwritten = child.slot(0, "save", "conv.bin").json()
        assert overwritten["n_saved"] > saved["n_saved"]
        assert (slot_dir / "conv.bin").stat().st_size == overwritten["n_written"]


# ------------------------------------------------------------------------------ 7. timings


def long_system_prompt() -> str:
    facts = [f"Fact {i}: the crate numbered {i} holds {i * 7 % 13} apples and "
             f"{i * 5 % 11} pears." for i in range(1, 100)]
    return "You are a careful assistant. Remember these facts.\n" + "\n".join(facts)


def chat(child: Child, body: dict[str, Any]) -> dict[str, Any]:
    response = child.post("/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_smollm2_warm_swap_timings(tmp_path: Path, llama_server: Path, smollm2: Path) -> None:
    """The warm swap end to end on SmolLM2-135M (Q4_1, 30 layers, f16 K/V: about 23 KB per
    token): a ~2,000-token chat turn, save, stop, start a new child, restore, next turn. The
    next turn reuses the whole first turn from the restored cache (``cache_n >=`` the first
    turn's ``prompt_n``; in fact prompt and answer) and decodes only the new tail. Figures are
    printed; the only bounds are hang guards."""
    slot_dir = tmp_path / "slots"
    slot_dir.mkdir()

    def start() -> contextlib.AbstractContextManager[Child]:
        return llama_child(llama_server, smollm2, tmp_path, ctx=4096, threads=2,
                           slot_dir=slot_dir)

    messages = [{"role": "system", "content": long_system_prompt()},
                {"role": "user", "content": "How many apples are in crate 12?"}]
    request = {"temperature": 0, "max_tokens": 16, "seed": 1}
    with start() as child:
        began = time.monotonic()
        first = chat(child, {**request, "messages": messages})
        cold_s = time.monotonic() - began
        cold = first["timings"]
        assert cold["cache_n"] == 0 and 1500 <= cold["prompt_n"] <= 3000, cold
        began = time.monotonic()
        save = child.slot(0, "save", "smollm2.bin").json()
        save_s = time.monotonic() - began
        began = time.monotonic()
    stop_s = time.monotonic() - began
    answer = first["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "And how many pears?"}]
    began = time.monotonic()
    with start() as child:
        start_s = time.monotonic() - began
        began = time.monotonic()
        restore = child.slot(0, "restore", "smollm2.bin").json()
        restore_s = time.monotonic() - began
        began = time.monotonic()
        second = chat(child, {**request, "messages": messages})
        warm_s = time.monotonic() - began
    warm = second["timings"]
    assert restore["n_restored"] == save["n_saved"]
    assert (slot_dir / "smollm2.bin").stat().st_size == save["n_written"]
    assert warm["cache_n"] >= cold["prompt_n"], (cold, warm)
    assert warm["prompt_n"] < cold["prompt_n"] / 10, (cold, warm)
    mb = save["n_written"] / 1e6
    print(f"\n[smollm2] turn 1: {cold['prompt_n']} prompt tokens decoded in "
          f"{cold['prompt_ms'] / 1000:.2f} s (request {cold_s:.2f} s)"
          f"\n[smollm2] save: {save['n_saved']} tokens, {mb:.1f} MB, save_ms "
          f"{save['timings']['save_ms']:.1f} (round trip {save_s * 1000:.1f} ms); "
          f"stop {stop_s:.2f} s; start {start_s:.2f} s"
          f"\n[smollm2] restore: restore_ms {restore['timings']['restore_ms']:.1f} "
          f"(round trip {restore_s * 1000:.1f} ms)"
          f"\n[smollm2] turn 2: cache_n {warm['cache_n']}, decoded {warm['prompt_n']} in "
          f"{warm['prompt_ms']:.0f} ms (request {warm_s:.2f} s); "
          f"{os.path.getsize(slot_dir / 'smollm2.bin') / max(1, save['n_saved']):.0f} "
          f"bytes per token")
