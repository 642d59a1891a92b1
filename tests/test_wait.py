"""A request's whole wait for its model (``wait.ModelWait.acquire``), on the real core.

The supervisor, its lifecycle and admission run on virtual time against fake children
(``simulation``); every test makes the very call the proxy makes (``Supervisor.acquire`` with
``wait.Ends``) and checks what ends the wait, what it answers, and that the record's
``waiting`` count returns to 0 whichever way it ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from simloop import VirtualTimeLoop
from simulation import Simulation
from test_simulation import scenario_config

from router import clock
from router.core.lifecycle import Status
from router.core.supervisor import Supervisor
from router.core.wait import Ends
from router.errors import ClientGone, ModelNotFound, ShuttingDown, WaitBudgetExceeded

LOAD_TIMEOUT_S = 30.0  # the scenario's; a child that never becomes healthy takes this long


def run(scenario: Callable[[Supervisor], Awaitable[None]], *, never_healthy: bool) -> None:
    """Run ``scenario`` on a fresh core; its children all start in 0.1 to 3 s, or never."""
    sim = Simulation(0, config=scenario_config(load_timeout=LOAD_TIMEOUT_S), script=[],
                     spawn_failure=0.0, spawn_hang=1.0 if never_healthy else 0.0)

    async def main() -> None:
        sup = sim.build()
        try:
            await scenario(sup)
        finally:
            await sup.close()

    loop = VirtualTimeLoop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def event_end(event: asyncio.Event) -> Callable[[], Awaitable[Any]]:
    return event.wait


async def started_waiting(sup: Supervisor, model: str, count: int = 1) -> None:
    """Until ``count`` requests wait for ``model`` (each starts or joins its load, which
    notifies ``changes``)."""
    while sup.models[model].waiting < count:
        await sup.changes.wait()


def test_a_serving_model_gives_a_lease_with_no_task() -> None:
    async def scenario(sup: Supervisor) -> None:
        lease = await sup.acquire(sup.find("a"))  # loads it
        lease.release()
        tasks = len(asyncio.all_tasks())
        called = []
        lease = await sup.acquire(sup.find("a"),
                                  ends=Ends(lambda: called.append(1) or asyncio.sleep(1)))
        assert len(asyncio.all_tasks()) == tasks and not called  # no watcher made
        lease.release()

    run(scenario, never_healthy=False)


def test_a_handle_reads_the_published_snapshot_and_leases_without_a_name() -> None:
    """``find`` gives a view of the model as its owner last published it: a snapshot that
    never changes (a new one is published after each change), but for the leases' counters,
    shared live. The lease is taken by that handle; once the model is gone, the handle gets
    the 404 and never another model."""
    async def scenario(sup: Supervisor) -> None:
        handle = sup.find("a")
        before = handle.snapshot
        assert handle.status is Status.UNLOADED and sup.view("a") is not None
        lease = await sup.acquire(handle)  # loads it: published again at each change
        now = sup.find("a")
        assert before.status is Status.UNLOADED and before.state is not now.snapshot.state
        assert now.status is Status.LOADED and now.serving
        assert (before.in_flight, now.in_flight) == (1, 1)  # the live counters, shared
        again = sup.lease_now(handle)  # the old handle still reaches the model's record
        assert again is not None and now.in_flight == 2
        again.release()
        lease.release()
        await sup.unload(now)
        sup.remove_model("a")
        assert sup.view("a") is None and "a" not in sup.model_set.published
        with pytest.raises(ModelNotFound):
            sup.lease_now(handle)
        with pytest.raises(ModelNotFound):
            await sup.acquire(handle)

    run(scenario, never_healthy=False)


def test_a_model_added_again_under_its_id_starts_from_nothing() -> None:
    """Removing a model is one step (``Executor.forget``): its record, its snapshot and what
    other parts kept of it go; the model added again under the same id inherits nothing."""
    async def scenario(sup: Supervisor) -> None:
        handle = sup.find("a")
        preset = handle.preset
        lease = await sup.acquire(handle)
        lease.release()
        old = sup.models["a"]
        assert old.load.used_at > 0 and old.last_load_s is not None
        await sup.unload(sup.find("a"))
        sup.remove_model("a")
        assert "a" not in sup.models and "a" not in sup.model_set.published
        again = sup.add_model(preset)
        record = sup.models["a"]
        assert record is not old and again.snapshot.load is record.load
        assert (record.load.used_at, record.last_load_s, record.waiting) == (0.0, None, 0)
        assert again.status is Status.UNLOADED and again.snapshot.last_load_s is None

    run(scenario, never_healthy=False)


def test_a_client_that_leaves_ends_its_wait_at_once() -> None:
    async def scenario(sup: Supervisor) -> None:
        gone = asyncio.Event()
        wait = asyncio.ensure_future(sup.acquire(sup.find("a"), ends=Ends(event_end(gone))))
        await started_waiting(sup, "a")
        left_at = clock.now()
        gone.set()
        with pytest.raises(ClientGone):
            await wait
        assert clock.now() == left_at  # no later than the disconnect
        assert sup.models["a"].waiting == 0

    run(scenario, never_healthy=True)


def test_the_end_of_the_shutdown_grace_ends_the_wait_with_its_answer() -> None:
    async def scenario(sup: Supervisor) -> None:
        over = asyncio.Event()
        error = ShuttingDown("grace over", headers={"Retry-After": "5"})
        wait = asyncio.ensure_future(sup.acquire(
            sup.find("a"), ends=Ends(event_end(asyncio.Event()), over, lambda: error)))
        await started_waiting(sup, "a")
        over.set()
        with pytest.raises(ShuttingDown) as raised:
            await wait
        assert raised.value is error and sup.models["a"].waiting == 0

    run(scenario, never_healthy=True)


def test_the_budget_ends_the_wait_with_a_503_naming_the_model() -> None:
    async def scenario(sup: Supervisor) -> None:
        started = clock.now()
        with pytest.raises(WaitBudgetExceeded) as raised:
            await sup.acquire(sup.find("a"), budget=2.5,
                              ends=Ends(event_end(asyncio.Event())))
        assert clock.now() - started == pytest.approx(2.5)
        assert "'a'" in raised.value.message and "2.5 s" in raised.value.message
        assert raised.value.headers["Retry-After"] == "5"
        assert sup.models["a"].waiting == 0

    run(scenario, never_healthy=True)


def test_a_client_gone_as_its_model_becomes_ready_takes_no_lease() -> None:
    """The load ends and the client leaves in the same loop step: the client's end wins, and
    no lease is left held for nobody."""
    async def scenario(sup: Supervisor) -> None:
        gone = asyncio.Event()
        wait = asyncio.ensure_future(sup.acquire(sup.find("a"), ends=Ends(event_end(gone))))
        await started_waiting(sup, "a")
        load = sup.models["a"].load_task
        assert load is not None
        load.add_done_callback(lambda _: gone.set())  # in the step the load ends
        with pytest.raises(ClientGone):
            await wait
        assert sup.models["a"].serving and sup.models["a"].in_flight == 0

    run(scenario, never_healthy=False)


def test_many_waiters_share_one_load_and_each_leaves_on_its_own() -> None:
    async def scenario(sup: Supervisor) -> None:
        ends = [asyncio.Event() for _ in range(3)]
        waits = [asyncio.ensure_future(sup.acquire(sup.find("a"), ends=Ends(event_end(e))))
                 for e in ends]
        await started_waiting(sup, "a", 3)
        load = sup.models["a"].load_task
        ends[0].set()
        with pytest.raises(ClientGone):
            await waits[0]
        assert sup.models["a"].load_task is load and not load.done()  # still theirs
        leases = await asyncio.gather(*waits[1:])
        assert sup.models["a"].waiting == 0 and sup.models["a"].in_flight == 2
        for lease in leases:
            lease.release()

    run(scenario, never_healthy=False)
