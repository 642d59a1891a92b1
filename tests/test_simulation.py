"""The scheduling core under deterministic simulation (``simulation.py``): the real supervisor,
admission, planner, loader, executor, lifecycle, leases and liveness on virtual time against
fake children, checked for the scheduler's promises (docs/scheduling.md) after every step.

``LLAMA_ROUTER_SIM_SCHEDULES`` (default 2,000) sets how many random schedules the sweep plays,
``LLAMA_ROUTER_SIM_SEED`` the first seed; ``make simulate`` plays many more. A failing seed is
printed with what it broke and the end of its trace, and reproduces exactly.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
from simulation import Config, FakeChild, FakeSpawner, Simulation, describe, run_schedule

from router.core import accounting
from router.core.lifecycle import NobodyWaits, Status

SCHEDULES = int(os.environ.get("LLAMA_ROUTER_SIM_SCHEDULES", "2000"))
FIRST_SEED = int(os.environ.get("LLAMA_ROUTER_SIM_SEED", "0"))

# The schedule in which the sweep first found the swap wedge: with --models-max 1, a model
# drained for another's load while a request for it waited stayed loaded and draining with
# nothing in flight, nothing loading and nothing stopping.
WEDGE_SEED = 32
# The schedule in which the long mode found a child left running after shutdown: a replica
# replacement still starting was cancelled by the last replica's crash, and the router's stop
# did not wait for the cancelled task to stop the child it had started.
ORPHAN_SEED = 5026783
# The schedule in which shutting down with the traffic still running left a child behind: a
# request still waiting when the router closed started a new load after the close had
# cancelled the old one.
SHUTDOWN_ORPHAN_SEED = 275
# The schedule in which a load cancelled as a change was notified went on planning admission
# for ever (asyncio.wait_for on Python 3.11 swallowed the cancel) and the shutdown waited for it.
SWALLOWED_CANCEL_SEED = 978
# The schedule in which a replica's replacement, cancelled while stopping the child whose start
# failed, went on to report the failure after its model had unloaded.
REPLACEMENT_CANCEL_SEED = 3013787


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    """Thousands of schedules log every load and stop; only the violations matter here."""
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def scenario_config(**changes: Any) -> Config:
    base: dict[str, Any] = dict(
        models=("a", "b"), models_max=1, memory_budget=None, sizes={"a": 1, "b": 1},
        replicas={"a": 1, "b": 1}, fairness=10.0, wait_budget=60.0, stop_timeout=10.0,
        load_timeout=30.0, liveness=False, ttl=0.0)
    return Config(**{**base, **changes})


def play(config: Config, script: list[tuple[float, str, dict[str, Any]]],
         seed: int = 0) -> Simulation:
    sim = Simulation(seed, config=config, script=script, spawn_failure=0.0, spawn_hang=0.0)
    run_virtually(sim.run())
    sim.check_events()
    return sim


def run_virtually(scenario: Coroutine[Any, Any, Any]) -> None:
    """Run ``scenario`` to its end on the simulation's virtual-time loop, then close it."""
    from simloop import VirtualTimeLoop

    loop = VirtualTimeLoop()
    try:
        loop.run_until_complete(scenario)
    finally:
        loop.close()


def by_id(sim: Simulation, n: int) -> Any:
    return next(r for r in sim.requests if r.id == n)


def test_the_seed_that_found_the_swap_wedge() -> None:
    sim = run_schedule(WEDGE_SEED)
    assert not sim.violations, describe(sim)


def test_the_seed_that_found_an_orphan_at_shutdown() -> None:
    sim = run_schedule(ORPHAN_SEED)
    assert not sim.violations, describe(sim)


def test_the_seed_that_found_a_load_started_during_shutdown() -> None:
    sim = run_schedule(SHUTDOWN_ORPHAN_SEED)
    assert sim.shutdown_live and not sim.violations, describe(sim)


def test_the_seed_that_found_a_swallowed_cancel() -> None:
    sim = run_schedule(SWALLOWED_CANCEL_SEED)
    assert not sim.violations, describe(sim)


def test_the_seed_that_found_a_replacement_outliving_its_cancel() -> None:
    sim = run_schedule(REPLACEMENT_CANCEL_SEED)
    assert not sim.violations, describe(sim)


