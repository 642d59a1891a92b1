"""Warm swaps in process (``router/warm/swaps.py``): saves and restores against a stand-in child
(an ``httpx.MockTransport`` that writes and reads slot files as llama-server does), the bounds
that end a save or a restore that hangs, and the router's refusal of a client's slot files.
The real llama-server: tests/test_warm_real.py; a save that hangs in the whole scheduling core:
tests/test_simulation.py."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from starlette.applications import Starlette
from support import fake_binary, start_router, write_presets

from router.children.backend import Backend
from router.config.presets import ModelPreset
from router.config.settings import Settings
from router.config.sources import build_catalogue
from router.core.view import ModelView
from router.edge.state import State
from router.errors import Unavailable
from router.events import EventBus
from router.llama.flags import FlagTable
from router.server import Prepared, build_app
from router.serving.load import new_replica
from router.teams.usage import FILE_NAME as USAGE_FILE
from router.warm import swaps as warm
from router.warm.choice import (
    MIN_TOKENS,
    Io,
    destinations,
    prefix_keys,
    within_budget,
    worth_saving,
    worth_saving_of,
)
from router.warm.statestore import LOCK_NAME, StateStore, model_dir_name
from router.warm.swaps import SlotHolder, WarmSwaps
from router.warm.weights import weight_files

GUARD_S = 30.0  # a hang guard, never a measurement


class StandIn:
    """One child's slots as llama-server keeps them: ``tokens`` per slot id; a save writes
    ``bytes_per_token`` bytes a token into ``directory`` (its --slot-save-path)."""

    def __init__(self, directory: Path, tokens: list[int], *, bytes_per_token: int = 8) -> None:
        self.directory = directory
        self.tokens = tokens
        self.bytes_per_token = bytes_per_token
        self.hang: str | None = None  # "save" or "restore": that action never answers
        self.restored: list[tuple[int, str]] = []
        self.refuse_restore = False
        self.prompt_tps = 1000.0  # its llamacpp:prompt_tokens_seconds
        self.save_ms = 1.0  # what it reports a save took
        self.requests: list[httpx.Request] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path == "/metrics":
            return httpx.Response(200, text="# TYPE llamacpp:prompt_tokens_seconds gauge\n"
                                            f"llamacpp:prompt_tokens_seconds {self.prompt_tps}\n")
        if request.url.path == "/slots":
            return httpx.Response(200, json=[{"id": i, "n_prompt_tokens": n, "is_processing":
                                              False} for i, n in enumerate(self.tokens)])
        slot = int(request.url.path.rsplit("/", 1)[1])
        action = request.url.params["action"]
        filename = json.loads(request.content)["filename"]
        if self.hang == action:
            await asyncio.Event().wait()
        path = self.directory / filename
        if action == "save":
            size = self.tokens[slot] * self.bytes_per_token
            path.write_bytes(bytes([slot]) * size)
            return httpx.Response(200, json={"id_slot": slot, "filename": filename,
                                             "n_saved": self.tokens[slot], "n_written": size,
                                             "timings": {"save_ms": self.save_ms}})
        if self.refuse_restore or not path.is_file():
            return httpx.Response(400, json={"error": {"code": 400, "message": "no"}})
        self.restored.append((slot, filename))
        return httpx.Response(200, json={"id_slot": slot, "filename": filename,
                                         "n_restored": path.stat().st_size // 8,
                                         "n_read": path.stat().st_size})


def child(name: str, recent: tuple[int, ...] = ()) -> SlotHolder:
    """A replica whose child is the stand-in ``name``, with the prefix keys it served."""
    return SlotHolder(cast(Backend, SimpleNamespace(base_url=f"http://{name}")), recent)


@pytest.fixture
def model(tmp_path: Path) -> ModelPreset:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    return ModelPreset("m", MappingProxyType({"model": str(path), "ctx-size": "4096"}))


def swaps(tmp_path: Path, stand_ins: dict[str, StandIn],
          events: EventBus | None = None) -> tuple[WarmSwaps, StateStore]:
    async def route(request: httpx.Request) -> httpx.Response:
        return await stand_ins[request.url.host].handle(request)

    store = StateStore(tmp_path / "states", 1 << 30)
    client = httpx.AsyncClient(transport=httpx.MockTransport(route))
    return WarmSwaps(store, "b11434", client, events), store


def known(swaps_: WarmSwaps, *presets: ModelPreset) -> None:
    """The presets' weight files digested, as a load's ``prepare`` does."""
    for preset in presets:
        for path in weight_files(preset):
            assert swaps_.prints.digests.digest_now(path) is not None


def swaps_for(tmp_path: Path, preset: ModelPreset, stand_ins: dict[str, StandIn],
              events: EventBus | None = None) -> tuple[WarmSwaps, StateStore, Path]:
    """``swaps``, with every stand-in writing into ``preset``'s slot directory (returned)."""
    swaps_, store = swaps(tmp_path, stand_ins, events)
    known(swaps_, preset)
    directory = swaps_.slot_dir(preset)
    assert directory is not None and directory.is_relative_to(store.root)
    for stand_in in stand_ins.values():
        stand_in.directory = directory
    return swaps_, store, directory


