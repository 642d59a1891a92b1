"""The code holds to its declared architecture (``docs/architecture.toml``): one checker for
the parts and their imports, the records and their owners, and the size bars.

Everything is read from the source with ``ast``, never by importing it, so a checker can be
run on planted code as well: each rule is also run on a copy of the code with one violation
planted, and must find it (a rule that checks nothing fails there rather than passing). The
records' writes are found by the types of what is written to (``tests/archcheck.py``).
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from archcheck import MUTATORS, Project, Write, parse

ROOT = Path(__file__).resolve().parent.parent
DECLARED = ROOT / "docs" / "architecture.toml"
TREES = ("router", "benchmarks")
Sources = dict[str, str]  # "router/x/y.py" -> its text


@cache
def declared() -> dict[str, Any]:
    return tomllib.loads(DECLARED.read_text())


@cache
def _tree_sources() -> tuple[tuple[str, str], ...]:
    return tuple((str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"))
                 for tree in TREES for p in sorted((ROOT / tree).rglob("*.py")))


def sources() -> Sources:
    return dict(_tree_sources())


def module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def path_of(module: str, tree: Sources) -> str | None:
    base = module.replace(".", "/")
    for candidate in (f"{base}.py", f"{base}/__init__.py"):
        if candidate in tree:
            return candidate
    return None


# --------------------------------------------------------------------------- imports

@dataclass(frozen=True)
class Import:
    source: str  # the importing file
    line: int
    target: str  # the imported file
    type_only: bool


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                inside.update(id(n) for child in node.body for n in ast.walk(child))
    return inside


def imports_of(path: str, tree: Sources) -> Iterator[Import]:
    """Every import of a file of the tree by ``path``, at any depth, type-only ones marked."""
    parsed = ast.parse(tree[path])
    type_only = _type_checking_nodes(parsed)
    package = module_name(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    for node in ast.walk(parsed):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
            for alias in node.names:  # `from pkg import module` imports that module
                found = path_of(f"{stem}.{alias.name}", tree)
                targets.append(found or path_of(stem, tree) or "")
        elif isinstance(node, ast.Import):
            targets = [path_of(alias.name, tree) or "" for alias in node.names]
        for target in {t for t in targets if t and t != path}:
            yield Import(path, node.lineno, target, id(node) in type_only)


def part_of(path: str) -> str | None:
    best: tuple[int, str] | None = None
    for name, part in declared()["parts"].items():
        for place in part["files"]:
            holds = path == place or (place.endswith("/") and path.startswith(place))
            if holds and (best is None or len(place) > best[0]):
                best = (len(place), name)
    return best[1] if best else None


def import_violations(tree: Sources) -> list[str]:
    parts = declared()["parts"]
    found = []
    for path in tree:
        mine = part_of(path)
        for imp in imports_of(path, tree):
            theirs = part_of(imp.target)
            if theirs is None or mine is None or theirs == mine \
                    or theirs in parts[mine]["uses"]:
                continue
            kind = "a type-only import" if imp.type_only else "an import"
            found.append(f"{path}:{imp.line}: {kind} of {imp.target}: part {mine!r} may not "
                         f"use part {theirs!r} (docs/architecture.toml)")
    return found


def never_violations(tree: Sources) -> list[str]:
    found = []
    for rule in declared().get("never", []):
        # A folder ("router/edge/") stands for every file in it.
        paths = [p for entry in rule["from"]
                 for p in (sorted(q for q in tree if q.startswith(entry))
                           if entry.endswith("/") else [entry])]
        for path in paths:
            for imp in imports_of(path, tree):
                if imp.target in rule["to"]:
                    found.append(f"{path}:{imp.line}: imports {imp.target}: {rule['why']}")
    return found


def circles(tree: Sources) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), type-only imports
    counted."""
    graph = {path: sorted({i.target for i in imports_of(path, tree)}) for path in tree}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for node in graph:
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_every_file_is_in_one_declared_part() -> None:
    unplaced = [path for path in sources() if part_of(path) is None]
    assert not unplaced, f"files in no part of docs/architecture.toml: {unplaced}"
    for name, part in declared()["parts"].items():
        assert set(part["uses"]) <= set(declared()["parts"]), name
        for place in part["files"]:
            assert (ROOT / place).exists(), f"part {name!r}: {place} does not exist"


def test_each_import_stays_within_what_its_part_may_use() -> None:
    found = import_violations(sources())
    assert not found, "\n".join(found)


