"""Benchmark phase: what relaying a streamed token costs (``--phases relay``).

Two parts, each target started on its own and stopped before the next:

* **Through a real child.** ``N`` concurrent streamed chats (``--relay-streams``, default 8, 64,
  256) at temperature 0 with ``ignore_eos`` through a direct llama-server, llama.cpp's router and
  llama-router, interleaved over ``--relay-rounds`` rounds (the order rotates). The child is
  the tiny generated model with a slot per stream (``parallel = N``, ``threads = 1``), each stream
  ``--relay-events`` / N tokens (at least 32). Measured per run: the CPU time of the router
  process alone (psutil; its children excluded) per relayed event, the events/s the client
  received, and the gaps between a stream's events (p99, added over the direct column's).
  One more column, the floor: ``benchmarks.floorrelay`` (a uvloop proxy that copies bytes and
  does nothing else) in front of the direct llama-server, for what any relay in Python on
  uvloop pays per event; llama-router's CPU above it is what its own code adds.
* **The ceiling.** A stand-in child (``benchmarks.standin``), served by llama-router as a
  remote upstream (``upstream = http://...``), so the child is never the limit. ``paced``: each
  of ``N`` streams (``--relay-streams`` too; default 16, 64, 256) gets one event a
  millisecond, each its own write, as a child generating on many slots sends them, so the
  offered rate grows with ``N`` past what one process relays; ``burst``: 64 streams written
  as fast as the socket takes (events arrive together and go out together: the upper bound).
  Measured: the events/s one llama-router process relays, its CPU per event there, and what
  happens past it: the events
  the stand-in wrote against those the client received (queueing, not loss), how long the
  stand-in waited for the router to read, and the router's peak RSS. llama.cpp's router cannot
  front a server it did not start, so this part has no llama.cpp column; the direct column (the
  client on the stand-in itself) shows the client is not the limit.

The client is ``benchmarks.streamclient``, run as a subprocess (uvloop, raw sockets): it
connects, says ``ready``, and starts every stream at once when told, so the CPU readings cover
the streams alone. With ``--profile``, one more uncounted run of each part is sampled with
``py-spy record`` on llama-router (the largest ``N`` through the child, and the ceiling).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from router.children.process import free_port
from router.host.cpus import spin_environment
from router.llama.tinymodel import write_tiny_model

from .harness.columns import COLUMNS, DIRECT, LABELS, LLAMACPP, ROUTER
from .harness.errors import BenchError
from .harness.processes import ROOT, Managed, process_cpu_s, wait_healthy
from .harness.profiling import py_spy, summarize_profile
from .harness.stats import MB, percentile, rotate
from .harness.targets import write_presets

if TYPE_CHECKING:
    from .harness.targets import Bench

MODEL = "relay"
STANDIN_MODEL = "standin"
PROMPT = "Write a story about a robot who learns to paint."
MIN_TOKENS = 32
SLOT_MARGIN = 64  # context per slot beyond the generated tokens: the chat-templated prompt
RUN_TIMEOUT_S = 300.0
FLOOR = "floor"
RELAY_COLUMNS = (*COLUMNS, FLOOR)
RELAY_LABELS = {**LABELS, FLOOR: "uvloop byte relay (floor)"}
GOALS = {
    "relay_cpu_per_event": "llama-router's CPU per relayed event at most llama.cpp router's, "
                           "at every stream count",
    "relay_no_loss": "past the ceiling, every event the stand-in wrote reaches the client",
}


@dataclass
class Settings:
    streams: tuple[int, ...] = (8, 64, 256)
    events: int = 8192  # events per run, all streams together
    rounds: int = 3
    ceiling_streams: tuple[int, ...] = (16, 64, 256)
    ceiling_events: int = 60_000
    burst_streams: int = 64
    profile: bool = False

    @classmethod
    def quick(cls) -> Settings:
        return cls(streams=(8,), events=512, rounds=1, ceiling_streams=(8,),
                   ceiling_events=2_000, burst_streams=8)

    def tokens(self, streams: int, events: int | None = None) -> int:
        return max(MIN_TOKENS, (events or self.events) // streams)


def chat_request(model: str, tokens: int, paced: bool = False) -> str:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
                            "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                            "stream": True}
    if paced:
        body["standin_paced"] = True
    return json.dumps(body)


def run_streams(url: str, streams: int, body: str, watch: psutil.Process | None,
                timeout: float = RUN_TIMEOUT_S) -> dict[str, Any]:
    """One run of ``benchmarks.streamclient``; with ``watch``, that process's CPU time during
    the streams, its cores, CPU per event and peak RSS."""
    argv = [sys.executable, "-m", "benchmarks.streamclient", url + "/v1/chat/completions",
            str(streams), body]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, cwd=ROOT) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            proc.kill()
            raise BenchError(f"stream client did not start: {proc.communicate()[1][-800:]!r}")
        cpu_before = process_cpu_s(watch.pid) if watch is not None else 0.0
        began = time.perf_counter()
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        peak = 0
        while proc.poll() is None:
            if watch is not None:
                peak = max(peak, watch.memory_info().rss)
            if time.perf_counter() - began > timeout:
                proc.kill()
                raise BenchError(f"{streams} streams to {url}: not done after {timeout:g} s")
            time.sleep(0.05)
        cpu_after = process_cpu_s(watch.pid) if watch is not None else 0.0
        out, err = proc.communicate()
    if proc.returncode != 0:
        raise BenchError(f"stream client failed ({proc.returncode}): {err.decode()[-800:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    if result["errors"]:
        raise BenchError(f"{streams} streams to {url}: {result['errors']} failed: "
                         f"{result['error_samples']}")
    if watch is not None:
        cpu = cpu_after - cpu_before
        result["server_cpu_s"] = cpu
        result["server_cores"] = cpu / result["wall_s"]
        result["server_us_per_event"] = 1e6 * cpu / max(1, result["events"])
        result["server_peak_rss_mb"] = peak / MB
    return result


def profile_run(url: str, streams: int, body: str, pid: int, out: Path) -> dict[str, Any]:
    """An uncounted run under ``py-spy record`` on ``pid``: the profile's summary."""
    spy = py_spy()
    if spy is None:
        return {"error": "py-spy not installed (pip install py-spy)"}
    argv = [spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
            "--nonblocking", "--output", str(out)]
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as spy_p:
        time.sleep(0.5)  # py-spy attaches
        run = run_streams(url, streams, body, None)
        spy_p.send_signal(2)  # SIGINT: py-spy writes what it has
        _, err = spy_p.communicate(timeout=60)
    if not out.exists():
        return {"error": f"py-spy failed: {err.decode()[-300:]}"}
    return {"events_per_s_while_profiled": run["events_per_s"], "streams": streams,
            **summarize_profile(out.read_text())}


