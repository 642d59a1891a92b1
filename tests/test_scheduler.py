"""Exhaustive unit tests for router.core.scheduler.plan_admission (a pure function)."""

from __future__ import annotations

import itertools

import pytest

from router.core.scheduler import (
    EVICTION_POLICIES,
    AdmissionPlan,
    ModelUse,
    Status,
    plan_admission,
)

U, LOADING, L, S = Status.UNLOADED, Status.LOADING, Status.LOADED, Status.STOPPING


def snap(model_id: str, status: Status, in_flight: int = 0, last_used: float = 0.0,
         gpu: int = 0, device_open: bool = False) -> ModelUse:
    return ModelUse(model_id, status, in_flight, last_used,
                    devices={"gpu0": gpu} if gpu else {}, gpu=device_open)


def test_status_values_and_holds_process() -> None:
    assert [s.value for s in Status] == ["unloaded", "downloading", "loading", "loaded",
                                         "stopping"]
    assert not U.holds_process and not Status.DOWNLOADING.holds_process
    assert LOADING.holds_process and L.holds_process and S.holds_process
    assert AdmissionPlan(admit=True).evict == ()


@pytest.mark.parametrize("models_max", [0, -1])
def test_unlimited(models_max: int) -> None:
    models = [snap(f"m{i}", L) for i in range(50)]
    assert plan_admission(models, "new", models_max) == AdmissionPlan(admit=True)


def test_empty_snapshot() -> None:
    assert plan_admission([], "new", 1) == AdmissionPlan(admit=True)


def test_room_available() -> None:
    models = [snap("a", L), snap("b", LOADING), snap("c", U), snap("d", U)]
    assert plan_admission(models, "new", 3) == AdmissionPlan(admit=True)


def test_unloaded_models_use_no_slot() -> None:
    models = [snap(f"u{i}", U) for i in range(10)]
    assert plan_admission(models, "new", 1) == AdmissionPlan(admit=True)


def test_full_evicts_least_recently_used_idle() -> None:
    models = [snap("a", L, last_used=30.0), snap("b", L, last_used=10.0),
              snap("c", L, last_used=20.0)]
    assert plan_admission(models, "new", 3) == AdmissionPlan(admit=False, evict=("b",))


def test_lru_ties_broken_by_id() -> None:
    models = [snap("zeta", L, last_used=5.0), snap("alpha", L, last_used=5.0),
              snap("mid", L, last_used=9.0)]
    assert plan_admission(models, "new", 3) == AdmissionPlan(admit=False, evict=("alpha",))
    assert plan_admission(list(reversed(models)), "new", 3).evict == ("alpha",)


def test_never_evicts_loading_models() -> None:
    models = [snap("loading", LOADING, last_used=0.0), snap("old", L, last_used=5.0)]
    assert plan_admission(models, "new", 2) == AdmissionPlan(admit=False, evict=("old",))


def test_never_evicts_models_with_requests_in_flight() -> None:
    models = [snap("busy", L, in_flight=1, last_used=0.0), snap("idle", L, last_used=99.0)]
    assert plan_admission(models, "new", 2) == AdmissionPlan(admit=False, evict=("idle",))


def test_all_busy_admits_nothing_and_evicts_nothing() -> None:
    models = [snap("a", L, in_flight=2), snap("b", LOADING), snap("c", L, in_flight=1)]
    assert plan_admission(models, "new", 3) == AdmissionPlan(admit=False, evict=())


def test_a_stopping_cpu_model_frees_its_slot_at_once() -> None:
    # Its host memory counts until it exits (the memory budget), its model slot no longer.
    models = [snap("a", L, in_flight=1), snap("s", S)]
    assert plan_admission(models, "new", 2) == AdmissionPlan(admit=True)
    assert plan_admission(models, "new", 1) == AdmissionPlan(admit=False, evict=())


def test_a_stopping_gpu_model_holds_its_slot_until_it_exits() -> None:
    # Its GPU memory is freed at its exit, and a device may have no budget to check it by:
    # measured by nvidia-smi, or a device still open (any vendor's, or not known).
    for stopping in (snap("s", S, gpu=1 << 30),
                     ModelUse("s", S, devices={"gpu0": 0}, gpu=True)):
        models = [snap("a", L, in_flight=1), stopping]
        assert plan_admission(models, "new", 2) == AdmissionPlan(admit=False, evict=())


