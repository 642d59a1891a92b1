"""Benchmark harness: a direct llama-server, llama.cpp's own router mode and llama-router.

One run generates tiny models, starts the three targets on free 127.0.0.1 ports (plus one
router of each kind with a large preset file for ``GET /models``), measures them in
interleaved rounds, prints a table and optionally writes JSON::

    python -m benchmarks.bench [--rounds N] [--duration S] [--quick] [--out PATH] [--profile]

Measured, round-robin across the targets so noise hits all of them alike:

* non-streaming chat latency (``max_tokens`` 1), streaming time to first content chunk (on a
  new connection per request, and on a keep-alive client) and ``POST /tokenize`` latency, one
  request at a time;
* ``/tokenize`` throughput with 32 keep-alive connections (``wrk`` when installed, else a raw
  asyncio generator run as a subprocess); the generator's own CPU use is recorded to show it is
  not the bottleneck;
* cold start (request to an unloaded model until its first token) and a swap under
  ``--models-max 1`` (after a non-streaming request to the loaded model), against a direct
  llama-server's own spawn → ``/health`` 200 time, with the router process's own CPU over
  each (the kernel's CPU-time clock of the process; the children's excluded);
* router RSS (the router process alone) idle and under the throughput load;
* ``GET /models`` with a 500-section preset file.

Then, with the real SmolLM2-135M-Instruct (``benchmarks.realmodel``, ``benchmarks.multiturn``):
generated tokens/s at 1 and 4 streams, TTFT, byte-identical output and swap time; and a
multi-turn workload on ``replicas = 2`` (prefix vs least-busy replica routing). Last, the
CPU-sharing phase (``benchmarks.sharing``). ``--phases`` picks which run.

llama-router runs as users run it: at its default log level (every child line relayed to its
log at info), unless ``--router-log-level`` says otherwise.

Every process the harness starts is stopped in a ``finally`` block and checked with psutil.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from router.llama.install import find_llama_server

from .harness.columns import COLUMNS, LABELS
from .harness.config import PHASES, Config
from .harness.errors import BenchError
from .harness.loadgen import loadgen_main
from .harness.processes import ROOT, Processes
from .harness.table import render_table
from .harness.targets import Bench
from .mainphase import MainPhase, build_rows, evaluate, python_floor

# --------------------------------------------------------------------------- the phases

def _relay(bench: Bench) -> dict[str, Any]:
    from . import relay

    cfg = bench.cfg
    settings = relay.Settings.quick() if cfg.quick else relay.Settings()
    if cfg.relay_streams:
        settings.streams = settings.ceiling_streams = cfg.relay_streams
    settings.events = cfg.relay_events or settings.events
    settings.rounds = cfg.relay_rounds or settings.rounds
    settings.profile = cfg.profile
    return relay.run_phase(bench, settings)


def _real(bench: Bench) -> dict[str, Any]:
    from . import realmodel

    cfg = bench.cfg
    real = realmodel.Settings.quick() if cfg.quick else realmodel.Settings()
    real.rounds = cfg.real_rounds if not cfg.quick else real.rounds
    return realmodel.run_phase(bench, real)


def _multiturn(bench: Bench) -> dict[str, Any]:
    from . import multiturn

    cfg = bench.cfg
    if cfg.multiturn_saturated:
        turns = multiturn.Settings.saturated(cfg.multiturn_reps, cfg.multiturn_baseline)
        turns.cache_ram_mib = cfg.multiturn_cache_ram
        if cfg.quick:
            turns.system_words, turns.max_tokens, turns.turns = 80, 4, 2
    else:
        turns = multiturn.Settings.quick() if cfg.quick else multiturn.Settings(
            conversations=cfg.conversations, turns=cfg.turns, reps=cfg.multiturn_reps,
            baseline_src=cfg.multiturn_baseline)
    return multiturn.run_phase(bench, turns)


def _warmswap(bench: Bench) -> dict[str, Any]:
    from . import warmswap

    cfg = bench.cfg
    swaps = warmswap.Settings.quick() if cfg.quick else warmswap.Settings(
        reps=cfg.warmswap_reps)
    return warmswap.run_phase(bench, swaps)


def _keptcache(bench: Bench) -> dict[str, Any]:
    from . import keptcache

    cfg = bench.cfg
    kept = keptcache.Settings.quick() if cfg.quick else keptcache.Settings(
        long_words=cfg.keptcache_long_words)
    return keptcache.run_phase(bench, kept)


def _fairness(bench: Bench) -> dict[str, Any]:
    from . import fairness

    cfg = bench.cfg
    teams = fairness.Settings.quick() if cfg.quick else fairness.Settings(
        seconds=cfg.fairness_seconds)
    return fairness.run_phase(bench, teams)


def _bodies(bench: Bench) -> dict[str, Any]:
    from . import bodies

    return bodies.run_phase(bench, bench.cfg.quick)


def _sharing(bench: Bench) -> dict[str, Any]:
    from .sharing import run_phase

    cfg = bench.cfg
    return run_phase(bench.workdir, bench.procs, bench.binary, cfg.sharing_reps,
                     cfg.stall_bound, cfg.quick)


# The phases after the main one, in the order they run: (its name in --phases, its key in
# the report, whether the configuration runs it, the run).
LATER_PHASES: tuple[tuple[str, str, Callable[[Config], bool],
                          Callable[[Bench], dict[str, Any]]], ...] = (
    ("relay", "relay", lambda cfg: True, _relay),
    ("real", "real_model", lambda cfg: cfg.real_rounds > 0, _real),
    ("multiturn", "multiturn", lambda cfg: cfg.multiturn_reps > 0, _multiturn),
    ("warmswap", "warmswap", lambda cfg: cfg.warmswap_reps > 0, _warmswap),
    ("keptcache", "keptcache", lambda cfg: cfg.keptcache, _keptcache),
    ("fairness", "fairness", lambda cfg: cfg.fairness_seconds > 0, _fairness),
    ("bodies", "bodies", lambda cfg: True, _bodies),
    ("sharing", "sharing", lambda cfg: cfg.sharing_reps > 0, _sharing),
)


@dataclass
class Outcome:
    """What the phases of one run returned, and each one's wall time."""

    results: dict[str, Any] = field(default_factory=dict)  # the main phase's
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)  # the others', by key
    wall: dict[str, float] = field(default_factory=dict)
    mark: float = field(default_factory=time.perf_counter)

    def took(self, phase: str) -> None:
        now = time.perf_counter()
        self.wall[phase] = round(now - self.mark, 1)
        self.mark = now


