"""The server's own loop (``server.RouterServer.main_loop``): it wakes once a second to refresh
the Date header, not ten times as uvicorn's does, and a signal ends it at once."""

from __future__ import annotations

import asyncio
import signal

import pytest
import uvicorn
from starlette.applications import Starlette

from router import server
from router.host.systemd import Notifier
from router.server import RouterServer

HANG_GUARD_S = 10.0


def router_server() -> RouterServer:
    app = Starlette()
    return RouterServer(uvicorn.Config(app, log_config=None), app, Notifier({}))


async def test_a_signal_ends_the_loop_at_once_not_at_the_next_tick(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "TICK_S", 3600.0)  # waiting for a tick would hang the test
    srv = router_server()
    loop_task = asyncio.create_task(srv.main_loop())
    await asyncio.sleep(0)  # the loop is waiting now
    assert not loop_task.done()
    srv.handle_exit(signal.SIGTERM, None)
    async with asyncio.timeout(HANG_GUARD_S):
        await loop_task
    assert srv.should_exit


async def test_each_tick_refreshes_the_date_header(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "TICK_S", 0.001)
    srv = router_server()
    ticks: list[int] = []
    on_tick = srv.on_tick

    async def counting(counter: int) -> bool:
        ticks.append(counter)
        srv.server_state.default_headers = []
        await on_tick(counter)
        assert any(name == b"date" for name, _ in srv.server_state.default_headers)
        return len(ticks) >= 3

    monkeypatch.setattr(srv, "on_tick", counting)
    async with asyncio.timeout(HANG_GUARD_S):
        await srv.main_loop()
    assert ticks == [0, 10, 20]  # uvicorn's on_tick dates every 10th count