def test_stopping_models_reduce_what_must_be_evicted() -> None:
    # 3 slots used of 2: one must go for the target; the stopping one is already going.
    models = [snap("a", L, last_used=1.0), snap("b", L, last_used=2.0), snap("s", S)]
    assert plan_admission(models, "new", 2) == AdmissionPlan(admit=False, evict=("a",))


def test_stopping_model_alone_covers_the_need() -> None:
    models = [snap("a", L, last_used=1.0), snap("s", S, gpu=1 << 30)]
    assert plan_admission(models, "new", 2) == AdmissionPlan(admit=False, evict=())


def test_stopping_models_are_never_evicted_again() -> None:
    models = [snap("s1", S, last_used=0.0), snap("s2", S, last_used=0.0), snap("a", L)]
    # 3 used of 1: both stopping ones are already going, so only "a" must be evicted.
    assert plan_admission(models, "new", 1) == AdmissionPlan(admit=False, evict=("a",))


def test_over_capacity_needs_several_evictions() -> None:
    # models_max was lowered to 2 while 5 were loaded: 5 - 2 + 1 = 4 must go.
    models = [snap(f"m{i}", L, last_used=float(i)) for i in range(5)]
    assert plan_admission(models, "new", 2) == AdmissionPlan(admit=False,
                                                         evict=("m0", "m1", "m2", "m3"))


def test_over_capacity_evicts_only_what_is_idle() -> None:
    models = [snap("m0", L, last_used=0.0, in_flight=1), snap("m1", L, last_used=1.0),
              snap("m2", LOADING), snap("m3", L, last_used=3.0), snap("m4", L, last_used=4.0)]
    assert plan_admission(models, "new", 2) == AdmissionPlan(admit=False,
                                                         evict=("m1", "m3", "m4"))


@pytest.mark.parametrize("target_status", list(Status))
def test_target_itself_is_not_counted(target_status: Status) -> None:
    models = [snap("target", target_status, last_used=0.0), snap("a", L, last_used=5.0)]
    assert plan_admission(models, "target", 2) == AdmissionPlan(admit=True)


@pytest.mark.parametrize("target_status", list(Status))
def test_target_itself_is_never_evicted(target_status: Status) -> None:
    models = [snap("target", target_status, last_used=0.0), snap("a", L, last_used=5.0)]
    assert plan_admission(models, "target", 1) == AdmissionPlan(admit=False, evict=("a",))


def test_models_max_one() -> None:
    assert plan_admission([snap("a", L)], "b", 1) == AdmissionPlan(admit=False, evict=("a",))
    assert plan_admission([snap("a", U)], "b", 1) == AdmissionPlan(admit=True)
    assert plan_admission([snap("a", LOADING)], "b", 1) == AdmissionPlan(admit=False)


def _reference(models: list[ModelUse], target: str, models_max: int) -> AdmissionPlan:
    """An independent restatement of the policy, used to check every small snapshot."""
    if models_max <= 0:
        return AdmissionPlan(True)
    others = [m for m in models if m.id != target]
    using = [m for m in others if m.status is not Status.UNLOADED  # a stopping CPU model: no
             and (m.status is not Status.STOPPING or m.devices or m.gpu)]
    if len(using) < models_max:
        return AdmissionPlan(True)
    going = [m for m in using if m.status is Status.STOPPING]
    must_go = len(using) + 1 - models_max - len(going)
    if must_go <= 0:
        return AdmissionPlan(False)
    candidates = [m for m in others if m.status is Status.LOADED and not m.in_flight]
    candidates.sort(key=lambda m: (m.last_used, m.id))
    return AdmissionPlan(False, tuple(m.id for m in candidates[:must_go]))


def test_exhaustive_small_snapshots() -> None:
    kinds = [(U, 0, 0, False), (LOADING, 0, 0, False), (L, 0, 0, False), (L, 1, 0, False),
             (S, 0, 0, False), (S, 0, 1, False), (S, 0, 0, True)]
    checked = 0
    for n in range(4):
        for combo in itertools.product(kinds, repeat=n):
            models = [snap(f"m{i}", status, in_flight, last_used=float((i * 7) % 3), gpu=gpu,
                           device_open=device_open)
                      for i, (status, in_flight, gpu, device_open) in enumerate(combo)]
            for models_max in range(4):
                plan = plan_admission(models, "target", models_max)
                assert plan == _reference(models, "target", models_max), (models, models_max)
                # invariants: evictions are idle loaded models, never the target
                idle = {m.id for m in models if m.status is L and m.in_flight == 0}
                assert set(plan.evict) <= idle
                assert "target" not in plan.evict
                assert not (plan.admit and plan.evict)
                checked += 1
    assert checked == 4 * sum(7 ** n for n in range(4))