def run_phases(bench: Bench, main: MainPhase, outcome: Outcome) -> None:
    """Every phase the configuration names, in order, each starting its own servers."""
    cfg = bench.cfg
    if "main" in cfg.phases:
        outcome.results = main.run()
        main.stop_targets()
        outcome.took("main")
    for phase, key, runs, run in LATER_PHASES:
        if phase in cfg.phases and runs(cfg):
            outcome.phases[key] = run(bench)
            outcome.took(phase)


# --------------------------------------------------------------------------- report

def machine_info(binary: Path, router_src: Path | None = None) -> dict[str, Any]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                             timeout=30)
    build = next((ln.strip() for ln in (version.stdout + version.stderr).splitlines()
                  if "build" in ln), "unknown")
    wrk = shutil.which("wrk")
    wrk_version = "not installed"
    if wrk:
        out = subprocess.run([wrk, "--version"], capture_output=True, text=True, timeout=10)
        wrk_version = (out.stdout + out.stderr).splitlines()[0] if out.stdout + out.stderr \
            else "unknown"
    root = router_src or ROOT  # the routers under test run from there
    source = str(root)
    if (root / ".git").exists():
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "router"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        source += f" @ {rev}{' (router/ modified)' if dirty else ''}"
    return {"nproc": os.cpu_count(), "cpu": cpu, "router_source": source,
            "ram_gb": round(psutil.virtual_memory().total / 1e9, 1),
            "python": platform.python_version(), "platform": platform.platform(),
            "llama_server": str(binary), "llama_cpp_build": build, "wrk": wrk_version}


