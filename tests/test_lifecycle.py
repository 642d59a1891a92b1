"""The model lifecycle (router.core.lifecycle): every status x event pair, and the flag cases."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest

from router.core.lifecycle import (
    ALREADY_RUNNING,
    CLOSING,
    CRASH_LOOP,
    EVENT_TYPES,
    IGNORED,
    NOT_RUNNING,
    STABLE_RUN_S,
    TABLE,
    Admitted,
    CancelDownload,
    CancelLoad,
    CancelReplacement,
    ChildGone,
    ChildStarted,
    Closing,
    Download,
    Downloaded,
    DownloadFailed,
    DownloadProgress,
    Drain,
    Event,
    Failure,
    FailureCounted,
    Forget,
    Forgotten,
    Idle,
    InvalidTransition,
    KillReplica,
    Listed,
    LoadEnded,
    LoadProgress,
    LoadWanted,
    ModelState,
    NobodyWaits,
    Publish,
    Queued,
    Ready,
    Refuse,
    ReplaceReplicas,
    ReplicaExited,
    ReplicaFailed,
    ReplicaStarted,
    ReplicaUnresponsive,
    Reset,
    Retire,
    SpawnFailed,
    StartLoad,
    Status,
    Stop,
    StopChildren,
    Stopped,
    Undrain,
    Unload,
    transition,
)

U, D, L, OK, S = (Status.UNLOADED, Status.DOWNLOADING, Status.LOADING, Status.LOADED,
                  Status.STOPPING)
LIMIT = 3


class Child:
    """A child as the lifecycle sees it: an identity with a pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid


class Rep:
    """A replica as the lifecycle sees it: an identity around a child."""

    def __init__(self, pid: int) -> None:
        self.child = Child(pid)


R1, R2 = Rep(7), Rep(8)

# One instance of each event type, for the status x event enumeration.
SAMPLES: dict[type, Event] = {
    Download: Download(), Downloaded: Downloaded(), DownloadFailed: DownloadFailed(),
    Admitted: Admitted(), Ready: Ready(), SpawnFailed: SpawnFailed(1), Stop: Stop("unloaded"),
    Stopped: Stopped(clean=True), Idle: Idle(), Drain: Drain("other"), Undrain: Undrain(),
    Unload: Unload(), LoadProgress: LoadProgress({"stages": 1, "current": 0, "value": 0.5}),
    DownloadProgress: DownloadProgress({"m.gguf": {"done": 1, "total": 2}}),
    Queued: Queued(0, 1.0), ReplicaStarted: ReplicaStarted(R1),
    ReplicaUnresponsive: ReplicaUnresponsive(R1, "frozen"),
    Retire: Retire("reconfigured", removed=False, idle=True),
    ReplicaExited: ReplicaExited(R1, 1, 5.0), ReplicaFailed: ReplicaFailed(),
    Reset: Reset(), LoadWanted: LoadWanted(), LoadEnded: LoadEnded(),
    ChildStarted: ChildStarted(R1.child), ChildGone: ChildGone(R1.child),
    Listed: Listed(), Forgotten: Forgotten(), NobodyWaits: NobodyWaits(), Closing: Closing(),
}

# status x event -> the status after it; None: explicitly ignored (no change, no effects).
EXPECTED: dict[tuple[Status, type], Status | None] = {
    (U, Download): D, (D, Downloaded): U, (D, DownloadFailed): U,
    (U, Admitted): L, (L, Ready): OK, (L, SpawnFailed): U,
    (OK, Stop): S, (S, Stopped): U, (OK, ReplicaExited): U, (OK, ReplicaFailed): OK,
    (OK, Idle): OK, (OK, Drain): OK, (OK, Undrain): OK,
    (U, Retire): U, (D, Retire): D, (L, Retire): L, (OK, Retire): S, (S, Retire): S,
    **{(status, Reset): status for status in Status},
    **{(status, Stop): None for status in (U, D, L, S)},
    **{(status, Idle): None for status in (U, D, L, S)},
    **{(status, Undrain): None for status in (U, D, L, S)},
    (U, Unload): U, (D, Unload): D, (L, Unload): L, (OK, Unload): S, (S, Unload): S,
    (L, LoadProgress): L, **{(status, LoadProgress): None for status in (U, D, OK, S)},
    (D, DownloadProgress): D, **{(status, DownloadProgress): None for status in (U, L, OK, S)},
    (U, Queued): U, **{(status, Queued): None for status in (D, L, OK, S)},
    (OK, ReplicaStarted): OK, **{(status, ReplicaStarted): None for status in (U, D, L, S)},
    (OK, ReplicaUnresponsive): OK,
    **{(status, ReplicaUnresponsive): None for status in (U, D, L, S)},
    **{(status, LoadWanted): status for status in Status},
    **{(status, LoadEnded): status for status in Status},
    **{(status, ChildStarted): status for status in Status},
    **{(status, ChildGone): status for status in Status},
    (U, Listed): U, (U, Forgotten): U,
    **{(status, NobodyWaits): status for status in Status},
    **{(status, Closing): status for status in Status},
}


