"""The router's own log: one line per event on stderr, with structured ``key=value`` fields."""

from __future__ import annotations

import logging
import sys

FIELDS = ("model", "pid", "port", "exit_code", "duration")


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        extras = [f"{name}={getattr(record, name)}" for name in FIELDS
                  if getattr(record, name, None) is not None]
        return f"{base} {' '.join(extras)}" if extras else base


def configure(level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.WARNING)