# --------------------------------------------------------------------------- bytes and fairness

def m(mid: str, status: Status = Status.LOADED, in_flight: int = 0, last_used: float = 0.0,
      memory: int = 0, draining: bool = False) -> ModelUse:
    return ModelUse(mid, status, in_flight, last_used, memory, draining)


def test_memory_fits_without_eviction() -> None:
    plan = plan_admission([m("a", memory=40)], "t", 0, target_memory=50, memory_budget=100)
    assert plan == AdmissionPlan(admit=True)


def test_memory_evicts_lru_idle_until_it_fits() -> None:
    models = [m("a", last_used=1, memory=40), m("b", last_used=2, memory=40),
              m("c", last_used=3, memory=10)]
    plan = plan_admission(models, "t", 0, target_memory=50, memory_budget=100)
    assert plan == AdmissionPlan(admit=False, evict=("a",))


def test_memory_evicts_several_when_one_is_not_enough() -> None:
    models = [m("a", last_used=1, memory=30), m("b", last_used=2, memory=30),
              m("c", last_used=3, memory=30)]
    plan = plan_admission(models, "t", 0, target_memory=60, memory_budget=100)
    assert plan.evict == ("a", "b")


def test_memory_of_stopping_models_counts_as_freeing() -> None:
    models = [m("a", Status.STOPPING, memory=60), m("b", last_used=1, memory=30)]
    plan = plan_admission(models, "t", 0, target_memory=50, memory_budget=100)
    assert plan == AdmissionPlan(admit=False)


def test_a_model_larger_than_the_budget_is_refused_without_evicting() -> None:
    plan = plan_admission([m("a", memory=10)], "t", 0, target_memory=101, memory_budget=100)
    assert not plan.admit and plan.evict == () and plan.refuse is not None
    assert "101" in plan.refuse and "100" in plan.refuse


def test_count_and_bytes_both_apply() -> None:
    # Count allows it (max 3) but bytes do not: evict by bytes.
    models = [m("a", last_used=1, memory=80), m("b", last_used=2, memory=10)]
    plan = plan_admission(models, "t", 3, target_memory=20, memory_budget=100)
    assert plan.evict == ("a",)
    # Bytes allow it but the count does not.
    plan = plan_admission(models, "t", 2, target_memory=1, memory_budget=100)
    assert plan.evict == ("a",)


def test_busy_models_are_not_drained_before_the_fairness_bound() -> None:
    models = [m("a", in_flight=2)]
    plan = plan_admission(models, "t", 1, waited_s=5, fairness_s=10)
    assert plan == AdmissionPlan(admit=False)


def test_after_the_fairness_bound_the_lru_busy_model_drains() -> None:
    models = [m("a", in_flight=2, last_used=5), m("b", in_flight=1, last_used=1)]
    plan = plan_admission(models, "t", 2, waited_s=10, fairness_s=10)
    assert plan == AdmissionPlan(admit=False, drain=("b",))


def test_only_one_model_drains_at_a_time() -> None:
    models = [m("a", in_flight=2, last_used=5), m("b", in_flight=1, last_used=1, draining=True)]
    plan = plan_admission(models, "t", 2, waited_s=30, fairness_s=10)
    assert plan.drain == ()


def test_a_drained_model_that_went_idle_is_evicted() -> None:
    models = [m("a", in_flight=0, last_used=9, draining=True), m("b", in_flight=3)]
    plan = plan_admission(models, "t", 2, waited_s=30, fairness_s=10)
    assert plan == AdmissionPlan(admit=False, evict=("a",))


def test_models_with_queued_requests_are_not_evicted() -> None:
    models = [ModelUse("a", Status.LOADED, 0, 1.0, 0, False, waiting=3),
              ModelUse("b", Status.LOADED, 0, 2.0)]
    plan = plan_admission(models, "t", 2)
    assert plan == AdmissionPlan(admit=False, evict=("b",))


def test_loading_models_are_never_drained() -> None:
    models = [m("a", Status.LOADING, in_flight=0)]
    plan = plan_admission(models, "t", 1, waited_s=30, fairness_s=10)
    assert plan == AdmissionPlan(admit=False)


# --- GPU devices: one pool each, next to host RAM ------------------------------------------

def gpu(model_id: str, status: Status, devices: dict[str, int], ram: int = 0,
        last_used: float = 0.0, in_flight: int = 0) -> ModelUse:
    return ModelUse(model_id, status, in_flight, last_used, memory=ram, devices=devices)