def run(state: ModelState | Status, event: Event) -> tuple[ModelState, tuple[Any, ...]]:
    if isinstance(state, Status):
        state = ModelState(state)
    return transition("m", state, event, crash_loop_limit=LIMIT)


def test_every_event_type_has_a_sample() -> None:
    assert set(SAMPLES) == set(EVENT_TYPES)


@pytest.mark.parametrize(("status", "kind"), list(itertools.product(Status, EVENT_TYPES)),
                         ids=lambda v: getattr(v, "value", getattr(v, "__name__", str(v))))
def test_every_status_and_event(status: Status, kind: type) -> None:
    event = SAMPLES[kind]
    if (status, kind) not in EXPECTED:
        with pytest.raises(InvalidTransition) as raised:
            run(status, event)
        assert str(raised.value) == (f"model 'm': {kind.__name__} cannot happen while "
                                     f"{status.value}")
        return
    state, effects = run(status, event)
    expected = EXPECTED[(status, kind)]
    if expected is None:
        assert (state, effects) == (ModelState(status), ())
    else:
        assert state.status is expected


def test_the_table_is_exactly_the_documented_one() -> None:
    assert set(TABLE) | IGNORED == set(EXPECTED)
    assert {pair for pair, to in EXPECTED.items() if to is None} == IGNORED


def reachable_from(start: Status) -> set[Status]:
    seen, stack = {start}, [start]
    while stack:
        here = stack.pop()
        for (src, _), dst in EXPECTED.items():
            if src is here and dst is not None and dst not in seen:
                seen.add(dst)
                stack.append(dst)
    return seen


def test_every_status_is_reachable_and_can_end_unloaded() -> None:
    assert reachable_from(U) == set(Status)
    for status in Status:
        assert U in reachable_from(status)


# ----------------------------------------------------------------------------- events out

def published(effects: tuple[Any, ...]) -> list[tuple[str, dict[str, Any]]]:
    return [(e.kind, dict(e.data)) for e in effects if isinstance(e, Publish)]


def test_a_load_publishes_llama_cpp_shapes() -> None:
    state, effects = run(U, Admitted())
    assert published(effects) == [("model_status", {"status": "loading"})]
    state, effects = run(state, Ready((R1,), 5.0, None, {"duration": 1.5, "info": {"id": "m"}}))
    assert published(effects) == [("status_change", {"status": "loaded", "duration": 1.5,
                                                     "info": {"id": "m"}})]
    state, effects = run(state, Stop("unloaded"))
    assert published(effects) == [("stopping", {"status": "loaded", "reason": "unloaded"})]
    assert effects[1:] == (CancelReplacement(), StopChildren("unloaded", (R1,)))
    state, effects = run(state, Stopped(clean=True))
    assert published(effects) == [("status_change", {"status": "unloaded", "was_running": True,
                                                     "exit_code": 0})]
    _, effects = run(S, Stopped(clean=False))  # killed: no exit code
    assert published(effects) == [("status_change", {"status": "unloaded",
                                                     "was_running": True})]


def test_a_failed_load_counts_and_reports_its_exit_code() -> None:
    state, effects = run(L, SpawnFailed(exit_code=3))
    assert state == ModelState(U, failed=True, failures_in_row=1)
    assert effects[0] == FailureCounted(crash_loop=False)
    assert published(effects) == [("status_change", {
        "status": "unloaded", "was_running": True, "failed": True, "exit_code": 3})]
    state, _ = run(replace(state, status=L), Ready())
    assert not state.failed  # a good run clears it; the count stays until a stable run


