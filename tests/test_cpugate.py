"""The CPU gate's turns (pure stepping over fake children) and its pause/resume contract."""

from __future__ import annotations

import asyncio
import signal

import httpx
import psutil
import pytest

from router.children.process import ChildProcess
from router.core.cpugate import CpuGate, next_turn
from router.logs import LogRing


class FakeChild:
    def __init__(self, name: str, alive: bool = True) -> None:
        self.name = name
        self.alive = alive
        self.stopped = False
        self.signals: list[str] = []
        self.cycled = asyncio.Event()  # paused and continued at least once

    def pause(self) -> bool:
        if not self.alive:
            return False
        self.stopped = True
        self.signals.append("STOP")
        return True

    def resume(self) -> None:
        self.stopped = False
        self.signals.append("CONT")
        self.cycled.set()

    def __repr__(self) -> str:
        return self.name


def gate_over(active: dict[str, list[FakeChild]]) -> CpuGate:
    return CpuGate(lambda: active, turn_s=0.05)  # type: ignore[arg-type, return-value]


def test_next_turn_is_round_robin() -> None:
    assert next_turn(["a", "b", "c"], None) == "a"
    assert next_turn(["a", "b", "c"], "a") == "b"
    assert next_turn(["a", "b", "c"], "c") == "a"
    assert next_turn(["a", "c"], "b") == "a"  # the current one left


def test_a_model_alone_is_never_paused() -> None:
    a = FakeChild("a")
    gate = gate_over({"a": [a]})
    assert gate._step({"a": [a]}, 0.0) is None  # type: ignore[dict-item]
    assert a.signals == [] and not gate.paused


def test_two_active_models_take_turns() -> None:
    a1, a2, b = FakeChild("a1"), FakeChild("a2"), FakeChild("b")
    active = {"a": [a1, a2], "b": [b]}
    gate = gate_over(active)
    wait = gate._step(active, 0.0)  # type: ignore[arg-type]
    assert wait == pytest.approx(0.05)
    assert not a1.stopped and not a2.stopped and b.stopped  # a's turn, both replicas run
    assert gate._step(active, 0.02) == pytest.approx(0.03)  # type: ignore[arg-type]
    assert b.stopped and gate.turns == 1  # mid-turn: nothing changes
    gate._step(active, 0.05)  # type: ignore[arg-type]
    assert a1.stopped and a2.stopped and not b.stopped and gate.turns == 2
    gate._step(active, 0.10)  # type: ignore[arg-type]
    assert not a1.stopped and b.stopped and gate.turns == 3


def test_everyone_continues_when_only_one_model_is_left() -> None:
    a, b = FakeChild("a"), FakeChild("b")
    gate = gate_over({})
    gate._step({"a": [a], "b": [b]}, 0.0)  # type: ignore[dict-item]
    assert b.stopped
    assert gate._step({"a": [a]}, 0.01) is None  # type: ignore[dict-item]
    assert not a.stopped and not b.stopped and not gate.paused


def test_a_model_that_leaves_is_continued_even_while_others_take_turns() -> None:
    a, b, c = FakeChild("a"), FakeChild("b"), FakeChild("c")
    gate = gate_over({})
    gate._step({"a": [a], "b": [b], "c": [c]}, 0.0)  # type: ignore[dict-item]
    assert b.stopped and c.stopped
    gate._step({"a": [a], "c": [c]}, 0.01)  # type: ignore[dict-item]  # b has nothing in flight
    assert not b.stopped and c.stopped


def test_a_child_that_cannot_be_paused_is_not_tracked() -> None:
    a, dead = FakeChild("a"), FakeChild("dead", alive=False)
    gate = gate_over({})
    gate._step({"a": [a], "b": [dead]}, 0.0)  # type: ignore[dict-item]
    assert not gate.paused


async def test_the_loop_pauses_and_close_continues_everything() -> None:
    a, b = FakeChild("a"), FakeChild("b")
    active: dict[str, list[FakeChild]] = {}
    gate = gate_over(active)
    gate.start()
    active.update(a=[a], b=[b])
    gate.notify()
    async with asyncio.timeout(5):  # turns keep coming without further notifications
        await a.cycled.wait()
        await b.cycled.wait()
    assert a.signals[0] == "STOP" or b.signals[0] == "STOP"
    await gate.close()
    assert not a.stopped and not b.stopped and not gate.paused


async def test_busy_and_idle_wake_the_gate_only_when_a_turn_can_change() -> None:
    a, b = FakeChild("a"), FakeChild("b")
    active: dict[str, list[FakeChild]] = {}
    looked = {"n": 0}

    def members() -> dict[str, list[FakeChild]]:
        looked["n"] += 1
        return dict(active)

    gate = CpuGate(members, turn_s=3600)  # type: ignore[arg-type]
    gate.start()

    async def settled() -> None:  # the gate's task has run every step it was woken for
        for _ in range(5):
            await asyncio.sleep(0)

    await settled()
    assert looked["n"] == 1  # its first look, at the start
    for _ in range(3):  # one model's requests, one after another: nothing to wake for
        active["a"] = [a]
        gate.busy("a")
        await settled()
        del active["a"]
        gate.idle("a")
        await settled()
    assert looked["n"] == 1
    active.update(a=[a], b=[b])
    gate.busy("a")
    gate.busy("b")  # a second busy model: turns start
    await settled()
    assert looked["n"] == 2 and len(gate.paused) == 1
    del active["b"]
    gate.idle("b")  # turns are on: they end, the paused child goes on
    await settled()
    assert looked["n"] == 3 and not gate.paused and not a.stopped and not b.stopped
    del active["a"]
    gate.idle("a")  # turns are over: nothing to wake for
    await settled()
    assert looked["n"] == 3
    await gate.close()


@pytest.mark.process
async def test_a_paused_child_is_stopped_by_sigterm_not_sigkill() -> None:
    """``ChildProcess.stop`` continues a paused child, so its SIGTERM is acted on at once."""
    async with httpx.AsyncClient() as client:
        child = ChildProcess("sleeper", ["sleep", "60"], 0, LogRing(10), client)
        await child.start()
        assert child.pid is not None
        assert child.pause()
        async with asyncio.timeout(5):
            while psutil.Process(child.pid).status() != psutil.STATUS_STOPPED:  # noqa: ASYNC110
                await asyncio.sleep(0.01)  # the kernel has no event for "stopped"
        child.resume()
        assert child.pause()
        async with asyncio.timeout(8):
            code = await child.stop(5.0)
        assert code == -signal.SIGTERM
        assert not child.pause()  # gone: nothing to pause


async def test_a_failing_member_list_continues_everyone_and_the_gate_keeps_running(
        caplog: pytest.LogCaptureFixture) -> None:
    a, b = FakeChild("a"), FakeChild("b")
    calls = {"n": 0}

    def members() -> dict[str, list[FakeChild]]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return {"a": [a], "b": [b]}

    gate = CpuGate(members, turn_s=0.01)  # type: ignore[arg-type]
    gate.start()
    gate.notify()
    async with asyncio.timeout(5):
        while "CPU turns failed" not in caplog.text:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert not gate.paused  # the failure continued everyone
    before = gate.turns
    gate.notify()  # the next change is handled again: turns resume
    async with asyncio.timeout(5):
        while gate.turns <= before + 1:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    await gate.close()
    assert not a.stopped and not b.stopped