class RelayBench:
    """The phase; ``run()`` returns its results (JSON-ready)."""

    def __init__(self, bench: Bench, settings: Settings) -> None:
        self.bench = bench
        self.settings = settings
        self.workdir = bench.workdir / "relay"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model = self.workdir / f"{MODEL}.gguf"

    # ------------------------------------------------------------ targets

    def _start_floor(self, streams: int, direct_url: str) -> tuple[Managed, str]:
        """The floor column: ``benchmarks.floorrelay`` in front of the direct llama-server."""
        port = free_port()
        item = self.bench.procs.start(f"relay{streams}-floor", [
            sys.executable, "-m", "benchmarks.floorrelay", str(port),
            direct_url.rsplit(":", 1)[1]], cwd=ROOT)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(item, url)
        return item, url

    def _start(self, column: str, streams: int, tokens: int) -> tuple[Managed, str]:
        ctx = streams * (tokens + SLOT_MARGIN)
        slot = ["threads = 1", "threads-batch = 1"]
        tag = f"relay{streams}"
        if column == DIRECT:
            port = free_port()
            item = self.bench.procs.start(f"{tag}-direct", [
                str(self.bench.binary), "-m", str(self.model), "--alias", MODEL,
                "-c", str(ctx), "-np", str(streams), "-t", "1", "-tb", "1", "--metrics",
                "--host", "127.0.0.1", "--port", str(port)], env=spin_environment())
            url = f"http://127.0.0.1:{port}"
            wait_healthy(item, url)
            return item, url
        presets = write_presets(self.workdir / f"{column}-{streams}.ini", {MODEL: self.model},
                                (["metrics = true"] if column == LLAMACPP else []) + slot,
                                parallel=streams, ctx_size=ctx)
        if column == LLAMACPP:
            item, url = self.bench.start_llamacpp(presets, f"{tag}-llamacpp-router")
        else:
            item, url = self.bench.start_router(presets, f"{tag}-llama-router")
        wait_healthy(item, url)
        return item, url

    # ------------------------------------------------------------ through a real child

    def through_child(self, streams: int) -> dict[str, Any]:
        tokens = self.settings.tokens(streams)
        body = chat_request(MODEL, tokens)
        started = {c: self._start(c, streams, tokens) for c in COLUMNS}
        started[FLOOR] = self._start_floor(streams, started[DIRECT][1])
        runs: dict[str, list[dict[str, Any]]] = {c: [] for c in RELAY_COLUMNS}
        profile: dict[str, Any] | None = None
        try:
            for _, url in started.values():  # loads the model, fills every slot once
                run_streams(url, streams, chat_request(MODEL, 4), None)
            for rnd in range(self.settings.rounds):
                for column in rotate(RELAY_COLUMNS, rnd):
                    item, url = started[column]
                    runs[column].append(run_streams(url, streams, body,
                                                    psutil.Process(item.proc.pid)))
            if self.settings.profile and streams == max(self.settings.streams):
                item, url = started[ROUTER]
                profile = profile_run(url, streams, body, item.proc.pid,
                                      self.workdir / f"profile-child-{streams}.txt")
        finally:
            for item, _ in started.values():
                self.bench.procs.stop(item)
        summary = {c: summarize_runs(runs[c]) for c in RELAY_COLUMNS}
        out: dict[str, Any] = {"streams": streams, "tokens_per_stream": tokens,
                               "summary": summary, "runs": runs}
        if profile is not None:
            out["profile"] = profile
        return out

    # ------------------------------------------------------------ the ceiling

    def ceiling(self) -> dict[str, Any]:
        port = free_port()
        standin = self.bench.procs.start("relay-standin", [
            sys.executable, "-m", "benchmarks.standin", str(port)], cwd=ROOT)
        standin_url = f"http://127.0.0.1:{port}"
        wait_healthy(standin, standin_url)
        presets = self.workdir / "ceiling.ini"
        # As many connections to the stand-in as streams: the default cap (14, for a
        # llama-server's HTTP threads) would otherwise pace the streams, not the router.
        most = max(*self.settings.ceiling_streams, self.settings.burst_streams)
        presets.write_text(f"version = 1\n\n[{STANDIN_MODEL}]\nupstream = {standin_url}\n"
                           f"upstream-connections = {most}\n")
        router, url = self.bench.start_router(presets, "relay-ceiling-llama-router")
        rows: list[dict[str, Any]] = []
        profile: dict[str, Any] | None = None
        try:
            wait_healthy(router, url)
            run_streams(url, 8, chat_request(STANDIN_MODEL, 16), None)  # loads the upstream
            watched = {DIRECT: psutil.Process(standin.proc.pid),
                       ROUTER: psutil.Process(router.proc.pid)}
            modes = [*(("paced", n) for n in self.settings.ceiling_streams),
                     ("burst", self.settings.burst_streams)]
            for mode, streams in modes:
                tokens = self.settings.tokens(streams, self.settings.ceiling_events
                                              * (1 if mode == "paced" else 2))
                body = chat_request(STANDIN_MODEL, tokens, paced=mode == "paced")
                for rnd in range(self.settings.rounds):
                    for column in rotate((DIRECT, ROUTER), rnd):
                        before = standin_stats(standin_url)
                        run = run_streams(standin_url if column == DIRECT else url, streams,
                                          body, watched[column])
                        after = standin_stats(standin_url)
                        run["sent"] = after["events"] - before["events"]
                        run["received"] = run["events"] + run["done"]
                        run["standin_blocked_s"] = after["blocked_s"] - before["blocked_s"]
                        run["standin_skipped_ticks"] = (after["skipped_ticks"]
                                                        - before["skipped_ticks"])
                        rows.append({"mode": mode, "column": column, "streams": streams,
                                     "tokens_per_stream": tokens, "round": rnd, **run})
            if self.settings.profile:
                streams = sorted(self.settings.ceiling_streams)[len(
                    self.settings.ceiling_streams) // 2]
                body = chat_request(STANDIN_MODEL, self.settings.tokens(
                    streams, self.settings.ceiling_events), paced=True)
                profile = profile_run(url, streams, body, router.proc.pid,
                                      self.workdir / "profile-ceiling.txt")
        finally:
            self.bench.procs.stop(router)
            self.bench.procs.stop(standin)
        out: dict[str, Any] = {"runs": rows, "summary": summarize_ceiling(rows)}
        if profile is not None:
            out["profile"] = profile
        return out

    def run(self) -> dict[str, Any]:
        write_tiny_model(self.model, seed=7, name=MODEL)
        return {"settings": {"streams": list(self.settings.streams),
                             "events": self.settings.events, "rounds": self.settings.rounds,
                             "ceiling_streams": list(self.settings.ceiling_streams),
                             "ceiling_events": self.settings.ceiling_events},
                "child": [self.through_child(n) for n in self.settings.streams],
                "ceiling": self.ceiling()}


def standin_stats(url: str) -> dict[str, Any]:
    import httpx

    stats: dict[str, Any] = httpx.get(url + "/stats", timeout=10.0, trust_env=False).json()
    return stats


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Best CPU per event (as the least disturbed run), median events/s and gaps."""
    out = {"events_per_s": percentile([r["events_per_s"] for r in runs], 50),
           "gap_p50_ms": percentile([r["gap_ms"]["p50"] for r in runs], 50),
           "gap_p99_ms": percentile([r["gap_ms"]["p99"] for r in runs], 50),
           "first_event_p50_ms": percentile([r["first_event_ms"]["p50"] for r in runs], 50),
           "events": float(runs[0]["events"])}
    if runs and "server_us_per_event" in runs[0]:
        out["server_us_per_event"] = min(r["server_us_per_event"] for r in runs)
        out["server_us_per_event_median"] = percentile(
            [r["server_us_per_event"] for r in runs], 50)
        out["server_cores"] = percentile([r["server_cores"] for r in runs], 50)
    return out


def summarize_ceiling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for mode, streams in dict.fromkeys((r["mode"], r["streams"]) for r in rows):
        for column in (DIRECT, ROUTER):
            mine = [r for r in rows if (r["mode"], r["streams"], r["column"])
                    == (mode, streams, column)]
            if not mine:
                continue
            out.append({
                "mode": mode, "column": column, "streams": streams,
                "events_per_s": max(r["events_per_s"] for r in mine),
                "server_us_per_event": min(r["server_us_per_event"] for r in mine),
                "server_cores": percentile([r["server_cores"] for r in mine], 50),
                "client_cores": percentile([r["client_cpu_s"] / r["wall_s"] for r in mine], 50),
                "events_per_read": sum(r["received"] for r in mine) / max(1, sum(
                    r["reads"] for r in mine)),
                "sent": sum(r["sent"] for r in mine),
                "received": sum(r["received"] for r in mine),
                "standin_blocked_s": max(r["standin_blocked_s"] for r in mine),
                "standin_skipped_ticks": max(r["standin_skipped_ticks"] for r in mine),
                "gap_p99_ms": percentile([r["gap_ms"]["p99"] for r in mine], 50),
                "peak_rss_mb": max(r["server_peak_rss_mb"] for r in mine),
            })
    return out


def evaluate(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    per_n = []
    met = True
    for row in results["child"]:
        lr = row["summary"][ROUTER]["server_us_per_event"]
        lc = row["summary"][LLAMACPP]["server_us_per_event"]
        met = met and lr <= lc
        floor = row["summary"].get(FLOOR, {}).get("server_us_per_event")
        per_n.append(f"{row['streams']}: {lr:.1f} vs {lc:.1f} us"
                     + (f" (uvloop floor {floor:.1f})" if floor is not None else ""))
    ceiling = [r for r in results["ceiling"]["summary"] if r["column"] == ROUTER]
    lost = sum(r["sent"] - r["received"] for r in ceiling)
    best = max((r["events_per_s"] for r in ceiling), default=0.0)
    return {
        "relay_cpu_per_event": {"goal": GOALS["relay_cpu_per_event"], "met": met,
                                "measured": "llama-router vs llama.cpp router at N streams: "
                                            + "; ".join(per_n)},
        "relay_no_loss": {"goal": GOALS["relay_no_loss"], "met": lost == 0,
                          "measured": f"{sum(r['received'] for r in ceiling):,} of "
                                      f"{sum(r['sent'] for r in ceiling):,} events received; "
                                      f"ceiling {best:,.0f} events/s"},
    }


def render(results: dict[str, Any]) -> str:
    lines = ["| streams | metric | " + " | ".join(RELAY_LABELS[c] for c in RELAY_COLUMNS)
             + " | llama-router / llama.cpp | llama-router over the floor |",
             "|---|---|" + "---:|" * (len(RELAY_COLUMNS) + 2)]
    for row in results["child"]:
        s = row["summary"]
        n = f"{row['streams']} x {row['tokens_per_stream']}"

        def cells(key: str, fmt: str, s: dict[str, Any] = s) -> list[str]:
            return [format(s[c][key], fmt) if key in s.get(c, {}) else "-"
                    for c in RELAY_COLUMNS]

        ratio = s[ROUTER]["server_us_per_event"] / s[LLAMACPP]["server_us_per_event"]
        over = (f"{s[ROUTER]['server_us_per_event'] - s[FLOOR]['server_us_per_event']:+.1f} us"
                if FLOOR in s else "-")
        lines.append(f"| {n} | router CPU per event (us) [direct: the child's] | "
                     + " | ".join(cells("server_us_per_event", ".1f"))
                     + f" | {ratio:.2f}x | {over} |")
        lines.append(f"| {n} | events/s delivered | "
                     + " | ".join(cells("events_per_s", ",.0f")) + " | "
                     f"{s[ROUTER]['events_per_s'] / s[LLAMACPP]['events_per_s']:.2f}x | |")
        direct_gap = s[DIRECT]["gap_p99_ms"]
        lines.append(f"| {n} | inter-event gap p99 (ms) [added over direct] | "
                     + " | ".join("-" if c not in s else f"{s[c]['gap_p99_ms']:.2f}"
                                  + ("" if c == DIRECT else
                                     f" [{s[c]['gap_p99_ms'] - direct_gap:+.2f}]")
                                  for c in RELAY_COLUMNS) + " | | |")
    lines += ["", "Ceiling (stand-in child, llama-router with it as a remote upstream):", "",
              "| mode, streams | target | events/s | server CPU per event (us) | server cores | "
              "client cores | events per client read | sent | received | stand-in waited "
              "(s, ticks) | gap p99 (ms) | peak RSS (MB) |",
              "|---|---|" + "---:|" * 10]
    for r in results["ceiling"]["summary"]:
        target = "stand-in direct" if r["column"] == DIRECT else "llama-router"
        lines.append(f"| {r['mode']}, {r['streams']} | {target} | {r['events_per_s']:,.0f} | "
                     f"{r['server_us_per_event']:.1f} | {r['server_cores']:.2f} | "
                     f"{r['client_cores']:.2f} | {r['events_per_read']:.1f} | {r['sent']:,} | "
                     f"{r['received']:,} | {r['standin_blocked_s']:.2f}, "
                     f"{r['standin_skipped_ticks']} | "
                     f"{r['gap_p99_ms']:.2f} | {r['peak_rss_mb']:.1f} |")
    return "\n".join(lines)


def run_phase(bench: Bench, settings: Settings) -> dict[str, Any]:
    results = RelayBench(bench, settings).run()
    return {"results": results, "targets": evaluate(results), "table": render(results)}