def test_cancel_while_waiting_is_not_a_failure() -> None:
    state, effects = run(ModelState(L, failed=True), SpawnFailed(cancelled=True))
    assert state == ModelState(U)
    assert published(effects) == [("status_change", {"status": "unloaded", "was_running": True,
                                                     "reason": "cancelled"})]
    state, effects = run(D, DownloadFailed(cancelled=True))
    assert state == ModelState(U) and not any(isinstance(e, FailureCounted) for e in effects)


def test_a_failed_download_counts() -> None:
    state, effects = run(D, DownloadFailed(error="no such file"))
    assert state.failed and state.failures_in_row == 1
    assert published(effects) == [
        ("download_failed", {"error": "no such file"}),
        ("status_change", {"status": "unloaded", "was_running": False, "failed": True,
                           "exit_code": None})]


def test_failures_in_a_row_become_a_crash_loop_once() -> None:
    state = ModelState(L)
    counted = []
    for _ in range(LIMIT + 1):
        state, effects = run(replace(state, status=L), SpawnFailed(1))
        counted += [e for e in effects if isinstance(e, FailureCounted)]
    assert state.crash_loop and state.failures_in_row == LIMIT + 1
    assert [c.crash_loop for c in counted] == [False, False, True, False]
    state, _ = run(state, Reset())
    assert (state.crash_loop, state.failures_in_row, state.failed) == (False, 0, True)


def test_a_crash_after_a_stable_run_starts_the_count_again() -> None:
    state, _ = run(ModelState(OK, failures_in_row=2, replicas=(R1,)),
                   ReplicaExited(R1, 1, STABLE_RUN_S))
    assert state.failures_in_row == 1 and not state.crash_loop
    state, _ = run(ModelState(OK, failures_in_row=1, replicas=(R1,)), ReplicaExited(R1, 1, 1.0))
    assert state.failures_in_row == 2


def test_a_crash_of_one_replica_replaces_it() -> None:
    two = (R1, R2)
    state, effects = run(ModelState(OK, replicas=two), ReplicaExited(R1, 9, 1.0))
    assert state.status is OK and state.failed and state.replicas == (R2,)
    assert effects == (FailureCounted(False), ReplaceReplicas())
    # ... but not while draining or in a crash loop
    _, effects = run(ModelState(OK, draining=True, replicas=two), ReplicaExited(R1, 9, 1.0))
    assert ReplaceReplicas() not in effects
    _, effects = run(ModelState(OK, failures_in_row=LIMIT - 1, replicas=two),
                     ReplicaExited(R1, 9, 1.0))
    assert ReplaceReplicas() not in effects
    _, effects = run(OK, ReplicaFailed())
    assert effects == (FailureCounted(False), ReplaceReplicas())
    _, effects = run(ModelState(OK, failures_in_row=LIMIT - 1), ReplicaFailed())
    assert effects == (FailureCounted(True),)


def test_the_last_replica_crashing_unloads_and_stops_replacing() -> None:
    state, effects = run(ModelState(OK, draining=True, replicas=(R1,), loaded_at=3.0),
                         ReplicaExited(R1, 137, 1.0))
    assert state == ModelState(U, failed=True, failures_in_row=1)
    assert CancelReplacement() in effects
    assert published(effects) == [("status_change", {
        "status": "unloaded", "was_running": True, "failed": True, "exit_code": 137})]


def test_crash_while_draining_for_a_reconfiguration_loads_the_new_preset() -> None:
    state, _ = run(OK, Retire("reconfigured", removed=False, idle=False))
    assert state == ModelState(OK, draining=True, stop_when_idle="reconfigured",
                               restart_after_stop=True)
    state, effects = run(state, ReplicaExited(R1, 1, 1.0))
    assert state.status is U and not state.restart_after_stop and state.stop_when_idle is None
    assert effects[-1] == StartLoad() and state.load_pending and not state.load_on_demand


def test_a_drain_publishes_once() -> None:
    state, effects = run(OK, Drain("other"))
    assert state.draining
    assert published(effects) == [("status_change", {"status": "loaded", "draining": True})]
    assert run(state, Drain("third")) == (state, ())