def test_no_module_imports_what_a_never_rule_forbids() -> None:
    found = never_violations(sources())
    assert not found, "\n".join(found)


def test_the_modules_import_each_other_in_no_circle() -> None:
    found = circles(sources())
    assert not found, "circles of imports:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_parts_use_each_other_in_no_circle() -> None:
    parts = declared()["parts"]
    order: list[str] = []
    seen: set[str] = set()

    def place(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"parts in a circle: {' -> '.join((*path, name))}"
        if name not in seen:
            for used in parts[name]["uses"]:
                place(used, (*path, name))
            seen.add(name)
            order.append(name)

    for name in parts:
        place(name, ())
    assert set(order) == set(parts)


def _planted(path: str, line: str, tree: Sources | None = None) -> Sources:
    planted = dict(tree or sources())
    planted[path] = planted[path] + "\n" + line + "\n"
    return planted


def test_the_import_checks_find_what_is_planted() -> None:
    """An upward import, plain or type-only, relative or absolute, at any depth, and a
    circle, planted into a copy of the code: each is found."""
    up = "router/config/presets.py"
    for line in ("from ..edge.route import decide",
                 "from router.edge import route",
                 "if TYPE_CHECKING:\n    from ..core.supervisor import Supervisor",
                 "def f() -> None:\n    from ..peers import hop"):
        found = import_violations(_planted(up, line))
        assert any(f.startswith(up) for f in found), line
    assert import_violations(_planted(up, "from ..host import memory")) == []
    found = never_violations(_planted("router/edge/keys.py", "from ..http.proxy import relay"))
    assert found and "router/edge/keys.py" in found[0]
    found = never_violations(_planted("router/observe/activity.py", "if TYPE_CHECKING:\n"
                                      "    from ..core.supervisor import Supervisor"))
    assert found and "router/observe/activity.py" in found[0]
    # One import back down the other way closes a circle.
    tree = _planted("router/foundation_probe.py", "from .errors import RouterError", {
        **sources(), "router/foundation_probe.py": ""})
    tree = _planted("router/errors.py", "from . import foundation_probe", tree)
    assert ["router/errors.py", "router/foundation_probe.py"] in circles(tree)


# --------------------------------------------------------------------------- records

def _written(node: ast.AST) -> list[ast.Attribute]:
    """The attributes ``node`` writes as plain syntax (assigned, deleted, assigned through,
    changed in place by a container's method): what an owner's own methods do to ``self``."""
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign) and node.target is not None:
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = list(node.targets)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in MUTATORS:
        targets = [node.func.value]
    found: list[ast.Attribute] = []
    while targets:
        target = targets.pop()
        if isinstance(target, ast.Tuple | ast.List):
            targets.extend(target.elts)
        elif isinstance(target, ast.Starred | ast.Subscript):
            targets.append(target.value)
        elif isinstance(target, ast.Attribute):
            found.append(target)
    return found


def project_of(tree: Sources) -> Project:
    return Project(tree, declared().get("types", {}))


@cache
def _real_project() -> Project:
    return project_of(sources())


@dataclass(frozen=True)
class Role:
    """A class's place in a declared record: its ``class`` or one of its ``values``."""

    record: str
    value: bool  # its mutating methods, called, are writes


@cache
def record_classes() -> dict[str, Role]:
    roles = {}
    for name, record in declared()["records"].items():
        roles[record["class"]] = Role(name, bool(record.get("value")))
        for value in record.get("values", []):
            roles[value] = Role(name, True)
    return roles


def owners_of(record: dict[str, Any], cls: str, field: str) -> set[str]:
    """The files that may write ``cls.field`` (none: nobody after construction)."""
    owner = record.get("fields", {}).get(field) if cls == record["class"] else None
    owner = record["owner"] if owner is None else owner
    return set() if owner == "none" else {owner} if isinstance(owner, str) else set(owner)


def record_writes(project: Project) -> Iterator[tuple[Write, str, dict[str, Any]]]:
    """Every write of a declared record's field, anywhere in ``router/``, with the record's
    name and declaration."""
    roles, records = record_classes(), declared()["records"]

    def holds(cls: str, field: str) -> bool:  # a call on a held field is not a write of it
        role = roles.get(cls)
        return role is not None and (records[role.record]["class"] != cls
                                     or field not in records[role.record].get("held", {}))

    for write in project.writes(holds):
        role = roles.get(write.cls)
        if role is None or (write.kind == "method" and not role.value):
            continue
        within = roles.get(write.within)
        if within is not None and within.record == role.record:
            continue  # the record's own classes' code
        record = records[role.record]
        mine = write.cls == record["class"]
        if mine and write.field not in record.get("fields_only", [write.field]):
            continue
        yield write, role.record, record


