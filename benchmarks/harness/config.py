"""A benchmark run's configuration (``Config``, from the runner's command line) and the names
of its phases, in the order they run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PHASES = ("main", "relay", "real", "multiturn", "warmswap", "keptcache", "fairness", "bodies",
          "sharing")


@dataclass
class Config:
    rounds: int = 10
    samples: int = 40
    duration: float = 5.0
    throughput_rounds: int = 3
    cold_rounds: int = 5
    connections: int = 32
    presets: int = 500
    loadgen: str = "auto"
    profile: bool = False
    workdir: Path | None = None
    sharing_reps: int = 3  # repetitions of the CPU-sharing phase (benchmarks.sharing); 0 skips it
    only_sharing: bool = False
    stall_bound: float = 30.0  # seconds before a concurrent run counts as stalled
    quick: bool = False
    phases: tuple[str, ...] = PHASES
    # llama-router's --log-level; None: its default (info: every child line is logged too)
    router_log_level: str | None = None
    # Run llama-router from this source tree instead of this repository's (before/after runs)
    router_src: Path | None = None
    real_rounds: int = 4  # interleaved rounds of the real-model phase (benchmarks.realmodel)
    conversations: int = 4  # concurrent conversations of the multi-turn phase
    turns: int = 3  # turns per conversation (the first one is not a follow-up)
    multiturn_reps: int = 1  # runs of the multi-turn workload per target
    warmswap_reps: int = 3  # repetitions of the warm-swap scenario per target
    keptcache: bool = True  # the kept-cache phase (benchmarks.keptcache)
    fairness_seconds: float = 20.0  # each scenario of the teams phase (benchmarks.fairness)
    keptcache_long_words: int = 0  # its long conversation's words (7200: ~8,000 tokens)
    # The multi-turn phase's saturated configuration instead (benchmarks.multiturn), and a
    # llama-router source tree whose prefix routing it also runs (before/after in one run)
    multiturn_saturated: bool = False
    multiturn_baseline: Path | None = None
    multiturn_cache_ram: int | None = 512  # the saturated configuration's cache-ram (MiB)
    # The relay phase (benchmarks.relay): concurrent streams per run, events per run (all
    # streams together), interleaved rounds; None: the phase's defaults
    relay_streams: tuple[int, ...] | None = None
    relay_events: int | None = None
    relay_rounds: int | None = None