def test_a_drain_stops_the_model_once_idle() -> None:
    state, _ = run(OK, Drain("other"))
    assert state.drained_for == "other" and state.stop_when_idle == "evicted"
    state, effects = run(state, Idle())
    assert state.status is S and StopChildren("evicted", ()) in effects


def test_a_drain_of_an_idle_model_stops_it_at_once() -> None:
    state, effects = run(OK, Drain("other", idle=True))
    assert state.status is S and StopChildren("evicted", ()) in effects


def test_undrain_lifts_a_drain_for_a_swap() -> None:
    drained, _ = run(OK, Drain("other"))
    state, effects = run(drained, Undrain())
    assert state == ModelState(OK)
    assert published(effects) == [("status_change", {"status": "loaded", "draining": False})]
    assert run(state, Idle()) == (state, ())  # serving again: the last request stops nothing


def test_undrain_leaves_a_reconfiguration_alone() -> None:
    drained, _ = run(OK, Drain("other"))
    retiring, _ = run(drained, Retire("reconfigured", removed=False, idle=False))
    assert run(retiring, Undrain()) == (retiring, ())
    state, effects = run(retiring, Idle())
    assert state.status is S and StopChildren("reconfigured", ()) in effects


def test_a_stop_ends_the_drain() -> None:
    drained, _ = run(OK, Drain("other"))
    stopping, _ = run(drained, Idle())
    state, _ = run(stopping, Stopped(clean=True))
    assert not state.draining and state.drained_for is None and state.stop_when_idle is None


def test_idle_stops_a_model_that_waits_for_it() -> None:
    assert run(OK, Idle()) == (ModelState(OK), ())
    state, effects = run(ModelState(OK, draining=True, stop_when_idle="removed"), Idle())
    assert state.status is S and StopChildren("removed", ()) in effects


def test_retire_a_loaded_model() -> None:
    state, effects = run(OK, Retire("reconfigured", removed=False, idle=True))
    assert state.status is S and state.restart_after_stop
    assert StopChildren("reconfigured", ()) in effects
    state, effects = run(state, Stopped(clean=True))
    assert state == ModelState(U, load_pending=True) and effects[-1] == StartLoad()
    state, _ = run(OK, Retire("removed", removed=True, idle=True))
    assert state.removed and not state.restart_after_stop
    state, effects = run(state, Stopped(clean=True))
    assert effects[-1] == Forget()


def test_retire_when_nothing_runs() -> None:
    assert run(U, Retire("reconfigured", removed=False, idle=True)) == (ModelState(U), ())
    state, effects = run(U, Retire("removed", removed=True, idle=True))
    assert state.removed and effects == (CancelLoad("removed"), Forget())


def test_reload_while_downloading_starts_over() -> None:
    state, effects = run(D, Retire("reconfigured", removed=False, idle=True))
    assert effects == (CancelDownload(), CancelLoad("reconfigured")) and state.restart_after_stop
    state, effects = run(state, DownloadFailed(cancelled=True))
    assert state.status is U and effects[-1] == StartLoad()
    state, _ = run(D, Retire("removed", removed=True, idle=True))
    _, effects = run(state, DownloadFailed(cancelled=True))
    assert effects[-1] == Forget()


def test_reload_while_loading_cancels_and_loads_again() -> None:
    state, effects = run(L, Retire("reconfigured", removed=False, idle=True))
    assert effects == (CancelLoad("reconfigured"),)
    state, effects = run(state, SpawnFailed(cancelled=True))
    assert state == ModelState(U, load_pending=True) and effects[-1] == StartLoad()


def test_informational_events_are_published_as_effects() -> None:
    progress = {"m.gguf": {"done": 1, "total": 2}}
    assert published(run(D, DownloadProgress(progress))[1]) == [
        ("download_progress", {"progress": progress})]
    _, effects = run(D, Downloaded())
    assert [kind for kind, _ in published(effects)] == ["download_finished", "status_change"]
    _, effects = run(D, DownloadFailed(error="boom"))
    assert published(effects)[0] == ("download_failed", {"error": "boom"})
    assert published(run(U, Queued(2, 3.5))[1]) == [
        ("queued", {"position": 2, "expected_wait_s": 3.5})]
    state, effects = run(ModelState(OK, replicas=(R1,), starting=(R2.child,)), ReplicaStarted(R2))
    assert published(effects) == [("replica_restarted", {"pid": 8, "replicas": 2})]
    assert state.replicas == (R1, R2) and state.starting == ()
    assert published(run(U, Listed())[1]) == [("model_status", {"status": "unloaded"})]
    assert published(run(U, Forgotten())[1]) == [("model_remove", {})]