def _excepted(record: dict[str, Any], write: Write) -> bool:
    return any(write.where == e["in"] and write.short in e["writes"]
               for e in record.get("known_exceptions", []))


def record_violations(tree: Sources, project: Project | None = None) -> list[str]:
    """Writes of a record's fields outside their owner (but the known exceptions); imports of
    an owner's private names."""
    found = []
    for write, name, record in record_writes(project or project_of(tree)):
        owners = owners_of(record, write.cls, write.field)
        if write.path in owners or _excepted(record, write):
            continue
        how = f" (by {write.via})" if write.via else ""
        found.append(f"{write.path}:{write.line}: in {write.scope}: {write.code}: writes "
                     f"{write.short}{how}, of the record {name!r}, which "
                     f"{' and '.join(sorted(owners)) or 'nobody'} alone writes "
                     f"(docs/architecture.toml)")
    for record in declared()["records"].values():
        for path, text in tree.items():
            if not path.startswith("router/") or path == record["owner"] \
                    or not record.get("private"):
                continue
            for node in ast.walk(parse(text)):
                if not isinstance(node, ast.ImportFrom):
                    continue
                for module, names in record.get("private", {}).items():
                    taken = {a.name for a in node.names} & set(names)
                    if taken and (node.module or "").endswith(module.rpartition(".")[2]):
                        found.append(f"{path}:{node.lineno}: imports {sorted(taken)} of "
                                     f"{module}: {record['owner']} alone does")
    return found


def applier_violations(tree: Sources) -> list[str]:
    """Inside an owner's class: the applier alone calls the transition and writes the
    applied fields; every other field of the class is written in ``__init__`` or in the
    methods ``written_in`` names."""
    found = []
    for name, record in declared()["records"].items():
        if "applier" not in record:
            continue
        cls_name = record["class"].rpartition(".")[2]
        module = ast.parse(tree[record["owner"]])
        cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
        applier, applied = record["applier"], set(record["applied"])
        written_in = record.get("written_in", {})
        for method in cls.body:
            if not isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(method):
                if isinstance(node, ast.Name) and node.id == record["transition"] \
                        and method.name != applier:
                    found.append(f"{name}: {method.name} calls {node.id}: {applier} alone does")
                for target in _written(node):
                    if not (isinstance(target.value, ast.Name) and target.value.id == "self"):
                        continue
                    field = target.attr
                    if field in applied:
                        allowed = {"__init__", applier}
                    elif field in written_in:
                        allowed = {"__init__", *written_in[field]}
                    elif record.get("others_in_init_only"):
                        allowed = {"__init__"}
                    else:
                        continue
                    if method.name not in allowed:
                        found.append(f"{name}: {method.name} writes self.{field} "
                                     f"({ast.unparse(node)[:60]}): {sorted(allowed)} alone do")
    return found


def test_every_record_field_is_written_by_its_owner_alone() -> None:
    found = record_violations(sources(), _real_project())
    assert not found, "\n".join(found)


def test_each_known_exception_is_still_in_the_code() -> None:
    """A known exception names writes the code makes today: one the code no longer makes is
    taken off the list (docs/architecture.toml), so that the list stays the to-do it is."""
    seen = {(w.where, w.short) for w, _, _ in record_writes(_real_project())}
    stale = [f"records.{name}: {e['in']} no longer writes {short}"
             for name, record in declared()["records"].items()
             for e in record.get("known_exceptions", []) for short in e["writes"]
             if (e["in"], short) not in seen]
    assert not stale, "\n".join(stale)


def test_inside_each_owner_the_applier_alone_applies() -> None:
    found = applier_violations(sources())
    assert not found, "\n".join(found)