def test_a_model_on_another_gpu_is_left_alone() -> None:
    models = [gpu("on1", L, {"gpu1": 30}, last_used=1.0),  # least recently used
              gpu("on0", L, {"gpu0": 30}, last_used=2.0)]
    plan = plan_admission(models, "new", 0, target_devices={"gpu0": 30},
                          device_budgets={"gpu0": 40, "gpu1": 40})
    assert plan == AdmissionPlan(admit=False, evict=("on0",))


def test_fits_when_each_device_has_room() -> None:
    models = [gpu("a", L, {"gpu0": 20, "gpu1": 20})]
    plan = plan_admission(models, "new", 0, target_devices={"gpu0": 20, "gpu1": 20},
                          device_budgets={"gpu0": 40, "gpu1": 40})
    assert plan == AdmissionPlan(admit=True)


def test_split_model_frees_both_devices() -> None:
    models = [gpu("split", L, {"gpu0": 20, "gpu1": 20}, last_used=1.0),
              gpu("solo", L, {"gpu1": 10}, last_used=2.0)]
    plan = plan_admission(models, "new", 0, target_devices={"gpu0": 30},
                          device_budgets={"gpu0": 40, "gpu1": 40})
    assert plan == AdmissionPlan(admit=False, evict=("split",))


def test_ram_and_gpu_both_must_fit() -> None:
    models = [gpu("ram-heavy", L, {}, ram=90, last_used=1.0),
              gpu("gpu-heavy", L, {"gpu0": 90}, last_used=2.0)]
    plan = plan_admission(models, "new", 0, target_memory=20, memory_budget=100,
                          target_devices={"gpu0": 20}, device_budgets={"gpu0": 100})
    assert plan == AdmissionPlan(admit=False, evict=("ram-heavy", "gpu-heavy"))


def test_a_device_without_a_budget_is_not_checked() -> None:
    models = [gpu("a", L, {"gpu0": 1000})]
    assert plan_admission(models, "new", 0, target_devices={"gpu0": 1000},
                          device_budgets={}) == AdmissionPlan(admit=True)


def test_larger_than_a_device_budget_is_refused_naming_the_device() -> None:
    plan = plan_admission([], "new", 0, target_devices={"gpu1": 50},
                          device_budgets={"gpu0": 100, "gpu1": 40})
    assert not plan.admit and plan.refuse is not None
    assert "gpu1" in plan.refuse and "50" in plan.refuse and "40" in plan.refuse


def test_busy_model_on_the_needed_gpu_is_the_one_drained() -> None:
    models = [gpu("other", L, {"gpu1": 30}, last_used=1.0, in_flight=1),
              gpu("same", L, {"gpu0": 30}, last_used=2.0, in_flight=1)]
    plan = plan_admission(models, "new", 0, target_devices={"gpu0": 30},
                          device_budgets={"gpu0": 40, "gpu1": 40}, waited_s=20, fairness_s=10)
    assert plan == AdmissionPlan(admit=False, drain=("same",))


def test_brute_force_devices_eviction_is_minimal_lru_and_sufficient() -> None:
    """Every mix of three idle models on two GPUs: the plan frees enough on the devices the
    new model needs, and evicts only models holding memory there."""
    placements = [{}, {"gpu0": 30}, {"gpu1": 30}, {"gpu0": 15, "gpu1": 15}]
    budgets = {"gpu0": 50, "gpu1": 50}
    for combo in itertools.product(placements, repeat=3):
        for target in placements[1:]:
            models = [gpu(f"m{i}", L, dict(p), last_used=float(i)) for i, p in enumerate(combo)]
            plan = plan_admission(models, "new", 0, target_devices=target,
                                  device_budgets=budgets)
            assert plan.refuse is None
            if plan.admit:
                assert plan.evict == ()
            kept = [m for m in models if m.id not in plan.evict]
            for pool in target:  # a device the load does not touch is not its business
                budget = budgets[pool]
                used = sum(m.devices.get(pool, 0) for m in kept) + target.get(pool, 0)
                assert used <= budget, (combo, target, plan)
            for victim in plan.evict:
                held = next(m for m in models if m.id == victim).devices
                assert any(held.get(pool, 0) for pool in target), (combo, target, plan)