def test_an_unresponsive_replica_is_taken_out_and_killed_through_the_lifecycle() -> None:
    state, effects = run(ModelState(OK, replicas=(R1, R2)), ReplicaUnresponsive(R1, "frozen"))
    assert state == ModelState(OK, replicas=(R2,), killed=((R1, "frozen"),))  # why, kept
    assert published(effects) == [("unresponsive", {"pid": 7, "reason": "frozen"})]
    assert KillReplica(R1, "frozen") in effects
    assert run(state, ReplicaUnresponsive(R1, "frozen")) == (state, ())  # already out
    failure = Failure("frozen", -9, (), clock_at=3.0)
    state, effects = run(state, ReplicaExited(R1, -9, 1.0, failure))  # a crash, R2 serves
    assert state.status is OK and state.replicas == (R2,) and ReplaceReplicas() in effects
    assert state.killed == () and state.failure is failure  # its exit reported, with why


def test_load_progress_is_published_once_per_change_and_cleared_after_the_load() -> None:
    progress = {"stages": 2, "current": 1, "value": 0.25}
    state, effects = run(L, LoadProgress(progress))
    assert state.progress == progress
    assert published(effects) == [("status_change", {"status": "loading",
                                                      "progress": progress})]
    assert run(state, LoadProgress(dict(progress))) == (state, ())
    assert run(state, Ready())[0].progress is None
    assert run(state, SpawnFailed(1))[0].progress is None


def test_unload_stops_a_loaded_model_and_cancels_a_load_waiting_for_it() -> None:
    state, effects = run(ModelState(OK, replicas=(R1, R2)), Unload())
    assert state.status is S and state.replicas == () and state.stopping == (R1, R2)
    assert effects[0] == CancelLoad("unloaded")
    assert StopChildren("unloaded", (R1, R2)) in effects
    assert published(effects) == [("stopping", {"status": "loaded", "reason": "unloaded"})]
    state, _ = run(state, Stopped(clean=True))
    assert state.stopping == () and state.status is U


def test_unload_cancels_a_download_or_load() -> None:
    assert run(D, Unload()) == (ModelState(D), (CancelDownload(), CancelLoad("unloaded")))
    assert run(L, Unload()) == (ModelState(L), (CancelLoad("unloaded"),))
    queued = ModelState(U, load_pending=True)
    assert run(queued, Unload()) == (queued, (CancelLoad("unloaded"),))


def test_an_explicit_unload_of_a_model_that_does_not_run_is_refused() -> None:
    assert run(U, Unload()) == (ModelState(U), (Refuse(NOT_RUNNING),))
    assert run(S, Unload()) == (ModelState(S), (Refuse(NOT_RUNNING),))
    # a load waiting for the old child to stop is cancelled
    assert run(ModelState(S, load_pending=True), Unload())[1] == (CancelLoad("unloaded"),)
    # deleting a cache model unloads it whatever it does
    assert run(U, Unload(explicit=False)) == (ModelState(U), (CancelLoad("unloaded"),))


def test_an_explicit_load_runs_only_from_unloaded_and_clears_a_crash_loop() -> None:
    for status in (D, L, OK, S):
        assert run(status, LoadWanted(explicit=True)) == (ModelState(status),
                                                          (Refuse(ALREADY_RUNNING),))
    looping = ModelState(U, failed=True, failures_in_row=LIMIT, crash_loop=True)
    state, effects = run(looping, LoadWanted(explicit=True))
    assert effects == (StartLoad(on_demand=False),)
    assert state == ModelState(U, failed=True, load_pending=True)
    # a load that requests started becomes explicit: it goes on when they leave
    state, effects = run(ModelState(U, load_pending=True, load_on_demand=True),
                         LoadWanted(explicit=True))
    assert effects == () and state == ModelState(U, load_pending=True)