async def test_slots_worth_saving_are_saved_and_restored_into_the_same_slot(
        tmp_path: Path, model: ModelPreset) -> None:
    store_dir = tmp_path / "states"
    stand_in = StandIn(store_dir, [MIN_TOKENS * 4, MIN_TOKENS - 1, MIN_TOKENS])
    swaps_, store, directory = swaps_for(tmp_path, model, {"a": stand_in})
    assert await swaps_.save(model, [child("a")]) == 2  # slot 1 holds too few tokens
    assert sorted(s.slot for s in store.states("m", directory.name)) == [0, 2]
    assert (await swaps_.restore(model, [child("a")])).count == 2
    assert sorted(slot for slot, _ in stand_in.restored) == [0, 2]
    assert not list(directory.glob("tmp-*"))


async def test_a_configuration_whose_restores_miss_is_neither_saved_nor_restored(
        tmp_path: Path, model: ModelPreset) -> None:
    """Once its restores did not hit (``Conversations.learn``), a stop saves none of the
    model's slots and a load restores none; another configuration, and the same model added
    again after its removal, start afresh."""
    stand_in = StandIn(tmp_path / "states", [MIN_TOKENS * 4])
    swaps_, store, directory = swaps_for(tmp_path, model, {"a": stand_in})
    assert await swaps_.save(model, [child("a")]) == 1
    swaps_.ledger.do_not_restore("m", directory.name, "its restores did not hit")
    asked = len(stand_in.requests)
    assert await swaps_.save(model, [child("a")]) == 0
    assert (await swaps_.restore(model, [child("a")])).count == 0
    assert len(stand_in.requests) == asked  # nothing was asked of the child
    assert swaps_.ledger.unrestorable("m") == "its restores did not hit"
    assert swaps_.ledger.restores("m", "another configuration")
    swaps_.forget("m")  # its preset removed
    assert swaps_.ledger.unrestorable("m") is None
    assert swaps_.ledger.restores("m", directory.name) and store.usage() == {}


async def test_no_request_to_a_child_leaves_its_connection_open(
        tmp_path: Path, model: ModelPreset) -> None:
    """A connection left idle in the shared pool holds up the child's exit when it stops
    (llama-server waits on it): every request of a save or a restore closes its own."""
    stand_in = StandIn(tmp_path, [MIN_TOKENS * 4])
    swaps_, _, _ = swaps_for(tmp_path, model, {"a": stand_in})
    await swaps_.save(model, [child("a")])
    await swaps_.save(model, [child("a")])  # the cost is known: it asks for /metrics too
    await swaps_.restore(model, [child("a")])
    paths = {request.url.path for request in stand_in.requests}
    assert paths == {"/slots", "/metrics", "/slots/0"}
    assert all(request.headers.get("connection") == "close" for request in stand_in.requests)