def run_bench(cfg: Config) -> dict[str, Any]:
    binary = find_llama_server()
    keep = cfg.workdir is not None
    workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="llama-router-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logdir = workdir / "logs"
    logdir.mkdir(exist_ok=True)
    procs = Processes(logdir)
    bench = Bench(cfg, workdir, procs, binary)
    main = MainPhase(bench)
    began = time.perf_counter()
    load_before = os.getloadavg()
    leftovers: list[str] = []
    outcome = Outcome()
    try:
        run_phases(bench, main, outcome)
    except BaseException:
        for item in procs.items:
            print(f"--- {item.name} log tail ---\n{item.tail(15)}", file=sys.stderr)
        raise
    finally:
        main.close()
        leftovers = procs.stop_all()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        if leftovers:
            print(f"WARNING: killed leftover processes: {leftovers}", file=sys.stderr)
    report: dict[str, Any] = {
        "machine": machine_info(binary, cfg.router_src),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg).items()},
        "columns": {c: LABELS[c] for c in COLUMNS},
        "details": outcome.results,
        "leftover_processes": leftovers,
        "loadavg_1m": {"start": round(load_before[0], 2), "end": round(os.getloadavg()[0], 2)},
        "wall_s": round(time.perf_counter() - began, 1),
        "phase_wall_s": outcome.wall,
        "targets": {},
    }
    add_phases(report, outcome, cfg.presets)
    return report


def add_phases(report: dict[str, Any], outcome: Outcome, presets: int) -> None:
    """Each phase's results, table and targets into the report."""
    if outcome.results:
        rows = build_rows(outcome.results, presets)
        report["metrics"] = {r.key: {"label": r.label, "unit": r.unit, "kind": r.kind,
                                     **r.values} for r in rows}
        report["targets"] = evaluate(outcome.results, rows)
        report["table"] = render_table(rows)
    for name, phase in outcome.phases.items():
        report[name] = phase
        report["targets"].update(phase["targets"])


def print_report(report: dict[str, Any]) -> None:
    machine = report["machine"]
    print(f"\nmachine: {machine['nproc']} x {machine['cpu']}, {machine['ram_gb']} GB RAM, "
          f"Python {machine['python']}, llama.cpp {machine['llama_cpp_build']}")
    details = report["details"]
    print(f"llama-router source: {machine['router_source']}")
    tool = details["throughput"]["tool"] if details else "-"
    level = report["config"].get("router_log_level") or "its default (info)"
    phase_wall = ", ".join(f"{k} {v:g} s" for k, v in report.get("phase_wall_s", {}).items())
    print(f"throughput generator: {tool}; llama-router log level: {level}; "
          f"wall {report['wall_s']} s ({phase_wall}); "
          f"1-min load average {report['loadavg_1m']['start']} -> {report['loadavg_1m']['end']}\n")
    if "table" in report:
        print(report["table"])
        print(python_floor(details))
        print()
    for name, title in (("relay", "Relaying streamed tokens (tiny model, parallel = N, "
                                  "threads = 1):"),
                        ("real_model", "Real model (SmolLM2-135M-Instruct Q4_1):"),
                        ("multiturn", "Multi-turn conversations, replicas = 2 (SmolLM2):"),
                        ("warmswap", "A conversation's next turn after its model was swapped "
                                     "out (SmolLM2, ~2,000 tokens):"),
                        ("keptcache", "Every conversation keeps its cache: more "
                                      "conversations than slots, through churn, a swap and a "
                                      "restart (SmolLM2):"),
                        ("fairness", "Teams sharing one slot: fair share and priority "
                                     "classes (SmolLM2, parallel = 1; weighted tokens):"),
                        ("bodies", "The largest request bodies, while /health is asked every "
                                   "10 ms (tiny model):")):
        phase = report.get(name)
        if phase is None:
            continue
        print(title)
        print(phase.get("table") or phase.get("skipped"))
        print()
    if "sharing" in report:
        print("Models generating at the same time on the CPU (seconds; '>' = stalled past "
              "the bound):")
        print(report["sharing"]["table"])
        print()
    for target in report["targets"].values():
        mark = {True: "MET   ", False: "MISSED", None: "NOTRUN"}[target["met"]]
        print(f"{mark} {target['goal']}: {target['measured']}")
    profile = details.get("profile")
    if profile and "self_by_function_pct" in profile:
        print(f"\nllama-router profile under /tokenize load ({profile['samples']} samples, "
              f"{profile['rps_while_profiled']:.0f} req/s while sampled):")
        print("  self time by package: " + ", ".join(
            f"{k} {v}%" for k, v in profile["self_by_package_pct"][:12]))
        print("  top self functions:")
        for name, pct in profile["self_by_function_pct"][:15]:
            print(f"    {pct:5.1f}%  {name}")
    elif profile:
        print(f"\nprofile: {profile.get('error')}")


# --------------------------------------------------------------------------- CLI

