"""Layers point one way: configuration imports nothing above it, and the edge borrows nothing
from the hot path (docs/architecture.md).

The import graph is read from the source (every ``from .x import`` and ``import router.x``,
function-level imports included, ``if TYPE_CHECKING:`` blocks excluded: they are types, not
dependencies).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROUTER = Path(__file__).resolve().parent.parent / "router"

# What ``settings`` may reach: parsers of its own values and the errors they raise.
CONFIGURATION = frozenset({"settings", "keyfile", "origins", "listen", "memory", "flags",
                           "ggufmeta", "gpus", "errors"})
# The edge: what every request passes before the hot path picks a model.
EDGE = ("cors", "keys", "keyfile", "origins", "http11", "requests", "errors", "paths")
# The hot path and the core below it: the edge calls into them, never borrows from them.
HOT_PATH = frozenset({"forward", "proxy", "upstream", "nodes", "hop", "supervisor",
                      "executor", "loader", "leases", "admission", "lifecycle", "runtime",
                      "state", "routes", "app", "server"})


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(module: str) -> dict[str, set[str]]:
    """The router modules ``module`` imports, each with the names it takes from it."""
    tree = ast.parse((ROUTER / f"{module}.py").read_text())
    found: dict[str, set[str]] = {}
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is None:  # from . import x
                for alias in node.names:
                    found.setdefault(alias.name, set())
            else:
                found.setdefault(node.module.split(".")[0], set()).update(
                    a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("router."):
            found.setdefault(node.module.split(".")[1], set()).update(a.name for a in node.names)
    return {name: names for name, names in found.items() if (ROUTER / f"{name}.py").exists()}


def reach(module: str) -> set[str]:
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(imports(name))
    return seen


def test_configuration_imports_nothing_above_it() -> None:
    above = reach("settings") - CONFIGURATION
    assert not above, f"settings reaches {sorted(above)}: configuration must not depend on them"


@pytest.mark.parametrize("module", EDGE)
def test_the_edge_borrows_nothing_from_the_hot_path(module: str) -> None:
    borrowed = {name: sorted(names) for name, names in imports(module).items()
                if name in HOT_PATH}
    assert not borrowed, f"{module} imports {borrowed} from the hot path"


def test_the_edge_middleware_takes_nothing_from_the_hot_path() -> None:
    """The outer middleware (``middleware``, ``cors``, ``keys``) wraps whatever app it is
    given: only the composition root (``app``) puts the hot path's entry
    (``forward.ProxyMiddleware``) inside it. Their errors and envelope writers are the edge's
    own (``errors``)."""
    for module in ("middleware", "cors", "keys"):
        taken = imports(module)
        assert not {"forward", "proxy", "upstream", "supervisor", "nodes", "hop", "route",
                    "state"} & set(taken), (module, sorted(taken))
    assert imports("app")["forward"] == {"ProxyMiddleware"}