def test_a_slot_is_saved_when_computing_it_again_costs_more() -> None:
    unknown = Io()
    assert not worth_saving(MIN_TOKENS - 1, 1.0, unknown)  # too small, whatever the speeds
    assert worth_saving(MIN_TOKENS, None, unknown) and worth_saving(MIN_TOKENS, 1e9, unknown)
    disk = Io(bytes_per_token=20_000, save_ms_per_byte=1e-5, restore_ms_per_byte=2e-6)
    # 1,000 tokens: 20 MB, 240 ms to save and restore; at 250 tokens/s they take 4 s again.
    assert worth_saving(1000, 250.0, disk)
    assert not worth_saving(1000, 10_000.0, disk)  # 100 ms again: cheaper than the disk
    assert worth_saving(1000, None, disk)  # the child's speed unknown: the threshold decides
    assert worth_saving(1000, 0.0, disk) and worth_saving(1000, -1.0, disk)


def test_the_slots_chosen_and_where_each_state_goes_back_are_pure_decisions() -> None:
    """``choice``: the slots worth saving, in order (a count that is no int is none); those
    over the whole budget never written; a state goes back to the replica and slot its
    number names, and one of a replica the model no longer has is left out."""
    slots = [{"id": 0, "n_prompt_tokens": MIN_TOKENS}, {"id": 1, "n_prompt_tokens": 3},
             {"id": 2, "n_prompt_tokens": True}, {"id": 3, "n_prompt_tokens": "900"},
             {"id": 4}, {"id": 5, "n_prompt_tokens": 5000}]
    wanted = worth_saving_of(slots, None, Io())
    assert wanted == [(0, MIN_TOKENS), (5, 5000)]
    assert within_budget(wanted, None) == (wanted, [])
    assert within_budget(wanted, 4999) == ([(0, MIN_TOKENS)], [(5, 5000)])
    states = ["s0", "s1", "s2", "s3"]
    assert destinations(states, [0, 5, 2, 9], 4, 2) == [(0, 0, "s0"), (1, 1, "s1"),
                                                        (0, 2, "s2")]
    assert destinations(states[:1], [3], 0, 1) == [(0, 3, "s0")]  # slots unknown: replica 0
    assert prefix_keys(list(range(2000))) == tuple(range(2000 - 1024, 2000))
    assert prefix_keys([1, True]) == () and prefix_keys("1") == ()


async def test_the_cost_learned_from_a_save_decides_the_next_one(
        tmp_path: Path, model: ModelPreset) -> None:
    stand_in = StandIn(tmp_path, [MIN_TOKENS * 10])
    swaps_, _, _ = swaps_for(tmp_path, model, {"a": stand_in})
    stand_in.save_ms = 5_000.0  # a very slow disk: 5 s for 640 tokens
    assert await swaps_.save(model, [child("a")]) == 1  # nothing known yet: saved
    io = swaps_.ledger.io["m"]
    assert io.bytes_per_token == 8 and io.save_ms_per_byte == 5_000.0 / (MIN_TOKENS * 80)
    stand_in.prompt_tps = 10_000.0  # 64 ms to compute again
    assert await swaps_.save(model, [child("a")]) == 0  # not worth 5 s of disk
    stand_in.prompt_tps = 10.0  # 64 s to compute again
    assert await swaps_.save(model, [child("a")]) == 1