def test_a_new_eviction_policy_is_one_entry_of_the_table(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The newcomer's change (docs/architecture.md): a policy is an order over ``ModelUse``
    named in ``EVICTION_POLICIES``; the planner takes idle models and the one to drain in
    its order, and nothing else changes."""
    from types import MappingProxyType

    from router.core import scheduler

    models = [ModelUse("old", Status.LOADED, last_used=1.0),
              ModelUse("new-ish", Status.LOADED, last_used=5.0)]
    assert plan_admission(models, "x", 2).evict == ("old",)  # lru, the router's
    most_recent = MappingProxyType({**scheduler.EVICTION_POLICIES,
                                    "mru": lambda m: (-m.last_used, m.id)})
    monkeypatch.setattr(scheduler, "EVICTION_POLICIES", most_recent)
    assert plan_admission(models, "x", 2, eviction="mru").evict == ("new-ish",)
    busy = [ModelUse("old", Status.LOADED, last_used=1.0, in_flight=1),
            ModelUse("new-ish", Status.LOADED, last_used=5.0, in_flight=1)]
    assert plan_admission(busy, "x", 2, waited_s=9, fairness_s=1, eviction="mru").drain == \
        ("new-ish",)


# --------------------------------------------------------------------------- residency

def res(mid: str, status: Status = Status.LOADED, in_flight: int = 0, last_used: float = 0.0,
        memory: int = 0, pinned: bool = False, resident_until: float | None = None,
        devices: dict[str, int] | None = None) -> ModelUse:
    return ModelUse(mid, status, in_flight, last_used, memory, devices=devices or {},
                    pinned=pinned, resident_until=resident_until)


@pytest.mark.parametrize("eviction", sorted(EVICTION_POLICIES))
def test_a_pinned_idle_model_is_never_chosen_for_eviction(eviction: str) -> None:
    """Under every policy: the pinned model is the first in any order (least recently used,
    and first by id), yet the one evicted is the other, for a model slot or for memory."""
    models = [res("a", last_used=0.0, memory=50, pinned=True), res("b", last_used=9.0,
                                                                   memory=50)]
    plan = plan_admission(models, "t", 2, eviction=eviction)
    assert plan == AdmissionPlan(admit=False, evict=("b",))
    plan = plan_admission(models, "t", 0, target_memory=50, memory_budget=120,
                          eviction=eviction)
    assert plan == AdmissionPlan(admit=False, evict=("b",))
    on_gpu = [res("a", devices={"gpu0": 30}, pinned=True), res("b", last_used=9.0,
                                                               devices={"gpu0": 30})]
    plan = plan_admission(on_gpu, "t", 0, target_devices={"gpu0": 30},
                          device_budgets={"gpu0": 70}, eviction=eviction)
    assert plan == AdmissionPlan(admit=False, evict=("b",))


@pytest.mark.parametrize("eviction", sorted(EVICTION_POLICIES))
def test_a_pinned_busy_model_is_never_drained(eviction: str) -> None:
    models = [res("a", in_flight=1, pinned=True), res("b", in_flight=1, last_used=9.0)]
    plan = plan_admission(models, "t", 2, waited_s=60, fairness_s=10, eviction=eviction)
    assert plan == AdmissionPlan(admit=False, drain=("b",))


def test_every_small_snapshot_keeps_its_pins() -> None:
    """Every mix of up to three models (idle, busy, loading, stopping; pinned or not) under
    every limit: no pinned model is ever evicted or drained, and a refusal names exactly the
    pins loading or loaded when they alone fill --models-max."""
    kinds = [(L, 0), (L, 1), (LOADING, 0), (S, 0)]
    for n in range(1, 4):
        for combo in itertools.product(kinds, (False, True), repeat=n):
            pairs = list(zip(combo[::2], combo[1::2], strict=True))
            models = [res(f"m{i}", status, in_flight, last_used=float(i), pinned=pinned)
                      for i, ((status, in_flight), pinned) in enumerate(pairs)]
            pins = {m.id for m in models if m.pinned and m.status in (L, LOADING)}
            for models_max in range(1, 4):
                for eviction in EVICTION_POLICIES:
                    plan = plan_admission(models, "t", models_max, waited_s=99,
                                          fairness_s=1, eviction=eviction)
                    assert not pins & set(plan.evict + plan.drain), (models, plan)
                    refused = len(pins) >= models_max
                    assert (plan.refuse is not None) == refused, (models, models_max, plan)
                    assert set(plan.pinned) == (pins if refused else set())


def test_with_all_room_held_by_pins_the_plan_refuses_naming_them() -> None:
    models = [res("a", pinned=True), res("c", Status.LOADING, pinned=True), res("b", U)]
    plan = plan_admission(models, "b", 2)
    assert not plan.admit and plan.pinned == ("a", "c") and plan.evict == ()
    assert plan.refuse == ("--models-max 2 is held by pinned models: a, c (pin = true); "
                           "unload one with POST /models/unload or raise --models-max")
    # a pinned model that is stopping (unloaded explicitly) is leaving: the load waits for it
    stopping = [res("a", S, pinned=True, devices={"gpu0": 5})]  # holds its slot until gone
    assert plan_admission(stopping, "b", 1) == AdmissionPlan(admit=False)
    # room held by a pin and by a model that may go: no refusal, the other one goes
    mixed = [res("a", pinned=True), res("d", last_used=5.0)]
    assert plan_admission(mixed, "b", 2) == AdmissionPlan(admit=False, evict=("d",))


def test_with_the_memory_budget_held_by_pins_the_plan_refuses_naming_them() -> None:
    gib = 1 << 30
    models = [res("a", memory=6 * gib, pinned=True), res("d", memory=1 * gib)]
    plan = plan_admission(models, "b", 0, target_memory=3 * gib, memory_budget=8 * gib)
    assert plan.pinned == ("a",)
    assert plan.refuse == ("the memory budget (8.0 GiB) is held by pinned models: a (pin = "
                           "true), which leave 2.0 GiB of the 3.0 GiB it needs; unload one "
                           "with POST /models/unload or raise --memory-budget")
    on_gpu = [res("a", devices={"gpu1": 30}, pinned=True)]
    plan = plan_admission(on_gpu, "b", 0, target_devices={"gpu1": 30},
                          device_budgets={"gpu1": 50})
    assert plan.pinned == ("a",) and plan.refuse is not None
    assert "memory budget of gpu1" in plan.refuse and "--gpu-memory-budget" in plan.refuse
    # a pin on another GPU is not in the way
    elsewhere = plan_admission(on_gpu, "b", 0, target_devices={"gpu0": 30},
                               device_budgets={"gpu0": 50, "gpu1": 50})
    assert elsewhere == AdmissionPlan(admit=True)


@pytest.mark.parametrize("eviction", sorted(EVICTION_POLICIES))
def test_min_resident_protects_a_model_loaded_less_than_its_time_ago(eviction: str) -> None:
    """Loaded at 100 with ``min-resident = 30``: not evicted at 110 (the plan says to plan
    again at 130), evicted at 130; another idle model may go meanwhile."""
    models = [res("a", resident_until=130.0)]
    plan = plan_admission(models, "b", 1, now=110.0, eviction=eviction)
    assert plan == AdmissionPlan(admit=False, wake_at=130.0)
    assert plan_admission(models, "b", 1, now=130.0, eviction=eviction) == \
        AdmissionPlan(admit=False, evict=("a",))
    two = [res("a", resident_until=130.0), res("c", last_used=50.0)]
    assert plan_admission(two, "b", 2, now=110.0, eviction=eviction) == \
        AdmissionPlan(admit=False, evict=("c",))


def test_min_resident_holds_off_the_fairness_drain_until_it_ends() -> None:
    busy = [res("a", in_flight=1, resident_until=130.0)]
    plan = plan_admission(busy, "b", 1, waited_s=20, fairness_s=10, now=110.0)
    assert plan == AdmissionPlan(admit=False, wake_at=130.0)
    plan = plan_admission(busy, "b", 1, waited_s=40, fairness_s=10, now=130.0)
    assert plan == AdmissionPlan(admit=False, drain=("a",))


def test_wake_at_names_the_earliest_residency_that_would_help() -> None:
    models = [res("a", memory=10, resident_until=140.0), res("c", resident_until=125.0),
              res("d", resident_until=120.0, devices={"gpu1": 10})]
    # RAM is short: c and d hold none, so only a's residency is waited for
    plan = plan_admission(models, "b", 0, target_memory=10, memory_budget=15, now=110.0)
    assert plan == AdmissionPlan(admit=False, wake_at=140.0)
    plan = plan_admission(models, "b", 3, now=110.0)
    assert plan == AdmissionPlan(admit=False, wake_at=120.0)
    # a residency that has ended is no protection; a pin has none to wait for
    assert plan_admission([res("a", resident_until=100.0)], "b", 1, now=110.0).evict == ("a",)
    assert plan_admission([res("a", pinned=True, resident_until=130.0),
                           res("c", resident_until=130.0)], "b", 2, now=110.0).wake_at \
        == 130.0
