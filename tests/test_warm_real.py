"""Warm swaps against the real llama-server (``router/warm/swaps.py``): with ``--state-dir``, a
model evicted by a swap (``--models-max 1``) has its slots saved before its child stops, and
restored into its next child before it is ``loaded``, so that the same prompt then comes from
the prompt cache (``timings.cache_n``); without it, the same turn starts cold. A state file
that no longer matches its checksum is discarded with a warning, never restored; a state
file a client names through the router's ``/slots`` is refused.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import RouterProcess, SSEClient, start_router, wait_until, write_presets

pytestmark = pytest.mark.real

GUARD_S = 120.0  # a hang guard, never a measurement
PROMPT = "The quick brown fox jumps over the lazy dog. " * 30  # a few hundred tokens


def presets(tmp_path: Path, tiny_models: dict[str, Path]) -> Path:
    return write_presets(tmp_path / "models.ini",
                         f"[*]\nctx-size = 2048\nparallel = 1\n"
                         f"[alpha]\nmodel = {tiny_models['alpha']}\n"
                         f"[beta]\nmodel = {tiny_models['beta']}\n")


def complete(client: httpx.Client, model: str) -> dict[str, Any]:
    response = client.post("/completion", json={"model": model, "prompt": PROMPT,
                                                "n_predict": 4, "temperature": 0,
                                                "cache_prompt": True}, timeout=GUARD_S)
    assert response.status_code == 200, response.text
    timings: dict[str, Any] = response.json()["timings"]
    return timings


def swap_away_and_back(router: RouterProcess
                       ) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """alpha's prompt, beta (evicts alpha), then alpha's prompt again: both timings, and
    alpha's first child's command line."""
    with router.client() as client:
        first = complete(client, "alpha")
        (child,) = router.children()
        argv = child.cmdline()
        complete(client, "beta")
        assert wait_until(lambda: router.models()["alpha"]["status"]["value"] == "unloaded",
                          GUARD_S)
        again = complete(client, "alpha")
    return first, again, argv


def state_files(state_dir: Path) -> list[Path]:
    return sorted(state_dir.rglob("slot-*.bin"))


@contextlib.contextmanager
def saved_then_reloaded(tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path],
                        line: str) -> Iterator[tuple[RouterProcess, httpx.Client]]:
    """A router with ``--state-dir tmp_path/states``: alpha's state saved by an eviction
    (beta's request), then ``line`` added to alpha's preset and the presets reloaded; the
    router and a client of it, with alpha unloaded."""
    preset_file = presets(tmp_path, tiny_models)
    with start_router(tmp_path, "--presets", str(preset_file), "--llama-server",
                      str(llama_server), "--models-max", "1",
                      "--state-dir", str(tmp_path / "states")) as router, \
            router.client() as client:
        complete(client, "alpha")
        complete(client, "beta")  # alpha saved and stopped
        assert wait_until(lambda: state_files(tmp_path / "states"), GUARD_S)
        preset_file.write_text(preset_file.read_text().replace(
            f"[alpha]\nmodel = {tiny_models['alpha']}\n",
            f"[alpha]\nmodel = {tiny_models['alpha']}\n{line}\n"))
        assert client.post("/models/reload").status_code == 200
        yield router, client


def test_a_swapped_out_model_comes_back_with_its_prompt_cache(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    state_dir = tmp_path / "states"
    with start_router(tmp_path, "--presets", str(presets(tmp_path, tiny_models)),
                      "--llama-server", str(llama_server), "--models-max", "1",
                      "--state-dir", str(state_dir)) as router:
        sse = SSEClient(router.url)
        sse.start()
        assert sse.connected.wait(GUARD_S)
        first, again, argv = swap_away_and_back(router)
        log = router.log()
        states = router.models()["alpha"]["status"]["states"]
        metrics = httpx.get(router.url + "/metrics", timeout=GUARD_S).text
        announced = [e["data"] for e in list(sse.events)
                     if e["event"] == "slot_states" and e["model"] == "alpha"]
        sse.stop.set()
    # Saved (1), then restored (still 1: a state stays until replaced or dropped).
    assert [a["count"] for a in announced] == [1, 1] and announced[0]["bytes"] > 0, announced
    assert states["count"] == 1 and states["bytes"] > 0, states
    assert 'llamarouter_state_saves_total{model="alpha"} 1.0' in metrics, metrics
    assert 'llamarouter_state_restores_total{model="alpha"} 1.0' in metrics
    assert 'llamarouter_state_restored_tokens_total{model="alpha"} ' in metrics
    assert f'llamarouter_state_bytes{{model="alpha"}} {float(states["bytes"])}' in metrics
    slot_dir = Path(argv[argv.index("--slot-save-path") + 1])
    assert slot_dir.parent.parent == state_dir.resolve() or slot_dir.parent.parent == state_dir
    assert first["cache_n"] == 0
    prompt_n = first["prompt_n"]
    assert prompt_n > 100, first
    assert again["cache_n"] >= prompt_n - 1, (first, again)  # only the last token computed
    assert "event=state_saved" in log and "event=state_restored" in log, log
    saved = state_files(state_dir)
    assert len(saved) >= 1 and all(p.with_suffix(".json").is_file() for p in saved)
    assert (state_dir.stat().st_mode & 0o777) == 0o700


def test_without_a_state_dir_the_same_turn_starts_cold(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    with start_router(tmp_path, "--presets", str(presets(tmp_path, tiny_models)),
                      "--llama-server", str(llama_server), "--models-max", "1") as router:
        first, again, argv = swap_away_and_back(router)
    assert again["cache_n"] == 0 and again["prompt_n"] == first["prompt_n"]
    assert "--slot-save-path" not in argv


def test_a_corrupt_state_is_discarded_not_restored(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    state_dir = tmp_path / "states"
    with start_router(tmp_path, "--presets", str(presets(tmp_path, tiny_models)),
                      "--llama-server", str(llama_server), "--models-max", "1",
                      "--state-dir", str(state_dir)) as router, \
            router.client() as client:
        complete(client, "alpha")
        complete(client, "beta")  # alpha saved and stopped
        assert wait_until(lambda: state_files(state_dir), GUARD_S)
        (saved,) = state_files(state_dir)
        data = bytearray(saved.read_bytes())
        data[len(data) // 2] ^= 0xFF  # garbled KV bytes: llama-server would take them
        saved.write_bytes(bytes(data))
        again = complete(client, "alpha")
        assert again["cache_n"] == 0, again
        assert not saved.exists()
        assert "removed: checksum mismatch" in router.log()
        # And the router goes on: the turn after that hits the live cache as usual.
        assert complete(client, "alpha")["cache_n"] >= again["prompt_n"] - 1


def test_a_state_over_the_budget_is_not_kept(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    state_dir = tmp_path / "states"
    with start_router(tmp_path, "--presets", str(presets(tmp_path, tiny_models)),
                      "--llama-server", str(llama_server), "--models-max", "1",
                      "--state-dir", str(state_dir), "--state-budget", "64K") as router:
        _, again, _ = swap_away_and_back(router)
        log = router.log()
    assert again["cache_n"] == 0 and state_files(state_dir) == []
    # refused before the child was asked: its KV per token (GGUF header) times the slot's
    # tokens is over the whole budget, so no file was ever written
    assert "event=state_over_budget" in log and "bytes, over the whole state budget" not in log, \
        log  # (that would be the commit's refusal of a file written)


def test_a_state_of_another_configuration_is_never_restored(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """alpha saved with ctx-size 2048, then its preset changed to 4096 (the KV layout llama.cpp
    checks would still fit): the new child gets a directory of its own, and the old states
    are removed when it loads."""
    state_dir = tmp_path / "states"
    with saved_then_reloaded(tmp_path, llama_server, tiny_models, "ctx-size = 4096") \
            as (router, client):
        (old,) = state_files(state_dir)
        again = complete(client, "alpha")
        assert again["cache_n"] == 0, again
        assert not old.exists() and not old.parent.exists()
        assert "event=state_stale" in router.log()


def test_a_restarted_router_resumes_warm(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """The router's own shutdown saves its models' slots too: the same prompt after a
    restart (same --state-dir, same configuration) comes from the cache."""
    state_dir = tmp_path / "states"
    args = ("--presets", str(presets(tmp_path, tiny_models)), "--llama-server",
            str(llama_server), "--state-dir", str(state_dir))
    with start_router(tmp_path, *args) as router, router.client() as client:
        first = complete(client, "alpha")
    assert len(state_files(state_dir)) == 1  # saved as the router stopped
    with start_router(tmp_path, *args) as router, router.client() as client:
        again = complete(client, "alpha")
    assert first["cache_n"] == 0 and again["cache_n"] >= first["prompt_n"] - 1, again


def test_a_model_with_warm_swaps_turned_off_leaves_nothing_on_disk(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """``warm-swaps = false``: its children get no slot directory, an eviction saves nothing,
    and what it saved while it was on is removed when the router starts."""
    state_dir = tmp_path / "states"
    on = presets(tmp_path, tiny_models)
    args = ("--llama-server", str(llama_server), "--state-dir", str(state_dir),
            "--models-max", "1")
    with start_router(tmp_path, "--presets", str(on), *args) as router, \
            router.client() as client:
        complete(client, "alpha")
    assert len(state_files(state_dir)) == 1  # saved as the router stopped
    off = write_presets(tmp_path / "off.ini",
                        on.read_text().replace("[*]\n", "[*]\nwarm-swaps = false\n"))
    with start_router(tmp_path, "--presets", str(off), *args) as router:
        assert state_files(state_dir) == []  # removed at start
        _, again, argv = swap_away_and_back(router)
        assert "states" not in router.models()["alpha"]["status"]  # no warm swaps to show
    assert "--slot-save-path" not in argv
    assert again["cache_n"] == 0 and state_files(state_dir) == []


def test_a_state_is_never_restored_into_other_weights_of_the_same_size_and_mtime(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """alpha's file replaced in place by beta's weights (the same size), its mtime kept, as
    ``cp -p``, ``rsync -a`` or an image layer with normalised mtimes do: the restarted router
    restores nothing into the new weights, drops the old state and counts it; the same file
    put back as it was gets its states again (its content is what counts)."""
    model = tmp_path / "m.gguf"
    model.write_bytes(tiny_models["alpha"].read_bytes())
    other = tiny_models["beta"].read_bytes()
    assert len(other) == model.stat().st_size and other != model.read_bytes()
    state_dir = tmp_path / "states"
    preset_file = write_presets(tmp_path / "models.ini",
                                f"[*]\nctx-size = 2048\nparallel = 1\n[alpha]\nmodel = {model}\n")
    args = ("--presets", str(preset_file), "--llama-server", str(llama_server),
            "--state-dir", str(state_dir))
    with start_router(tmp_path, *args) as router, router.client() as client:
        complete(client, "alpha")
    (saved,) = state_files(state_dir)
    info = model.stat()
    with open(model, "r+b") as handle:  # in place: the same inode, as cp -p writes
        handle.write(other)
    os.utime(model, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert (model.stat().st_size, model.stat().st_mtime_ns) == (info.st_size, info.st_mtime_ns)
    with start_router(tmp_path, *args) as router, router.client() as client:
        again = complete(client, "alpha")
        metrics = httpx.get(router.url + "/metrics", timeout=GUARD_S).text
        log = router.log()
    assert again["cache_n"] == 0, again  # nothing restored into beta's weights
    assert not saved.exists() and "event=state_stale" in log, log
    assert 'llamarouter_state_refused_total{model="alpha"} 1.0' in metrics, metrics
    assert 'llamarouter_state_restores_total{model="alpha"} 0.0' in metrics


def test_a_router_restarted_on_unchanged_weights_reads_no_file_to_fingerprint(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """The weights' digests are kept in the state directory by file version: a restart
    finds them there (the second router resumes warm with the digests file unchanged)."""
    state_dir = tmp_path / "states"
    args = ("--presets", str(presets(tmp_path, tiny_models)), "--llama-server",
            str(llama_server), "--state-dir", str(state_dir))
    with start_router(tmp_path, *args) as router, router.client() as client:
        first = complete(client, "alpha")
    digests = (state_dir / "digests.json").read_bytes()
    assert str(tiny_models["alpha"].stat().st_ino).encode() in digests
    with start_router(tmp_path, *args) as router, router.client() as client:
        again = complete(client, "alpha")
    assert again["cache_n"] >= first["prompt_n"] - 1, again
    assert (state_dir / "digests.json").read_bytes() == digests  # nothing hashed again


def test_warm_swaps_turned_off_by_a_reload_remove_the_states_at_once(
        tmp_path: Path, llama_server: Path, tiny_models: dict[str, Path]) -> None:
    """alpha's state saved by an eviction, then ``warm-swaps = false`` applied by a reload
    while alpha stays unloaded: its states go with the reload, not at its next load (which
    may never come)."""
    state_dir = tmp_path / "states"
    with saved_then_reloaded(tmp_path, llama_server, tiny_models, "warm-swaps = false") \
            as (router, _):
        assert router.models()["alpha"]["status"]["value"] == "unloaded"
        assert wait_until(lambda: not state_files(state_dir), GUARD_S), state_files(state_dir)