async def test_a_restored_replica_learns_the_prefixes_it_served(tmp_path: Path) -> None:
    """With prefix routing, each replica's recent prefix keys are kept with its states, and
    the new replica a state goes into records them: the next turn is routed to its cache."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    routed = ModelPreset("m", MappingProxyType({"model": str(path)}), replicas=2)
    assert routed.prefix_routing
    stand_ins = {"a": StandIn(tmp_path, [MIN_TOKENS]), "b": StandIn(tmp_path, [MIN_TOKENS])}
    swaps_, _, _ = swaps_for(tmp_path, routed, stand_ins)
    old = [child("a", (11, 12, 13)), child("b", (21, 22))]
    assert await swaps_.save(routed, old) == 2
    restored = await swaps_.restore(routed, [child("a"), child("b")])
    assert restored.count == 2
    new = [new_replica(c.child, keys) for c, keys in zip(old, restored.learned, strict=True)]
    assert new[0].prefixes.longest([11, 12, 13]) == 3 and new[0].prefixes.longest([21]) == 0
    assert new[1].prefixes.longest([21, 22]) == 2
    # Without prefix routing nothing is kept: the states carry no keys.
    least = ModelPreset("m", routed.args, replicas=2, replica_routing="least-busy")
    assert await swaps_.save(least, old) == 2
    fresh = await swaps_.restore(least, [child("a"), child("b")])
    assert fresh.count == 2 and fresh.learned == ((), ())


async def test_a_removed_model_takes_its_states_with_it(tmp_path: Path,
                                                        model: ModelPreset) -> None:
    """... and every change of a model's states is announced (``slot_states``)."""
    events = EventBus()
    heard: list[dict[str, Any]] = []
    events.listeners.append(heard.append)
    stand_in = StandIn(tmp_path, [MIN_TOKENS])
    swaps_, store, directory = swaps_for(tmp_path, model, {"a": stand_in}, events)
    assert await swaps_.save(model, [child("a")]) == 1
    assert swaps_.ledger.counts["m"].saved == 1 and "m" in swaps_.ledger.io
    swaps_.forget("m")
    assert store.usage() == {} and not directory.parent.exists()
    assert [(e["event"], e["data"]["count"]) for e in heard] == [("slot_states", 1),
                                                                 ("slot_states", 0)]
    # Nothing of it is left behind for a model added again under the same id.
    assert "m" not in swaps_.ledger.counts and "m" not in swaps_.ledger.io


async def test_replicas_keep_their_own_states(tmp_path: Path, model: ModelPreset) -> None:
    stand_ins = {"a": StandIn(tmp_path, [MIN_TOKENS, MIN_TOKENS]),
                 "b": StandIn(tmp_path, [MIN_TOKENS * 2, 0])}
    swaps_, _, _ = swaps_for(tmp_path, model, stand_ins)
    assert await swaps_.save(model, [child("a"), child("b")]) == 3
    assert (await swaps_.restore(model, [child("a"), child("b")])).count == 3
    assert sorted(s for s, _ in stand_ins["a"].restored) == [0, 1]
    assert [s for s, _ in stand_ins["b"].restored] == [0]
    # One replica now: the second one's state has nowhere to go, and is not forced anywhere.
    stand_ins["a"].restored.clear()
    assert (await swaps_.restore(model, [child("a")])).count == 2


async def test_a_save_that_hangs_is_cut_by_its_bound_and_leaves_no_file(
        tmp_path: Path, model: ModelPreset, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warm, "SAVE_BOUND_S", 0.2)
    stand_in = StandIn(tmp_path, [MIN_TOKENS])
    swaps_, store, directory = swaps_for(tmp_path, model, {"a": stand_in})
    stand_in.hang = "save"
    async with asyncio.timeout(GUARD_S):
        assert await swaps_.save(model, [child("a")]) == 0
    assert not list(directory.iterdir()) and store.usage() == {}


