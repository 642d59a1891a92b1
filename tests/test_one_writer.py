"""One writer per field of a model's record (``runtime.ModelRuntime`` and its ``Replica``).

Two checks of the same table, ``OWNERS``:

* statically: every assignment in ``router/`` to an attribute named as one of the record's
  fields, on a receiver named as the record is everywhere (``runtime``, ``replica``), is in
  the field's owner;
* dynamically: simulated schedules (the real core on virtual time, ``simulation``) run with
  the record's ``__setattr__`` watched, and every write after construction comes from the
  field's owner. This also sees writes through other names the static scan cannot.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from simulation import describe, run_schedule

from router.runtime import ModelRuntime, Replica

ROUTER = Path(__file__).resolve().parent.parent / "router"

# field -> the one module that writes it after construction (None: nobody does)
OWNERS: dict[type, dict[str, str | None]] = {
    ModelRuntime: {
        "preset": "executor",
        "logs": None,
        "estimate": "accounting",
        "estimate_devices": "accounting",
        "cache_ram_mib": "accounting",
        "n_layer": "accounting",
        "state": "executor",
        "in_flight": "leases",
        "waiting": "wait",
        "used_at": "leases",
        "download_task": "executor",
        "download_cancel": "executor",
        "load_task": "executor",
        "stop_task": "executor",
        "replace_task": "executor",
        "queued_since": "admission",
        "last_load_s": "loader",
    },
    Replica: {
        "child": None,
        "in_flight": "leases",
        "prefixes": None,
        "pace": None,
        "backlog": None,
    },
}
RECEIVERS = {"runtime", "replica"}


def test_the_table_names_every_field() -> None:
    for cls, owners in OWNERS.items():
        assert set(owners) == {f.name for f in dataclasses.fields(cls)}, cls.__name__


def _writes() -> Iterator[tuple[str, int, str]]:
    """(module, line, field) of every assignment to ``runtime.<x>`` or ``replica.<x>``."""
    for path in sorted(ROUTER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for sub in ast.walk(target):
                    if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                            and sub.value.id in RECEIVERS):
                        yield path.stem, sub.lineno, sub.attr


def test_each_field_is_assigned_only_by_its_owner() -> None:
    fields = {name: owner for owners in OWNERS.values() for name, owner in owners.items()
              if name != "in_flight"}
    wrong = [f"router/{module}.py:{line}: {field} (its owner: {fields[field]})"
             for module, line, field in _writes()
             if field in fields and module != fields[field]]
    wrong += [f"router/{module}.py:{line}: in_flight (its owner: leases)"
              for module, line, field in _writes()
              if field == "in_flight" and module != "leases"]
    assert not wrong, "\n".join(wrong)


@pytest.fixture
def watched() -> Iterator[dict[tuple[str, str], set[str]]]:
    """Every write to a record's field after construction: (class, field) -> writer modules."""
    seen: dict[tuple[str, str], set[str]] = defaultdict(set)
    originals = {cls: cls.__setattr__ for cls in OWNERS}

    def watching(cls: type) -> Any:
        def setattr_(self: Any, name: str, value: Any) -> None:
            writer = sys._getframe(1).f_globals.get("__name__", "?")
            # Not the dataclass's own __init__, nor the simulation itself (it gives models
            # the estimates a GGUF header would: its fake files have none).
            if writer.startswith("router.") and writer != cls.__module__:
                seen[(cls.__name__, name)].add(writer.removeprefix("router."))
            object.__setattr__(self, name, value)
        return setattr_

    for cls in OWNERS:
        cls.__setattr__ = watching(cls)  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        for cls, original in originals.items():
            cls.__setattr__ = original  # type: ignore[method-assign]


@pytest.mark.parametrize("seed", [1, 7, 23])
def test_simulated_schedules_write_each_field_only_from_its_owner(
        watched: dict[tuple[str, str], set[str]], seed: int) -> None:
    sim = run_schedule(seed)
    assert not sim.violations, describe(sim)
    owners = {(cls.__name__, name): owner for cls, fields in OWNERS.items()
              for name, owner in fields.items()}
    wrong = {key: sorted(writers) for key, writers in watched.items()
             if writers - {owners.get(key)}}
    assert not wrong, f"fields written outside their owner: {wrong}"
    assert watched[("ModelRuntime", "state")] == {"executor"}  # the schedule did run
