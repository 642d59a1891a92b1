"""The house rule on size in ``router/``: no function or method over 60 lines, no class over
300 lines, and ``router/supervisor.py`` at most 350 lines.

A length is ``end_lineno - lineno + 1`` of the ``def``/``class`` node (its docstring included,
its decorators not), as ``ast`` reports it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROUTER = Path(__file__).resolve().parent.parent / "router"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
MAX_SUPERVISOR_LINES = 350


def _sources() -> list[Path]:
    return sorted(ROUTER.rglob("*.py"))


_Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _definitions() -> Iterator[tuple[str, _Definition, int]]:
    """Every function, method and class of every router module (nested ones too): where it
    is (``router/x.py:LINE``), the node, and its length in lines."""
    for path in _sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                assert node.end_lineno is not None
                where = f"{path.relative_to(ROUTER.parent)}:{node.lineno}"
                yield where, node, node.end_lineno - node.lineno + 1


def test_the_router_has_sources() -> None:
    assert len(_sources()) > 10, ROUTER


def test_no_function_is_over_60_lines() -> None:
    too_long = [f"{where} {node.name} is {length} lines" for where, node, length in _definitions()
                if not isinstance(node, ast.ClassDef) and length > MAX_FUNCTION_LINES]
    assert not too_long, (f"functions over {MAX_FUNCTION_LINES} lines:\n  "
                          + "\n  ".join(too_long))


def test_no_class_is_over_300_lines() -> None:
    too_long = [f"{where} {node.name} is {length} lines" for where, node, length in _definitions()
                if isinstance(node, ast.ClassDef) and length > MAX_CLASS_LINES]
    assert not too_long, f"classes over {MAX_CLASS_LINES} lines:\n  " + "\n  ".join(too_long)


def test_the_supervisor_module_is_at_most_350_lines() -> None:
    path = ROUTER / "supervisor.py"
    length = len(path.read_text(encoding="utf-8").splitlines())
    assert length <= MAX_SUPERVISOR_LINES, (
        f"{path.relative_to(ROUTER.parent)}:1 supervisor.py is {length} lines "
        f"(at most {MAX_SUPERVISOR_LINES})")