def test_the_declared_records_name_real_classes_fields_and_files() -> None:
    project = _real_project()
    problems = []
    for name, record in declared()["records"].items():
        classes = [record["class"], *record.get("values", [])]
        problems += [f"records.{name}: no class {c}" for c in classes if c not in project.classes]
        if record["class"] not in project.classes:
            continue
        fields = project.classes[record["class"]].fields()
        for key in ("fields", "held", "fields_only"):
            problems += [f"records.{name}.{key}: {record['class']} has no field {f}"
                         for f in record.get(key, []) if f not in fields]
        owners = [o for c in classes for f in ("", *record.get("fields", {}))
                  for o in owners_of(record, c, f)]
        problems += [f"records.{name}: no file {o}" for o in owners if not (ROOT / o).is_file()]
        shorts = {c.rpartition(".")[2] for c in classes}
        for exception in record.get("known_exceptions", []):
            path = exception["in"].partition(":")[0]
            if not (ROOT / path).is_file():
                problems.append(f"records.{name}: no file {path}")
            problems += [f"records.{name}: {exception['in']}: {w} is not of this record"
                         for w in exception["writes"] if w.partition(".")[0] not in shorts]
            if not exception.get("why"):
                problems.append(f"records.{name}: {exception['in']}: no why")
    for attr in declared().get("types", {}):
        cls, _, field = attr.rpartition(".")
        if cls not in project.classes or field not in project.classes[cls].fields():
            problems.append(f"types: no field {attr}")
    assert not problems, "\n".join(problems)


# Each planted into a copy of the code: (file, code, the write it makes, in its function).
PLANTED_WRITES = [
    # The five that reading by receiver names missed.
    ("router/core/wait.py", "def _p_loop(models: list[ModelRuntime]) -> None:\n"
                            "    for m in models:\n        m.waiting += 1",
     "_p_loop", "ModelRuntime.waiting"),
    ("router/core/wait.py", "class _PHolder:\n"
                            "    def __init__(self, runtime: ModelRuntime) -> None:\n"
                            "        self._runtime = runtime\n\n"
                            "    def _p_attr(self) -> None:\n"
                            "        self._runtime.queued_since = 1.0",
     "_PHolder._p_attr", "ModelRuntime.queued_since"),
    ("router/core/wait.py", "def _p_setattr(runtime: ModelRuntime) -> None:\n"
                            "    setattr(runtime, 'waiting', 0)",
     "_p_setattr", "ModelRuntime.waiting"),
    ("router/core/wait.py", "def _p_nested(runtime: ModelRuntime) -> None:\n"
                            "    runtime.state.replicas[0].in_flight += 1",
     "_p_nested", "Replica.in_flight"),
    ("router/core/runtime.py", "from ..serving.load import Replica\n"
                               "def _p_prefixes(replica: Replica) -> None:\n"
                               "    replica.prefixes.record((1, 2))",
     "_p_prefixes", "Replica.prefixes"),
    # Assigned, annotated, deleted, through object.__setattr__, assigned through, changed
    # in place by a container's method, through a return type and a mapping's values.
    ("router/core/wait.py", "def _p_assign(runtime: ModelRuntime) -> None:\n"
                            "    runtime.state = None\n    runtime.estimate: int = 1\n"
                            "    del runtime.estimate_due\n"
                            "    object.__setattr__(runtime, 'last_load_s', 1.0)\n"
                            "    runtime.estimate_devices['gpu0'] = 1\n"
                            "    runtime.logs.append(None)",
     "_p_assign", "ModelRuntime.state ModelRuntime.estimate ModelRuntime.estimate_due "
                  "ModelRuntime.last_load_s ModelRuntime.estimate_devices ModelRuntime.logs"),
    ("router/core/wait.py", "def _p_returned(runtime: ModelRuntime) -> None:\n"
                            "    least_busy(runtime).in_flight -= 1",
     "_p_returned", "Replica.in_flight"),
    ("router/core/wait.py", "def _p_mapping(models: dict[str, ModelRuntime]) -> None:\n"
                            "    models['x'].waiting = 0\n"
                            "    for model in models.values():\n"
                            "        model.replicas[0].backlog.tickets.clear()",
     "_p_mapping", "ModelRuntime.waiting Backlog.tickets"),
    ("router/core/wait.py", "def _p_load(runtime: ModelRuntime, c: ModelLoad) -> None:\n"
                            "    runtime.load.used_at = 1.0\n    c.in_flight -= 1",
     "_p_load", "ModelLoad.used_at ModelLoad.in_flight"),
    ("router/core/wait.py", "def _p_peer(peer: Peer, conn: _Connection) -> None:\n"
                            "    peer._calls.add(1)\n    conn._state = None",
     "_p_peer", "Peer._calls _Connection._state"),
    # The warm swaps' ledger, its counts, and a value's mutating method, in a function of
    # the file that has known exceptions in others.
    ("router/warm/conversations.py",
     "def _p_ledger(swaps: WarmSwaps) -> None:\n"
     "    swaps.ledger.counts_of('m').waited(1.0)\n    swaps.ledger.counts.clear()\n"
     "    swaps.store.remove_model('m')",  # a held field: its own record's write
     "_p_ledger", "WarmSwaps.ledger Counts.displace_wait_s Counts.recent_waits "
                  "Ledger.counts StateStore._index"),
    ("router/edge/routes.py", "def _p_queue(queue: FairQueue, usage: Usage) -> None:\n"
                              "    queue.pop()\n    usage.refused('team', 'model')",
     "_p_queue", "FairQueue.waiting Usage._rows"),
]
PLANTED_IMPORTS = {
    "router/core/wait.py": "from ..serving.load import ModelLoad, Replica\n"
                           "from ..serving.leases import least_busy\n"
                           "from ..peers.peer import Peer\nfrom ..http.upstream import _Connection",
    "router/serving/leases.py": "from .load import ModelLoad",
    "router/edge/routes.py": "from ..teams.fairshare import FairQueue\n"
                             "from ..teams.usage import Usage",
}
# Not writes outside the owner: the owner's own, and construction.
PLANTED_FINE = [
    ("router/serving/leases.py", "def _p_owner(runtime: Served, c: ModelLoad) -> None:\n"
                                 "    runtime.load.in_flight += 1\n    c.used_at = 1.0\n"
                                 "    least_busy(runtime).prefixes.record((1,))"),
    ("router/core/wait.py", "def _p_made(child: Any) -> Replica:\n"
                            "    made = Replica(child)\n    made.in_flight = 1\n"
                            "    made.prefixes.record((1,))\n    return made"),
]