def test_a_request_starts_one_load_and_is_refused_in_a_crash_loop() -> None:
    state, effects = run(U, LoadWanted(on_demand=True))
    assert effects == (StartLoad(on_demand=True),)
    assert state == ModelState(U, load_pending=True, load_on_demand=True)
    assert run(state, LoadWanted(on_demand=True)) == (state, ())  # one load task
    # a model that is loaded but draining or stopping: the load waits for the old child
    state, effects = run(ModelState(S), LoadWanted(on_demand=True))
    assert effects == (StartLoad(on_demand=True),) and state.load_pending
    looping = ModelState(U, crash_loop=True, failures_in_row=LIMIT)
    assert run(looping, LoadWanted(on_demand=True)) == (looping, (Refuse(CRASH_LOOP),))
    assert run(looping, LoadWanted()) == (looping, (Refuse(CRASH_LOOP),))  # startup, reload
    state, _ = run(ModelState(U, load_pending=True, load_on_demand=True), LoadEnded())
    assert state == ModelState(U)


def test_a_reconfigured_model_in_a_crash_loop_is_not_restarted() -> None:
    retiring = ModelState(OK, restart_after_stop=True, crash_loop=True, draining=True,
                          stop_when_idle="reconfigured", replicas=(R1,))
    state, effects = run(retiring, ReplicaExited(R1, 1, 1.0))
    assert state.status is U and not state.load_pending and StartLoad() not in effects


def test_children_pass_from_starting_to_serving_to_stopping() -> None:
    state, _ = run(L, ChildStarted(R1.child))
    state, _ = run(state, ChildStarted(R2.child))
    state, _ = run(state, ChildGone(R2.child))  # its port was taken: it never served
    assert state.starting == (R1.child,)
    state, _ = run(state, Ready((R1,), 12.5, {"id": "m"}))
    assert (state.starting, state.replicas, state.loaded_at) == ((), (R1,), 12.5)
    assert state.info == {"id": "m"}
    state, effects = run(state, Stop("idle"))
    assert (state.replicas, state.stopping) == ((), (R1,))
    assert StopChildren("idle", (R1,)) in effects
    state, _ = run(state, Stopped(clean=True))
    assert (state.stopping, state.info, state.loaded_at) == ((), None, None)


def test_unload_drops_the_restart_of_a_reconfiguration() -> None:
    retiring, _ = run(OK, Retire("reconfigured", removed=False, idle=False))
    state, _ = run(retiring, Unload())
    assert state.status is S and not state.restart_after_stop
    state, effects = run(state, Stopped(clean=True))
    assert state.status is U and StartLoad() not in effects
    state, _ = run(L, Retire("reconfigured", removed=False, idle=True))
    assert not run(state, Unload())[0].restart_after_stop


def test_unload_while_stopping_or_queued_changes_nothing() -> None:
    assert run(S, Stop("unloaded")) == (ModelState(S), ())
    assert run(U, Stop("unloaded")) == (ModelState(U), ())  # queued: the load is cancelled
    state, _ = run(S, Retire("removed", removed=True, idle=True))
    assert state == ModelState(S, removed=True)


def test_a_load_nobody_waits_for_is_cancelled_unless_it_spawns() -> None:
    for status in (U, OK, S):  # queued, or waiting for the model's old child
        pending = ModelState(status, load_pending=True, load_on_demand=True)
        assert run(pending, NobodyWaits()) == (pending, (CancelLoad("no request waits for it"),))
    for status in (D, L):  # downloading or spawning: let it finish
        pending = ModelState(status, load_pending=True, load_on_demand=True)
        assert run(pending, NobodyWaits()) == (pending, ())
    explicit = ModelState(U, load_pending=True)
    assert run(explicit, NobodyWaits()) == (explicit, ())


def test_once_closing_no_load_starts() -> None:
    state, effects = run(ModelState(L, load_pending=True, restart_after_stop=True), Closing())
    assert effects == (CancelDownload(), CancelLoad("shutdown"))
    assert state.closing and not state.restart_after_stop
    state, _ = run(state, SpawnFailed(cancelled=True))
    state, _ = run(state, LoadEnded())
    for wanted in (LoadWanted(on_demand=True), LoadWanted(explicit=True), LoadWanted()):
        assert run(state, wanted) == (state, (Refuse(CLOSING),))
    retiring, _ = run(replace(state, status=OK), Retire("reconfigured", removed=False, idle=True))
    _, effects = run(retiring, Stopped(clean=True))
    assert StartLoad() not in effects  # a reload during shutdown restarts nothing