async def test_a_restore_that_hangs_or_is_refused_serves_without_it(
        tmp_path: Path, model: ModelPreset, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warm, "RESTORE_BOUND_S", 0.2)
    stand_in = StandIn(tmp_path, [MIN_TOKENS])
    swaps_, store, _ = swaps_for(tmp_path, model, {"a": stand_in})
    assert await swaps_.save(model, [child("a")]) == 1
    stand_in.hang = "restore"
    async with asyncio.timeout(GUARD_S):
        assert (await swaps_.restore(model, [child("a")])).count == 0
    assert store.usage() == {"m": (1, MIN_TOKENS * 8)}  # kept: the child never answered
    stand_in.hang, stand_in.refuse_restore = None, True
    assert (await swaps_.restore(model, [child("a")])).count == 0
    assert store.usage() == {}  # refused: discarded, never offered again


def held_commits(store: StateStore, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every commit of ``store`` waits (in its thread) until the event returned is set."""
    release = threading.Event()
    commit = store.commit

    def held(*args: Any) -> Any:
        assert release.wait(GUARD_S)
        return commit(*args)

    monkeypatch.setattr(store, "commit", held)
    return release


async def test_a_load_waits_for_the_state_its_last_stop_is_keeping(
        tmp_path: Path, model: ModelPreset, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = StandIn(tmp_path, [MIN_TOKENS])
    swaps_, store, _ = swaps_for(tmp_path, model, {"a": stand_in})
    release = held_commits(store, monkeypatch)
    swaps_.keep_soon(model, await swaps_.write(model, [child("a")]))  # a stop goes on
    restorable = asyncio.create_task(swaps_.restorable(model))  # the next load starts
    await asyncio.sleep(0.05)
    assert not restorable.done()  # it waits for the commit, not for a clock
    release.set()
    async with asyncio.timeout(GUARD_S):
        states = await restorable
    assert [s.n_saved for s in states] == [MIN_TOKENS]
    assert (await swaps_.restore(model, [child("a")], restorable)).count == 1


async def test_the_routers_stop_waits_for_every_commit(
        tmp_path: Path, model: ModelPreset, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = StandIn(tmp_path, [MIN_TOKENS, MIN_TOKENS * 2])
    swaps_, store, _ = swaps_for(tmp_path, model, {"a": stand_in})
    release = held_commits(store, monkeypatch)
    swaps_.keep_soon(model, await swaps_.write(model, [child("a")]))
    settled = asyncio.create_task(swaps_.settle())
    await asyncio.sleep(0.05)
    assert not settled.done() and store.usage() == {}
    settled.cancel()  # a waiter that gives up never cancels the commit
    release.set()
    async with asyncio.timeout(GUARD_S):
        await swaps_.settle()
    assert store.usage() == {"m": (2, MIN_TOKENS * 3 * 8)}


async def test_a_commit_that_stalls_holds_neither_a_load_nor_the_routers_stop(
        tmp_path: Path, model: ModelPreset, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stalled disk: the next load waits for the commit within ``RESTORE_BOUND_S`` and
    serves without the state; the router's stop waits ``COMMIT_BOUND_S`` and goes on."""
    monkeypatch.setattr(warm, "RESTORE_BOUND_S", 0.2)
    monkeypatch.setattr(warm, "COMMIT_BOUND_S", 0.2)
    stand_in = StandIn(tmp_path, [MIN_TOKENS])
    swaps_, store, _ = swaps_for(tmp_path, model, {"a": stand_in})
    release = held_commits(store, monkeypatch)
    swaps_.keep_soon(model, await swaps_.write(model, [child("a")]))
    async with asyncio.timeout(GUARD_S):
        assert (await swaps_.restore(model, [child("a")])).count == 0
        await swaps_.settle()  # the router's stop: bounded
    assert swaps_.ledger.counts["m"].slow_restores == 1 and not stand_in.restored
    release.set()
    async with asyncio.timeout(GUARD_S):
        await swaps_._keeping.settle()
    assert store.usage() == {"m": (1, MIN_TOKENS * 8)}  # kept once the disk came back


async def test_a_model_removed_while_its_states_are_kept_takes_them_along(
        tmp_path: Path, model: ModelPreset, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = StandIn(tmp_path, [MIN_TOKENS])
    swaps_, store, _ = swaps_for(tmp_path, model, {"a": stand_in})
    release = held_commits(store, monkeypatch)
    swaps_.keep_soon(model, await swaps_.write(model, [child("a")]))
    swaps_.forget("m")
    release.set()
    async with asyncio.timeout(GUARD_S):
        await swaps_.settle()
    assert store.usage() == {} and not (store.root / model_dir_name("m")).exists()


async def test_a_state_directory_that_cannot_be_read_means_a_cold_load(
        tmp_path: Path, model: ModelPreset, monkeypatch: pytest.MonkeyPatch) -> None:
    stand_in = StandIn(tmp_path, [MIN_TOKENS])
    swaps_, store, _ = swaps_for(tmp_path, model, {"a": stand_in})
    assert await swaps_.save(model, [child("a")]) == 1

    def unreadable(model_id: str, fingerprint: str) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(store, "states", unreadable)
    assert await swaps_.restorable(model) == []
    assert (await swaps_.restore(model, [child("a")])).count == 0 and not stand_in.restored


async def test_a_save_whose_answer_does_not_match_its_file_is_not_kept(
        tmp_path: Path, model: ModelPreset) -> None:
    stand_in = StandIn(tmp_path, [MIN_TOKENS])
    swaps_, store, directory = swaps_for(tmp_path, model, {"a": stand_in})
    original = stand_in.handle

    async def lying(request: httpx.Request) -> httpx.Response:
        response = await original(request)
        if request.url.params.get("action") == "save":
            body = json.loads(response.content)
            return httpx.Response(200, json={**body, "n_written": body["n_written"] + 1})
        return response

    stand_in.handle = lying  # type: ignore[method-assign]
    assert await swaps_.save(model, [child("a")]) == 0
    assert store.usage() == {} and not list(directory.iterdir())


@pytest.mark.parametrize("preset", [
    ModelPreset("remote", MappingProxyType({}), upstream="http://elsewhere:8080"),
    ModelPreset("own", MappingProxyType({"model": "/m.gguf", "slot-save-path": "/x"})),
    ModelPreset("missing", MappingProxyType({"model": "/no/such/file.gguf"})),
], ids=["remote upstream", "its own slot-save-path", "model file missing"])
async def test_models_without_warm_swaps(tmp_path: Path, preset: ModelPreset) -> None:
    swaps_, _ = swaps(tmp_path, {})
    assert swaps_.slot_dir(preset) is None
    assert await swaps_.save(preset, [child("a")]) == 0
    assert (await swaps_.restore(preset, [child("a")])).count == 0


async def test_a_model_with_warm_swaps_turned_off_keeps_nothing(
        tmp_path: Path, model: ModelPreset) -> None:
    """``warm-swaps = false``: no slot directory for its children, no save, no restore, and
    what it saved while on is removed (its conversations must not stay on disk)."""
    stand_in = StandIn(tmp_path, [MIN_TOKENS])
    swaps_, store, _ = swaps_for(tmp_path, model, {"a": stand_in})
    assert await swaps_.save(model, [child("a")]) == 1
    off = replace(model, warm_swaps=False)
    assert not WarmSwaps.covers(off) and swaps_.slot_dir(off) is None
    assert store.usage() == {} and not (store.root / model_dir_name("m")).exists()
    assert await swaps_.save(off, [child("a")]) == 0 and store.usage() == {}
    assert (await swaps_.restore(off, [child("a")])).count == 0 and not stand_in.restored
    assert [r.url.path for r in stand_in.requests].count("/slots") == 1  # the save while on


async def test_warm_swaps_turned_off_during_a_stop_keep_nothing_it_wrote(
        tmp_path: Path, model: ModelPreset) -> None:
    """A reload turns warm swaps off while a stop's children are writing their slots: what
    they wrote is not kept (a churn run left such files behind)."""
    stand_in = StandIn(tmp_path, [MIN_TOKENS])
    swaps_, store, directory = swaps_for(tmp_path, model, {"a": stand_in})
    written = await swaps_.write(model, [child("a")])
    assert written and any(directory.iterdir())
    swaps_.fingerprint_of(replace(model, warm_swaps=False))  # the reload's new preset
    assert await swaps_.keep(model, written) == 0
    assert store.usage() == {} and not (store.root / model_dir_name("m")).exists()


def test_a_changed_model_file_changes_the_directory(tmp_path: Path,
                                                    model: ModelPreset) -> None:
    swaps_, _ = swaps(tmp_path, {})
    known(swaps_, model)
    before = swaps_.slot_dir(model)
    assert before is not None
    path = Path(model.args["model"])
    info = path.stat()
    path.write_bytes(b"GGUF" + bytes(59) + b"\1")  # other weights: same size, same mtime
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert swaps_.slot_dir(model) is None  # this version's content is not known yet
    known(swaps_, model)
    replaced = swaps_.slot_dir(model)
    assert replaced not in (None, before)
    path.chmod(0o600)  # a new ctime, the same content: the same directory
    known(swaps_, model)
    assert swaps_.slot_dir(model) == replaced
    other_ctx = ModelPreset("m", MappingProxyType({**model.args, "ctx-size": "8192"}))
    assert swaps_.slot_dir(other_ctx) not in (before, replaced)


def test_every_weight_file_counts_by_content(tmp_path: Path, model: ModelPreset) -> None:
    """Shards, the projector, LoRA adapters and control vectors, in every spelling."""
    for name in ("big-00001-of-00003.gguf", "big-00002-of-00003.gguf",
                 "big-00003-of-00003.gguf", "mm.gguf", "a.gguf", "b.gguf", "cv.gguf"):
        (tmp_path / name).write_bytes(b"GGUF" + name.encode())
    preset = ModelPreset("big", MappingProxyType({
        "model": str(tmp_path / "big-00001-of-00003.gguf"), "mmproj": str(tmp_path / "mm.gguf"),
        "lora": f"{tmp_path / 'a.gguf'}", "lora-scaled": f"{tmp_path / 'b.gguf'}:0.5",
        "control-vector-scaled": f"{tmp_path / 'cv.gguf'}:0.8"}))
    files = weight_files(preset)
    assert [f.name for f in files] == [
        "big-00001-of-00003.gguf", "big-00002-of-00003.gguf", "big-00003-of-00003.gguf",
        "mm.gguf", "a.gguf", "b.gguf", "cv.gguf"]
    swaps_, _ = swaps(tmp_path, {})
    known(swaps_, preset)
    before = swaps_.slot_dir(preset)
    for changed in files[1:]:
        info = changed.stat()
        changed.write_bytes(changed.read_bytes()[:-1] + b"!")  # same size
        os.utime(changed, ns=(info.st_atime_ns, info.st_mtime_ns))
        known(swaps_, preset)
        after = swaps_.slot_dir(preset)
        assert after not in (None, before), changed.name
        before = after


async def test_a_load_digests_its_files_once_and_a_restart_keeps_them(
        tmp_path: Path, model: ModelPreset) -> None:
    swaps_, store = swaps(tmp_path, {})
    await swaps_.prepare(model)
    directory = swaps_.slot_dir(model)
    assert directory is not None
    restarted = WarmSwaps(store, "b11434", httpx.AsyncClient())
    assert restarted.slot_dir(model) == directory  # no digest computed again
    (store.root / "digests.json").write_text("[not json")  # a damaged table: read again
    assert WarmSwaps(store, "b11434", httpx.AsyncClient()).slot_dir(model) is None


# ------------------------------------------------------------- a client's slot files

@pytest.fixture
async def app(tmp_path: Path, help_table: FlagTable) -> AsyncIterator[tuple[Starlette, list[str]]]:
    """The app over one model with --state-dir (never started); yields it and the models
    acquired."""
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    presets = tmp_path / "models.ini"
    presets.write_text(f"version = 1\n[m]\nmodel = {tmp_path / 'm.gguf'}\n")
    config = Settings(presets=[presets], llama_server=tmp_path / "never-started", webui=False,
                      state_dir=tmp_path / "states")
    catalogue = build_catalogue([presets], [], help_table, [])
    application = build_app(Prepared(config, tmp_path / "never-started", help_table, [],
                                     catalogue, [], "test"))
    acquired: list[str] = []
    async with application.router.lifespan_context(application):
        state: State = application.state.router

        async def acquire(model: ModelView, **kw: Any) -> Any:
            acquired.append(model.id)
            raise Unavailable("recorded, not served")

        state.models.acquire = acquire  # type: ignore[method-assign]
        yield application, acquired


@pytest.mark.parametrize("target", [
    "/slots/0?action=save", "/slots/0?action=restore", "/slots/0?action=SAVE",
    "/slots/0?action=erase&action=restore", "/slots/0?action=save&action=erase",
    "/slots/0?%61ction=save", "/slots/0?action=%72estore", "/slots/0?action=save%20",
    "/slots/-1?action=save", "/%73lots/0?action=save"])
async def test_a_client_cannot_name_a_slot_file(app: tuple[Starlette, list[str]],
                                                target: str) -> None:
    application, acquired = app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application),
                                 base_url="http://router") as client:
        response = await client.post(target + "&model=m", json={"filename": "../../etc/x"})
    assert response.status_code == 403, response.text
    assert "slot files are the router's own" in response.json()["error"]["message"]
    assert acquired == []  # refused before any model was asked for