def test_the_record_checks_find_what_is_planted() -> None:
    """Each write of ``PLANTED_WRITES`` planted outside its owner is found (by its type:
    annotated parameters, attributes, loops, return types, mappings, nested paths; assigned,
    deleted, set, changed in place, by a value's mutating method), each of
    ``PLANTED_FINE`` is not; so are a field its owner writes outside the applier and an
    owner's private name imported."""
    tree = sources()
    for path, imports in PLANTED_IMPORTS.items():
        tree = _planted(path, imports, tree)
    for path, code, *_ in PLANTED_WRITES:
        tree = _planted(path, code, tree)
    for path, code in PLANTED_FINE:
        tree = _planted(path, code, tree)
    project = project_of(tree)
    found = record_violations(tree, project)
    for path, _, scope, writes in PLANTED_WRITES:
        for short in writes.split():
            assert any(f.startswith(f"{path}:") and f" in {scope}: " in f
                       and f"writes {short}" in f for f in found), (path, scope, short)
    planted = {scope for *_, scope, _ in PLANTED_WRITES}
    assert all(f.partition(" in ")[2].partition(":")[0] in planted for f in found), found
    assert record_violations(_planted("router/core/wait.py",
                                      "from ..peers.peerstate import transition"))
    owner = "router/peers/peer.py"
    planted = dict(sources())
    planted[owner] = planted[owner].replace("    def calling(", "    def _probe(self) -> None:\n"
                                            "        self._state = None\n\n    def calling(", 1)
    assert planted[owner] != sources()[owner]
    assert any("_probe writes self._state" in f for f in applier_violations(planted))


@pytest.fixture
def watched() -> Iterator[dict[tuple[str, str], set[str]]]:
    """Every write to a model's record after construction: (class, field) -> writer files."""
    from router.core.runtime import ModelRuntime
    from router.serving.load import ModelLoad, Replica

    seen: dict[tuple[str, str], set[str]] = defaultdict(set)
    originals = {cls: cls.__setattr__ for cls in (ModelRuntime, Replica, ModelLoad)}

    def watching(cls: type) -> Any:
        def setattr_(self: Any, name: str, value: Any) -> None:
            writer = sys._getframe(1).f_globals.get("__name__", "?")
            # Not the dataclass's own __init__, nor the simulation itself (it gives models
            # the estimates a GGUF header would: its fake files have none).
            if writer.startswith("router.") and writer != cls.__module__:
                seen[(cls.__name__, name)].add(writer.replace(".", "/") + ".py")
            object.__setattr__(self, name, value)
        return setattr_

    for cls in originals:
        cls.__setattr__ = watching(cls)  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        for cls, original in originals.items():
            cls.__setattr__ = original  # type: ignore[method-assign]