def test_swap_while_busy_answers_both_waiters() -> None:
    """A long request keeps `a` busy; a request for `b` drains `a` after the fairness bound; a
    short request for `a` arrives while it drains. Once the long request ends, `a` stops, `b`
    loads and answers, then `a` loads again and answers: nothing is left draining."""
    sim = play(scenario_config(), [
        (0.0, "request", {"model": "a", "duration": 32.0}),
        (5.0, "request", {"model": "b"}),
        (20.0, "request", {"model": "a"}),
    ])
    assert not sim.violations, describe(sim)
    long, swap, short = by_id(sim, 0), by_id(sim, 1), by_id(sim, 2)
    assert [long.outcome, swap.outcome, short.outcome] == ["ok", "ok", "ok"], describe(sim)
    load_s = 3.0  # the slowest fake start
    assert swap.leased_at <= long.ended + load_s + 1.0, describe(sim)
    assert short.leased_at <= long.ended + 2 * load_s + 1.0, describe(sim)


FAKE_PID = 999_999_999  # no process's: nothing reads it but the device check


@pytest.mark.parametrize("may_hold_gpu", [False, True])
def test_a_swap_starts_the_next_child_as_the_evicted_one_exits_unless_it_may_hold_gpu_memory(
        monkeypatch: pytest.MonkeyPatch, may_hold_gpu: bool) -> None:
    """Under ``--models-max 1`` the next model's child is spawned while the evicted one
    stops, when the evicted child holds no GPU device (its pid's descriptors, read through
    the stopping replicas admission plans over); one that may hold GPU memory is waited for
    until it has exited."""
    monkeypatch.setattr(FakeChild, "pid", FAKE_PID)  # every fake child: one pid
    monkeypatch.setattr(accounting, "holds_gpu_device",
                        lambda pid: may_hold_gpu if pid == FAKE_PID else None)
    others_at_spawn: list[dict[str, Status]] = []
    spawn_ready = FakeSpawner.spawn_ready

    async def recording(self: FakeSpawner, runtime: Any, *args: Any) -> None:
        others_at_spawn.append({m.id: m.status for m in self.sim.sup.models.values()
                                if m.id != runtime.id})
        await spawn_ready(self, runtime, *args)

    monkeypatch.setattr(FakeSpawner, "spawn_ready", recording)
    sim = play(scenario_config(), [(0.0, "request", {"model": "a"}),
                                   (5.0, "request", {"model": "b"})])
    assert not sim.violations, describe(sim)
    assert [by_id(sim, 0).outcome, by_id(sim, 1).outcome] == ["ok", "ok"], describe(sim)
    assert others_at_spawn[-1] == {"a": Status.UNLOADED if may_hold_gpu else Status.STOPPING}


def test_random_schedules_keep_every_invariant() -> None:
    failures = []
    for seed in range(FIRST_SEED, FIRST_SEED + SCHEDULES):
        sim = run_schedule(seed)
        if sim.violations:
            failures.append(sim)
            if len(failures) >= 3:
                break
    assert not failures, (f"{len(failures)} failing schedules (first seeds shown; rerun one "
                          f"with LLAMA_ROUTER_SIM_SEED=N LLAMA_ROUTER_SIM_SCHEDULES=1):\n\n"
                          + "\n\n".join(describe(s) for s in failures))


