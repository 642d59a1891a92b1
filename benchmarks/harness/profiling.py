"""Profiling a router under load with py-spy (``--profile``): finding py-spy, and its raw
samples summarized as self and inclusive time by function and by package."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any


def py_spy() -> str | None:
    """The py-spy beside this Python (the venv's), else the one on ``PATH``, else None."""
    local = Path(sys.executable).parent / "py-spy"
    return str(local) if local.exists() else shutil.which("py-spy")


def _frame_module(frame: str) -> tuple[str, str]:
    """``func (path:line)`` → (function, module-ish label)."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not match:
        return frame, "?"
    func, path = match.groups()
    if "site-packages/" in path:
        rest = path.split("site-packages/", 1)[1]
    elif re.search(r"/lib/python3\.\d+/", path):
        rest = "stdlib/" + re.split(r"/lib/python3\.\d+/", path, maxsplit=1)[1]
    else:
        rest = path
    rest = rest.removesuffix(".py").replace("/__init__", "")
    return func, rest.replace("/", ".")


def summarize_profile(raw: str, top: int = 25) -> dict[str, Any]:
    """Self time by function and by package, inclusive time by package, from py-spy raw."""
    total = 0
    self_fn: dict[str, int] = {}
    self_pkg: dict[str, int] = {}
    incl_pkg: dict[str, int] = {}
    incl_fn: dict[str, int] = {}
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_frame_module(f) for f in stack.split(";") if f]
        if not frames:
            continue
        func, module = frames[-1]
        self_fn[f"{module}:{func}"] = self_fn.get(f"{module}:{func}", 0) + count
        package = _package(module)
        self_pkg[package] = self_pkg.get(package, 0) + count
        for pkg in {_package(m) for _, m in frames}:
            incl_pkg[pkg] = incl_pkg.get(pkg, 0) + count
        for name in {f"{m}:{f}" for f, m in frames}:
            incl_fn[name] = incl_fn.get(name, 0) + count

    def ranked(table: dict[str, int]) -> list[tuple[str, float]]:
        items = sorted(table.items(), key=lambda kv: -kv[1])[:top]
        return [(k, round(100.0 * v / total, 1)) for k, v in items]

    if total == 0:
        return {"samples": 0}
    return {"samples": total, "self_by_function_pct": ranked(self_fn),
            "self_by_package_pct": ranked(self_pkg),
            "inclusive_by_package_pct": ranked(incl_pkg),
            "inclusive_by_function_pct": ranked(incl_fn)}


def _package(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "stdlib":
        return "stdlib." + (parts[1] if len(parts) > 1 else "?")
    if "router" in parts[:-1]:
        return "router." + parts[parts.index("router") + 1]
    return parts[0]
