"""Smoke test of the benchmark harness (``python -m benchmarks.bench --quick``): it runs end to end
against the real llama-server and reports every metric for all three targets. No timing
assertions: the numbers depend on the machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench import COLUMNS

pytestmark = pytest.mark.real

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


def test_quick_bench_reports_all_targets(tmp_path: Path, llama_server: Path) -> None:
    result, report = run_quick_bench(tmp_path, 150, "--phases", "main")

    assert set(report["columns"]) == set(COLUMNS)
    measured = {k: m for k, m in report["metrics"].items() if m["unit"] != "count"}
    assert {"tokenize_p50_ms", "ttft_p50_ms", "ttft_ka_p50_ms", "chat_p50_ms", "tokenize_rps",
            "cold_vs_healthy_ms", "swap_ms", "rss_idle_mb", "models_p50_ms"} <= set(measured)
    for key, metric in measured.items():
        for column in COLUMNS:
            value = metric[column]
            assert isinstance(value, int | float) and value > 0, (key, column, value)
    assert len(report["targets"]) == 8
    assert {"ttft_vs_llamacpp", "ttft_ka_vs_llamacpp"} <= set(report["targets"])
    assert all(isinstance(t["met"], bool) for t in report["targets"].values())
    assert "| metric" in result.stdout
    assert report["config"]["router_log_level"] is None  # llama-router at its default level
    assert "real_model" not in report and "multiturn" not in report


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
