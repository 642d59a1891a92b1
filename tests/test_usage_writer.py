"""The teams' usage writer survives what it is given (``router/teams/usage.py``), and the token
counts it is given are clamped where they are read (``router/http/tail.py``): an upstream
that reported a token count over 2**63 - 1 killed the writer on an uncaught OverflowError
with no log line, and no usage was kept after it (0 of 6 requests survived a restart)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from router.http.tail import MAX_MS, MAX_TOKENS, ResponseTail, parse_timings
from router.teams import usage as usage_module
from router.teams.usage import FILE_NAME, Row, Usage, UsageStore

HUGE = 2**64  # past SQLite's 64-bit integers


@pytest.mark.parametrize("body, tokens, prompt", [
    (b'{"usage":{"prompt_tokens":%d,"completion_tokens":%d}}' % (HUGE, HUGE),
     MAX_TOKENS, MAX_TOKENS),
    (b'{"usage":{"prompt_tokens":' + b"9" * 4000 + b',"completion_tokens":3}}', 3, MAX_TOKENS),
    (b'{"timings":{"prompt_n":1e999,"cache_n":%d,"predicted_n":%d}}' % (HUGE, HUGE),
     MAX_TOKENS, MAX_TOKENS),
    (b'{"usage":{"prompt_tokens":7,"completion_tokens":3}}', 3, 7),
])
def test_token_counts_read_from_a_tail_are_clamped(body: bytes, tokens: int,
                                                   prompt: int) -> None:
    tail = ResponseTail(b"", body)
    assert tail.tokens == tokens
    assert tail.prompt_tokens == prompt


def test_timings_read_from_a_tail_are_clamped() -> None:
    timings = parse_timings(b'"timings":{"prompt_n":-5,"prompt_ms":1e999,"cache_n":2,'
                            b'"predicted_n":18446744073709551616,"predicted_ms":-1.5}')
    assert timings is not None
    assert (timings.prompt_n, timings.prompt_ms, timings.cache_n, timings.predicted_n,
            timings.predicted_ms) == (0, MAX_MS, 2, MAX_TOKENS, 0.0)


def test_a_row_sqlite_cannot_hold_is_skipped_and_the_rest_survive_a_restart(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / FILE_NAME
    usage = Usage(UsageStore(path))
    usage.served("bad", "m", HUGE, 0, 0.0)  # one bad row (a count past 64 bits)...
    for n in range(6):  # ...and six requests of others around it
        usage.served(f"team-{n % 3}", "m", 10, 5, 0.25)
    usage.save_now()
    usage.served("bad", "m", 1, 0, 0.0)  # still bad: skipped again, said once
    usage.served("team-0", "m", 10, 5, 0.0)
    usage.save_now()
    again = {row.name: row for row in Usage(UsageStore(path)).rows()}
    assert sorted(again) == ["team-0", "team-1", "team-2"]
    assert again["team-0"] == Row("team-0", "m", 3, 30, 15, 0.5, 0)
    assert again["team-1"].requests == again["team-2"].requests == 2
    assert caplog.text.count("usage of 'bad' on model 'm' cannot be written") == 1
    assert "OverflowError" in caplog.text


async def test_the_writer_survives_any_failure_and_writes_the_next_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(usage_module, "FLUSH_S", 0.01)
    store = UsageStore(tmp_path / FILE_NAME)
    usage = Usage(store)
    real_save = store.save
    failures = [RuntimeError("a bug"), OverflowError("int too big")]

    def save(rows: list[Row]) -> list[tuple[Row, str]]:
        if failures:
            raise failures.pop(0)
        return real_save(rows)

    monkeypatch.setattr(store, "save", save)
    writer = asyncio.create_task(usage.run())
    written: list[str] = []
    try:
        usage.served("a", "m", 1, 2, 0.0)
        for _ in range(1000):
            await asyncio.sleep(0.01)
            written = [row.name for row in UsageStore(tmp_path / FILE_NAME).load()]
            if written:
                break
        assert not writer.done()  # still writing
    finally:
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
    assert written == ["a"] and not failures  # written once both failures had passed
    assert "RuntimeError: a bug" in caplog.text and "OverflowError" in caplog.text


def test_rows_edited_by_hand_read_back_as_zero_not_as_errors(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    Usage(UsageStore(path))  # makes the table
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO usage VALUES ('t', 'm', NULL, -4, 'x', 'y', 2.5)")
        db.execute("INSERT INTO usage VALUES ('u', 'm', 1, 2, 3, 1e999, 4)")
    rows = {row.name: row for row in Usage(UsageStore(path)).rows()}
    assert rows["t"] == Row("t", "m", 0, 0, 0, 0.0, 0)
    assert rows["u"] == Row("u", "m", 1, 2, 3, 0.0, 4)
    usage = Usage(UsageStore(path))
    usage.served("t", "m", 1, 1, 0.5)  # adds up from there
    assert usage.rows()[0] == Row("t", "m", 1, 1, 1, 0.5, 0)
