"""The sd_notify client, in process (``test_service.py`` runs it under a router)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from router.host.systemd import Notifier


def test_outside_systemd_nothing_is_sent() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.watchdog_s is None
    notifier.notify("READY=1")  # a no-op, no socket needed


def test_fields_arrive_in_one_datagram(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        notifier = Notifier({"NOTIFY_SOCKET": path})
        assert notifier.enabled
        notifier.notify("READY=1", "STATUS=serving 2 models")
        server.settimeout(5)
        assert server.recv(4096) == b"READY=1\nSTATUS=serving 2 models"


def test_an_abstract_socket_address() -> None:
    name = f"llama-router-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind("\0" + name)
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.address == "\0" + name
        notifier.notify("WATCHDOG=1")
        server.settimeout(5)
        assert server.recv(4096) == b"WATCHDOG=1"


def test_a_socket_nobody_listens_on_is_logged_not_raised(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = str(tmp_path / "gone")
    with caplog.at_level(logging.WARNING, logger="router.systemd"):
        Notifier({"NOTIFY_SOCKET": missing}).notify("READY=1")
    assert f"cannot notify systemd at {missing}" in caplog.text


@pytest.mark.parametrize(("environ", "expected"), [
    ({"WATCHDOG_USEC": "400000"}, 0.2),  # ping at half the interval
    ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": str(os.getpid())}, 0.2),
    ({"WATCHDOG_USEC": "400000", "WATCHDOG_PID": "1"}, None),  # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
])
def test_watchdog_interval(environ: dict[str, str], expected: float | None) -> None:
    assert Notifier(environ).watchdog_s == expected