def test_teams_flooding_their_models_keep_fair_share_and_their_quotas() -> None:
    """Three teams flood one or two models of one or two slots a child (one team sending
    three times as much), in the three classes, with quotas on two of them, crashes, unloads
    and reconfigurations: every invariant holds, VTC's bound between backlogged flows and no
    starvation inside a class among them (``simteams``); the quotas refused requests and the
    queues built (else the schedules would test nothing)."""
    failures, refused, queued = [], 0, 0
    for seed in range(FIRST_SEED, FIRST_SEED + max(SCHEDULES // 100, 12)):
        sim = run_schedule(seed, traffic="teams")
        refused += sum(r.outcome.startswith("429") for r in sim.requests)
        queued += sim.teams.contended
        if sim.violations:
            failures.append(sim)
            if len(failures) >= 3:
                break
    assert not failures, "\n\n".join(describe(s) for s in failures)
    assert refused and queued, (refused, queued)


def test_saves_that_hang_never_wedge_a_swap() -> None:
    """Warm swaps on a stalled disk, every slot save and every commit hanging: each stop that
    saves is held by the save's bound only (``warm.SAVE_BOUND_S``), each load that waits for
    its model's commit by the restore's (``RESTORE_BOUND_S``), and every invariant holds (no
    wedge, every request answered within its budget, nothing left running)."""
    hung = stalled = cut = 0
    failures = []
    for seed in range(FIRST_SEED, FIRST_SEED + max(SCHEDULES // 4, 10)):
        sim = run_schedule(seed, saves="hang")
        assert sim.warm is not None
        hung += sim.warm.hung
        stalled += sim.warm.stalled
        cut += sum(counts.slow_restores for counts in sim.warm.ledger.counts.values())
        if sim.violations:
            failures.append(sim)
            if len(failures) >= 3:
                break
    assert not failures, "\n\n".join(describe(s) for s in failures)
    assert hung > 0 and stalled > 0  # saves did hang: evictions, unloads or idle TTLs happened
    assert cut > 0  # and a model loaded again while its commit stalled: the bound ended it


def test_a_load_cancelled_before_it_ran_is_no_longer_pending() -> None:
    """A load task cancelled before its first step never runs its body; the lifecycle still
    learns it ended (``LoadEnded``), so the next request starts a new load instead of
    awaiting the cancelled one for ever."""
    sim = Simulation(0, config=scenario_config(), script=[])

    async def scenario() -> None:
        sup = sim.build()
        runtime = sup.models["a"]
        first = sup.wait.load_task(runtime, on_demand=True)
        assert runtime.state.load_pending and runtime.state.load_on_demand
        sup.executor.apply(runtime, NobodyWaits())  # cancelled before its first step
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert first.cancelled() and not runtime.state.load_pending
        second = sup.wait.load_task(runtime, on_demand=False)
        assert second is not first and runtime.state.load_pending
        await second
        assert runtime.serving and not runtime.state.load_pending
        await sup.close()

    run_virtually(scenario())


def test_a_removed_model_leaves_nothing_in_any_table() -> None:
    """Removal through one signal: a model that used every part keeping something per model
    (its cached command line, its slot queue, its conversations' index, warm swaps' ledger,
    the CPU gate) leaves none of it once removed: each part drops it on the one signal the
    lifecycle's ``Forgotten`` publishes (``events.MODEL_REMOVED``), no part told by another."""
    from simulation import HangingSaves

    from router.serving.affinity import Prefix
    from router.teams.fairshare import Turn
    from router.warm.swaps import WarmSwaps

    class Forgetting(HangingSaves):  # its saves hang; its forget is the real one
        def forget(self, model_id: str) -> None:
            WarmSwaps.forget(self, model_id)

    sim = Simulation(0, config=scenario_config(), script=[], saves="none")
    sim.warm = Forgetting()

    async def scenario() -> None:
        sup = sim.build()
        core, runtime = sup.core, sup.models["a"]
        conversations = core.leases.conversations
        assert conversations is not None and core.warm is sim.warm
        await sup.wait.load_task(runtime, on_demand=False)
        # its /models listing caches its command line (the simulation's table has no flags)
        core.spawner._argv_cache["a"] = (runtime.preset, None, ["llama-server"])
        lease = await sup.acquire(sup.find("a"), turn=Turn("team", 1, 100.0))
        await sup.place(lease, Prefix((1, 2), (600, 1200)), b"sk-key")
        sim.warm.ledger.counts_of("a").hits += 1
        queued = core.wait.slots.queue(runtime)  # (a queue made for it, as a waiter's)

        def kept() -> dict[str, bool]:
            return {"argv": "a" in core.spawner._argv_cache,
                    "slot queue": "a" in core.wait.slots._queues,
                    "conversations": "a" in conversations._index,
                    "ledger": "a" in sim.warm.ledger.counts,
                    "cpu gate": "a" in core.cpu_gate._busy}

        assert all(kept().values()), kept()
        lease.release()
        assert queued is not None
        stop = core.executor.stop(runtime, "removed")
        assert stop is not None
        await stop
        sup.remove_model("a")
        assert not any(kept().values()), kept()
        assert "a" not in sup.models
        await sup.close()

    run_virtually(scenario())


def loaded_times(sim: Simulation, model: str) -> list[float]:
    """When ``model`` became loaded, each time (its published events)."""
    return [at for at, m, kind, data in sim.events.log
            if m == model and kind == "status_change" and data.get("status") == "loaded"
            and "duration" in data]


def stop_reasons(sim: Simulation, model: str) -> list[str]:
    return [data["reason"] for at, m, kind, data in sim.events.log
            if m == model and kind == "stopping"]


def test_pins_filling_models_max_refuse_the_others_at_once() -> None:
    """``pin = true`` on `a`, ``--models-max 1``: while `a` is loaded (busy, then idle), a
    request for `b` is answered at once with the 503 naming the pin, well within its wait
    budget, and `a` stays loaded; an explicit unload of `a` still works, and `b` then loads."""
    sim = play(scenario_config(pinned=frozenset({"a"})), [
        (0.0, "request", {"model": "a", "duration": 20.0}),
        (5.0, "request", {"model": "b"}),
        (25.0, "request", {"model": "b"}),
        (30.0, "unload", {"model": "a"}),
        (31.0, "request", {"model": "b"}),
    ])
    assert not sim.violations, describe(sim)
    a, busy_b, idle_b, after = (by_id(sim, n) for n in (0, 1, 2, 4))
    assert a.outcome == "ok" and after.outcome == "ok", describe(sim)
    for refused in (busy_b, idle_b):
        assert refused.outcome == "503 LoadFailed", describe(sim)
        assert refused.ended - refused.started < 0.1, describe(sim)
    assert stop_reasons(sim, "a") == ["unloaded"], describe(sim)
    assert len(loaded_times(sim, "a")) == 1 and len(loaded_times(sim, "b")) == 1


def test_pins_refusal_names_them_and_the_way_out() -> None:
    sim = Simulation(0, config=scenario_config(pinned=frozenset({"a"})), script=[])

    async def scenario() -> None:
        from router.errors import LoadFailed

        sup = sim.build()
        await sup.wait.load_task(sup.models["a"], on_demand=False)
        with pytest.raises(LoadFailed) as refused:
            await sup.acquire(sup.find("b"))
        assert refused.value.message == (
            "cannot load 'b': --models-max 1 is held by pinned models: a (pin = true); "
            "unload one with POST /models/unload or raise --models-max")
        assert sup.models["a"].serving and not sup.admission.queue
        await sup.close()

    run_virtually(scenario())


def test_min_resident_stops_two_models_thrashing() -> None:
    """``--models-max 1``, ``min-resident = 5`` on both, requests alternating A, B, A, B: the
    request for B waits while A is within its time and loads the moment it is over (the
    admission queue's head plans again then, not at the fairness bound, 30 s away); the
    second request for A, sent while A is still loaded, is served by it: one load each."""
    sim = play(scenario_config(fairness=30.0, min_resident={"a": 5.0, "b": 5.0}), [
        (0.0, "request", {"model": "a"}),
        (0.5, "request", {"model": "b"}),
        (1.0, "request", {"model": "a"}),
        (1.5, "request", {"model": "b"}),
    ])
    assert not sim.violations, describe(sim)
    assert [by_id(sim, n).outcome for n in range(4)] == ["ok"] * 4, describe(sim)
    [a_loaded] = loaded_times(sim, "a")
    [b_loaded] = loaded_times(sim, "b")
    load_s = 3.0  # the slowest fake start
    assert a_loaded + 5.0 <= b_loaded <= a_loaded + 5.0 + load_s + 0.1, describe(sim)
    assert by_id(sim, 2).leased_at < a_loaded + 5.0, describe(sim)  # A served, not swapped
    assert stop_reasons(sim, "a") == ["evicted"], describe(sim)


def test_min_resident_shorter_budget_gets_the_budget_503() -> None:
    """A request whose wait budget ends before the model in the way may be evicted gets
    the usual 503 at its budget; the residency is kept."""
    sim = play(scenario_config(min_resident={"a": 30.0}), [
        (0.0, "request", {"model": "a"}),
        (4.0, "request", {"model": "b", "budget": 2.0}),
    ])
    assert not sim.violations, describe(sim)
    late = by_id(sim, 1)
    assert late.outcome == "503 WaitBudgetExceeded", describe(sim)
    assert 2.0 <= late.ended - late.started <= 2.5, describe(sim)