def _main_phase_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, help="interleaved latency rounds (default 10)")
    parser.add_argument("--samples", type=int,
                        help="requests per target, metric and round (default 40)")
    parser.add_argument("--duration", type=float,
                        help="seconds per throughput run (default 5)")
    parser.add_argument("--throughput-rounds", type=int,
                        help="throughput runs per target (default 3)")
    parser.add_argument("--cold-rounds", type=int,
                        help="cold-start and swap samples per router (default 5)")
    parser.add_argument("--connections", type=int, help="throughput connections (default 32)")
    parser.add_argument("--presets", type=int,
                        help="sections in the GET /models preset file (default 500)")
    parser.add_argument("--load-tool", dest="loadgen_tool", choices=["auto", "wrk", "python"],
                        default="auto", help="throughput generator (default: wrk if installed)")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy llama-router under the /tokenize load (extra run)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny settings for a smoke test (a few seconds per phase)")


def _later_phase_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sharing-reps", type=int,
                        help="repetitions of the CPU-sharing phase (default 3; 0 skips it)")
    parser.add_argument("--stall-bound", type=float,
                        help="seconds before a run of the CPU-sharing phase counts as stalled "
                        "(default 30)")
    parser.add_argument("--only-sharing", action="store_true",
                        help="run only the CPU-sharing phase (= --phases sharing)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"comma list of the phases to run, of {', '.join(PHASES)} "
                        "(default: all)")
    parser.add_argument("--real-rounds", type=int,
                        help="interleaved rounds of the real-model phase (default 4; 0 skips)")
    parser.add_argument("--conversations", type=int,
                        help="concurrent conversations of the multi-turn phase (default 4)")
    parser.add_argument("--turns", type=int,
                        help="turns per conversation of the multi-turn phase (default 3)")
    parser.add_argument("--multiturn-reps", type=int,
                        help="runs of the multi-turn workload per target (default 1; 0 skips)")
    parser.add_argument("--warmswap-reps", type=int,
                        help="repetitions of the warm-swap phase per target (default 3; 0 "
                        "skips it)")
    parser.add_argument("--fairness-seconds", type=float,
                        help="seconds of each scenario of the teams phase (0: skip it)")
    parser.add_argument("--keptcache-long-words", type=int,
                        help="words of the kept-cache phase's long conversation (7200: ~8,000 "
                        "tokens; default 0: none)")
    parser.add_argument("--no-keptcache", dest="keptcache", action="store_false",
                        default=None, help="skip the kept-cache phase")
    parser.add_argument("--multiturn-saturated", action="store_true",
                        help="the multi-turn phase's saturated configuration: 8 conversations "
                        "of ~1,000 tokens at once, shuffled each turn, two one-slot replicas")
    parser.add_argument("--multiturn-cache-ram",
                        help="each child's cache-ram in MiB in the saturated configuration "
                        "(default 512; 'default': the router's own, one KV cache's worth)")
    parser.add_argument("--multiturn-baseline", type=Path,
                        help="also run the multi-turn phase's prefix routing from this "
                        "llama-router source tree (before/after in one run)")


def _relay_and_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--relay-streams",
                        help="comma list of concurrent streams of the relay phase "
                        "(default 8,64,256)")
    parser.add_argument("--relay-events", type=int,
                        help="events per run of the relay phase, all streams together "
                        "(default 8192; the ceiling's: 120000)")
    parser.add_argument("--relay-rounds", type=int,
                        help="interleaved rounds of the relay phase (default 3)")
    parser.add_argument("--router-log-level",
                        help="start llama-router with this --log-level (default: none given, "
                        "so its default, info)")
    parser.add_argument("--router-src", type=Path,
                        help="run llama-router from this source tree (a copy of the "
                        "repository) instead of this one: before/after comparisons")
    parser.add_argument("--workdir", type=Path, help="keep models, presets and logs here")
    parser.add_argument("--out", type=Path, help="write the JSON report here")
    parser.add_argument("--loadgen", help=argparse.SUPPRESS)
    parser.add_argument("--loadgen-body", help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description="Benchmark a direct llama-server, llama.cpp's router mode and "
        "llama-router on this machine (tiny generated models).")
    _main_phase_options(parser)
    _later_phase_options(parser)
    _relay_and_run_options(parser)
    return parser