@pytest.mark.parametrize("target", ["/slots/0?action=erase", "/slots?model=m"])
async def test_what_writes_no_file_still_goes_to_the_child(
        app: tuple[Starlette, list[str]], target: str) -> None:
    application, acquired = app
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=application),
                                 base_url="http://router") as client:
        if "?model" in target:
            response = await client.get(target)
        else:
            response = await client.post(target + "&model=m", json={})
    assert response.status_code == 503, response.text  # the recording stand-in's answer
    assert acquired == ["m"]


# ------------------------------------------------------- a child killed during its save

@pytest.mark.fake
def test_a_child_killed_during_its_save_leaves_nothing_behind(tmp_path: Path) -> None:
    """The child dies halfway through writing its slot file (tests/fake_llama_server.py
    ``--die-on-slot-save``): the swap goes on, the half-written file is removed, and the model
    loads again as usual."""
    states = tmp_path / "states"
    for name in ("alpha", "beta"):
        (tmp_path / f"{name}.gguf").write_bytes(b"GGUF")
    presets = write_presets(tmp_path / "models.ini", "[*]\nparallel = 1\n" + "".join(
        f"[{name}]\nmodel = {tmp_path / name}.gguf\n" for name in ("alpha", "beta")))
    chat = {"messages": [{"role": "user", "content": "x" * 200}], "max_tokens": 4}
    with start_router(tmp_path, "--presets", str(presets), "--llama-server",
                      str(fake_binary(tmp_path, "--die-on-slot-save")), "--models-max", "1",
                      "--state-dir", str(states)) as router, router.client() as client:
        for model in ("alpha", "beta", "alpha"):
            response = client.post("/v1/chat/completions", json={"model": model, **chat})
            assert response.status_code == 200, (model, response.text)
        log = router.log()
    assert sorted(p for p in states.rglob("*") if p.is_file()) == sorted(
        [states / LOCK_NAME, states / "digests.json", states / USAGE_FILE])  # no state, no temp
    assert "simulated crash (during a slot save)" in log
    assert "Traceback" not in log
