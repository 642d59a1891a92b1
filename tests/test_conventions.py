"""House rules that a grep can check (docs/development.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROUTER = Path(__file__).resolve().parent.parent / "router"


def test_the_router_never_uses_wait_for() -> None:
    """``asyncio.wait_for`` drops a cancel on Python 3.11 (docs/development.md, "Waiting with
    a timeout"): ``asyncio.timeout`` or ``asyncio.wait`` instead."""
    offenders = [f"{path.name}:{number}"
                 for path in sorted(ROUTER.rglob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), start=1)
                 if re.search(r"\bwait_for\(", line.split("#", 1)[0])]
    assert not offenders, offenders