@pytest.mark.parametrize("seed", [1, 7, 23])
def test_simulated_schedules_write_the_models_records_only_from_their_owners(
        watched: dict[tuple[str, str], set[str]], seed: int) -> None:
    """The real core on virtual time (``simulation``): every write seen through the record's
    ``__setattr__``, through whatever name, comes from the field's owner (or from a file with
    a known exception for it)."""
    from simulation import describe, run_schedule

    sim = run_schedule(seed)
    assert not sim.violations, describe(sim)
    records = declared()["records"]
    by_name = {cls.rpartition(".")[2]: (cls, records[role.record])
               for cls, role in record_classes().items()}

    def allowed(name: str, field: str) -> set[str]:
        cls, record = by_name[name]
        return owners_of(record, cls, field) | {
            e["in"].partition(":")[0] for e in record.get("known_exceptions", [])
            if f"{name}.{field}" in e["writes"]}

    wrong = {key: sorted(writers) for key, writers in watched.items()
             if writers - allowed(*key)}
    assert not wrong, f"fields written outside their owner: {wrong}"
    assert watched[("ModelRuntime", "state")] == {records["model"]["owner"]}


# --------------------------------------------------------------------------- sizes

def size_violations(tree: Sources) -> list[str]:
    bars = declared()["bars"]
    found = []
    for path, text in tree.items():
        if not path.startswith(("router/", "benchmarks/")):
            continue
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            bar = bars["class_lines"] if isinstance(node, ast.ClassDef) \
                else bars["function_lines"]
            if length > bar:
                found.append(f"{path}:{node.lineno}: {node.name} is {length} lines "
                             f"(at most {bar})")
        own = bars["file_lines"].get(path)
        if own is not None and len(text.splitlines()) > own:
            found.append(f"{path}: {len(text.splitlines())} lines (at most {own})")
    packages: dict[str, int] = defaultdict(int)
    for path in tree:
        parts = path.split("/")
        if parts[0] == "router" and parts[-1] not in ("__init__.py", "__main__.py"):
            packages["/".join(parts[:-1])] += 1
    for package, count in packages.items():
        bar = bars["top_level_modules"] if package == "router" else bars["modules_per_package"]
        if count > bar:
            found.append(f"{package}/: {count} modules (at most {bar})")
    return found


def test_every_size_is_within_its_bar() -> None:
    found = size_violations(sources())
    assert not found, "\n".join(found)


def test_the_size_check_finds_what_is_planted() -> None:
    long_function = "def f() -> None:\n" + "    pass\n" * 60
    assert size_violations(_planted("router/errors.py", long_function))
    crowded = {**sources(), **{f"router/extra_{n}.py": "" for n in range(12)}}
    assert any(f.startswith("router/: ") for f in size_violations(crowded))


# --------------------------------------------------------------------------- the parts' faces

def test_each_package_says_what_it_is_owns_and_may_import() -> None:
    """Every package's ``__init__.py`` has a docstring that names each part it may use (or
    says it uses none), so a reader learns its bounds where the part begins."""
    problems = []
    for part in declared()["parts"].values():
        for place in part["files"]:
            init = ROOT / place / "__init__.py"
            if not place.endswith("/") or not init.is_file():
                continue
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            if len(doc.split()) < 12:
                problems.append(f"{place}__init__.py: no docstring that says what it is")
            missing = [used for used in part["uses"] if f"``{used}``" not in doc]
            if missing:
                problems.append(f"{place}__init__.py: its docstring names no {missing} "
                                f"(the parts it may use, as ``name``)")
    assert not problems, "\n".join(problems)


def docstring_module_problems(tree: Sources) -> list[str]:
    """Every package's docstring names each of its modules (as ``name``) and no module that
    is not there: a bare lower-case name in double backquotes is a module of the package
    unless it is a part's name."""
    parts = set(declared()["parts"])
    problems = []
    for init in sorted(p for p in tree if re.fullmatch(r"router/\w+/__init__\.py", p)):
        package = init.removesuffix("__init__.py")
        modules = {Path(p).stem for p in tree if p.startswith(package)
                   and "/" not in p[len(package):] and p != init}
        doc = ast.get_docstring(parse(tree[init])) or ""
        named = set(re.findall(r"``([a-z_][a-z0-9_]*)``", doc)) - parts
        problems += [f"{init}: its docstring does not name its module ``{m}``"
                     for m in sorted(modules - named)]
        problems += [f"{init}: its docstring names ``{m}``, not a module of {package}"
                     for m in sorted(named - modules)]
    return problems


