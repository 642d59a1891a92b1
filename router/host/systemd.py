"""The systemd notify protocol (``sd_notify``), without a systemd dependency.

With ``Type=notify`` systemd passes ``NOTIFY_SOCKET`` (a unix datagram socket path, ``@`` for
the abstract namespace) and, with ``WatchdogSec=``, ``WATCHDOG_USEC``/``WATCHDOG_PID``. Outside
systemd every call here is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("router.systemd")


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = ("\0" + path[1:]) if path.startswith("@") else (path or None)
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        owned = not pid or pid == str(os.getpid())
        self.watchdog_s: float | None = (int(usec) / 1e6 / 2
                                         if usec.isdigit() and int(usec) > 0 and owned else None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str) -> None:
        """Send ``KEY=VALUE`` fields (``READY=1``, ``STATUS=...``); never raises."""
        if self.address is None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto("\n".join(fields).encode(), self.address)
        except OSError as exc:
            log.warning("cannot notify systemd at %s: %s", self.address, exc)