def _main_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Config:
    """The main phase's settings, ``--quick`` and the phases to run."""
    cfg = Config()
    if args.quick:
        cfg = Config(rounds=1, samples=5, duration=1.0, throughput_rounds=1, cold_rounds=1,
                     presets=500)
    for name in ("rounds", "samples", "duration", "throughput_rounds", "cold_rounds",
                 "connections", "presets"):
        value = getattr(args, name)
        if value is not None:
            if value <= 0:
                parser.error(f"--{name.replace('_', '-')} must be positive")
            setattr(cfg, name, value)
    if args.quick:
        cfg.sharing_reps = 1
        cfg.quick = True
    if args.sharing_reps is not None:
        if args.sharing_reps < 0:
            parser.error("--sharing-reps must be 0 or more")
        cfg.sharing_reps = args.sharing_reps
    cfg.only_sharing = args.only_sharing
    phases = tuple(p.strip() for p in args.phases.split(",") if p.strip())
    unknown = sorted(set(phases) - set(PHASES))
    if unknown or not phases:
        parser.error(f"--phases: unknown {', '.join(unknown) or 'empty list'}; "
                     f"choose from {', '.join(PHASES)}")
    cfg.phases = ("sharing",) if args.only_sharing else phases
    return cfg


def _later_phases_config(cfg: Config, args: argparse.Namespace,
                         parser: argparse.ArgumentParser) -> None:
    """The settings of the phases after the main one, but the multi-turn's trees."""
    if args.keptcache is not None:
        cfg.keptcache = args.keptcache
    if args.fairness_seconds is not None:
        if not args.fairness_seconds >= 0:
            parser.error("--fairness-seconds must be 0 or more")
        cfg.fairness_seconds = args.fairness_seconds
    for name in ("real_rounds", "conversations", "turns", "multiturn_reps", "warmswap_reps",
                 "keptcache_long_words"):
        value = getattr(args, name)
        if value is not None:
            if value < (0 if name in ("real_rounds", "multiturn_reps", "warmswap_reps",
                                      "keptcache_long_words") else 1):
                parser.error(f"--{name.replace('_', '-')} is out of range")
            setattr(cfg, name, value)
    if args.relay_streams is not None:
        try:
            cfg.relay_streams = tuple(int(n) for n in args.relay_streams.split(","))
        except ValueError:
            parser.error("--relay-streams: a comma list of numbers")
        if not cfg.relay_streams or min(cfg.relay_streams) < 1:
            parser.error("--relay-streams: each at least 1")
    for name in ("relay_events", "relay_rounds"):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                parser.error(f"--{name.replace('_', '-')} must be positive")
            setattr(cfg, name, value)
    if args.turns is not None and args.turns < 2:
        parser.error("--turns must be 2 or more (follow-up turns are measured)")


def _trees_and_run_config(cfg: Config, args: argparse.Namespace,
                          parser: argparse.ArgumentParser) -> None:
    """The llama-router trees and log level, the multi-turn phase's configuration, the rest."""
    cfg.router_log_level = args.router_log_level
    if args.router_src is not None:
        if not (args.router_src / "router" / "cli.py").is_file():
            parser.error(f"--router-src: no router/cli.py in {args.router_src}")
        cfg.router_src = args.router_src.resolve()
    cfg.multiturn_saturated = args.multiturn_saturated
    if args.multiturn_cache_ram is not None:
        if args.multiturn_cache_ram == "default":
            cfg.multiturn_cache_ram = None
        elif args.multiturn_cache_ram.isdigit():
            cfg.multiturn_cache_ram = int(args.multiturn_cache_ram)
        else:
            parser.error("--multiturn-cache-ram: a number of MiB, or 'default'")
    if args.multiturn_baseline is not None:
        if not (args.multiturn_baseline / "router" / "cli.py").is_file():
            parser.error(f"--multiturn-baseline: no router/cli.py in {args.multiturn_baseline}")
        cfg.multiturn_baseline = args.multiturn_baseline.resolve()
    if args.stall_bound is not None:
        if args.stall_bound <= 0:
            parser.error("--stall-bound must be positive")
        cfg.stall_bound = args.stall_bound
    cfg.loadgen = args.loadgen_tool
    cfg.profile = args.profile
    cfg.workdir = args.workdir


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.loadgen:
        return loadgen_main(args.loadgen, (args.loadgen_body or "").encode(),
                            args.connections or 32, args.duration or 5.0)

    cfg = _main_config(args, parser)
    _later_phases_config(cfg, args, parser)
    _trees_and_run_config(cfg, args, parser)

    try:
        report = run_bench(cfg)
    except BenchError as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1
    print_report(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