def test_each_package_docstring_lists_its_modules() -> None:
    found = docstring_module_problems(sources())
    assert not found, "\n".join(found)


def test_the_docstring_check_finds_what_is_planted() -> None:
    tree = {**sources(), "router/core/probe.py": ""}
    assert docstring_module_problems(tree) == [
        "router/core/__init__.py: its docstring does not name its module ``probe``"]
    core = "router/core/__init__.py"
    tree = {**sources(), core: sources()[core].replace('"""The', '"""``idle``. The', 1)}
    assert tree[core] != sources()[core]
    assert docstring_module_problems(tree) == [
        "router/core/__init__.py: its docstring names ``idle``, not a module of router/core/"]


def module_table() -> list[tuple[int, str]]:
    """(line, path under router/) of every row of the tables under ``## Modules`` in
    ``docs/architecture.md``."""
    rows = []
    inside = False
    lines = (ROOT / "docs" / "architecture.md").read_text().splitlines()
    for number, line in enumerate(lines, start=1):
        if line.startswith("## "):
            inside = line.strip() == "## Modules"
            continue
        match = re.match(r"\|\s*`([^`]+)`\s*\|", line)
        if inside and match:
            rows.append((number, match.group(1)))
    return rows


def test_the_module_table_lists_every_module_once() -> None:
    """Every module of ``router/`` (but ``__init__.py`` and ``__main__.py``; a package of
    static files, ``dashboard/``, as one row) has a row in docs/architecture.md, and every row
    names one that exists. A module's name is unique across the packages, so a doc may name
    it alone (``proxy.relay``)."""
    on_disk = set()
    for path in sources():
        parts = path.split("/")
        if parts[0] != "router" or parts[-1] in ("__init__.py", "__main__.py"):
            continue
        on_disk.add("dashboard/" if parts[1] == "dashboard" else "/".join(parts[1:]))
    on_disk.add("dashboard/")
    rows = module_table()
    listed = [name for _, name in rows]
    problems = [f"router/{name}: no row under '## Modules' in docs/architecture.md"
                for name in sorted(on_disk - set(listed))]
    problems += [f"docs/architecture.md:{line}: `{name}`: no such module in router/"
                 for line, name in rows if name not in on_disk]
    problems += [f"docs/architecture.md: `{name}` has two rows"
                 for name in sorted({n for n in listed if listed.count(n) > 1})]
    stems = [Path(name).stem for name in on_disk if name.endswith(".py")]
    problems += [f"two modules named {stem}.py" for stem in sorted(set(stems))
                 if stems.count(stem) > 1]
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- the routes

def test_the_routes_are_the_one_list_of_local_routes() -> None:
    """The route table is made from ``paths.LOCAL_ROUTES`` (each path with its methods) and
    the dashboard's files, every pair with a handler and no handler left over; the paths the
    proxy leaves alone (``LOCAL_PATHS``) are exactly those routes' paths."""
    from starlette.routing import Route

    from router.dashboard import DASHBOARD_PATHS
    from router.edge.ollamaroutes import routes as ollama_routes
    from router.edge.routes import HANDLERS, routes
    from router.http.paths import KNOWN_ENDPOINTS, LOCAL_PATHS, LOCAL_ROUTES, OLLAMA_ROUTES

    pairs = {(path, method) for path, methods in LOCAL_ROUTES.items() for method in methods}
    assert set(HANDLERS) == pairs
    ollama = {(r.path, m) for r in ollama_routes() if isinstance(r, Route)
              for m in (r.methods or ()) if m != "HEAD"}
    assert ollama == {(p, m) for p, methods in OLLAMA_ROUTES.items() for m in methods}
    table = [r for r in [*routes(), *ollama_routes()] if isinstance(r, Route)]
    served = {(r.path, m) for r in table for m in (r.methods or ()) if m != "HEAD"}
    assert pairs <= served and {p for p, _ in served} - set(LOCAL_ROUTES) - set(OLLAMA_ROUTES) \
        <= DASHBOARD_PATHS
    assert {r.path for r in table} == LOCAL_PATHS
    assert set(LOCAL_ROUTES) <= KNOWN_ENDPOINTS
