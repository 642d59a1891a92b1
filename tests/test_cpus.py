"""CPU sharing: the pure allocation of cores to children, and reading the machine's cores."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from router.children.process import ChildProcess
from router.config.presets import ModelPreset
from router.config.settings import Settings
from router.config.sources import Catalogue
from router.core.supervisor import Supervisor
from router.core.wiring import wire
from router.events import EventBus
from router.host.cpus import (
    BUSY_CORES,
    CLOCK_TICKS,
    MIN_WINDOW_S,
    CpuShare,
    OtherWork,
    all_layers_offloaded,
    cgroup_cpu_limit,
    machine_busy_ticks,
    places_itself,
    plan_shares,
    process_ticks,
    select_cores,
    shares_with,
    spin_environment,
)
from router.host.gpus import GpuDevice
from router.llama.flags import FlagTable
from router.serving.load import Replica


def cores_of(shares: list[CpuShare]) -> list[tuple[int, ...]]:
    return [s.cores for s in shares]


def assert_no_core_has_two_wide(shares: list[CpuShare]) -> None:
    """The invariant that keeps spinning threads from stalling each other."""
    wide = [c for s in shares if s.wide for c in s.cores]
    assert len(wide) == len(set(wide)), shares


# ------------------------------------------------------------------------------ CpuShare

def test_share_renders_llama_server_options_one_thread_per_core() -> None:
    share = CpuShare((0, 1, 5))
    assert share.threads == 3 and share.wide
    assert share.argv() == ["--threads", "3", "--threads-batch", "3",
                            "--cpu-mask", "23"]  # bits 0, 1, 5
    assert share.describe() == {"threads": 3, "cores": [0, 1, 5], "placed_by": "router",
                                "spin": "full"}
    assert CpuShare((63, 64)).argv()[5] == "18" + "0" * 15  # hex digits past 64 CPUs
    single = CpuShare((7,))  # one thread never spins: not confined
    assert not single.wide
    assert single.argv() == ["--threads", "1", "--threads-batch", "1"]
    assert single.describe() == {"threads": 1, "cores": None, "placed_by": "router",
                                 "spin": "full"}


# ------------------------------------------------------------------------------ plan_shares

def test_a_lone_model_gets_the_whole_machine() -> None:
    assert cores_of(plan_shares([0, 1], [], 1, fair_share=2)) == [(0, 1)]
    assert cores_of(plan_shares(list(range(8)), [], 1, fair_share=8)) == [tuple(range(8))]


def test_two_models_get_disjoint_halves() -> None:
    first = plan_shares(list(range(8)), [], 1, fair_share=4)
    second = plan_shares(list(range(8)), first, 1, fair_share=4)
    assert cores_of(first) == [(0, 1, 2, 3)]
    assert cores_of(second) == [(4, 5, 6, 7)]


def test_replicas_split_the_cores_in_one_plan() -> None:
    assert cores_of(plan_shares([0, 1], [], 2, fair_share=1)) == [(0,), (1,)]
    assert cores_of(plan_shares(list(range(6)), [], 3, fair_share=2)) == [(0, 1), (2, 3), (4, 5)]


def test_more_children_than_cores_share_cores_single_threaded() -> None:
    shares = plan_shares([0, 1], [], 3, fair_share=1)
    assert cores_of(shares) == [(0,), (1,), (0,)]
    assert not any(s.wide for s in shares)


def test_a_new_child_never_shares_a_core_with_a_wide_one() -> None:
    wide = CpuShare((0, 1))
    [new] = plan_shares([0, 1, 2, 3], [wide], 1, fair_share=2)
    assert new.cores == (2, 3)
    # no free core left for a wide share: one thread on the least used core
    [narrow] = plan_shares([0, 1], [wide], 1, fair_share=2)
    assert narrow.cores == (0,) and not narrow.wide


def test_a_partial_fit_takes_the_free_cores() -> None:
    [share] = plan_shares(list(range(4)), [CpuShare((0, 1, 2))], 1, fair_share=4)
    assert share.cores == (3,)
    [share] = plan_shares(list(range(6)), [CpuShare((0, 1, 2, 3))], 1, fair_share=4)
    assert share.cores == (4, 5)


def test_single_threaded_children_do_not_block_a_wide_share() -> None:
    held = [CpuShare((0,)), CpuShare((1,))]
    [share] = plan_shares([0, 1], held, 1, fair_share=2)
    assert share.cores == (0, 1)  # they time-share; no spinning thread waits on them


def test_narrow_children_take_one_thread_on_the_least_used_core() -> None:
    held = [CpuShare((0, 1)), CpuShare((2,))]
    assert cores_of(plan_shares([0, 1, 2, 3], held, 2, fair_share=4, narrow=True)) == \
        [(3,), (0,)]


def test_no_cores_known_gives_empty_shares() -> None:
    assert plan_shares([], [], 2, fair_share=1) == [CpuShare(()), CpuShare(())]


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("fair", [1, 2, 3, 8])
def test_invariant_holds_through_loads_and_unloads(cores: int, fair: int) -> None:
    machine = list(range(cores))
    held: list[CpuShare] = []
    for step in range(12):
        held += plan_shares(machine, held, 1 + step % 2, fair_share=fair, narrow=step % 5 == 4)
        assert_no_core_has_two_wide(held)
        assert all(set(s.cores) <= set(machine) and s.threads >= 1 for s in held)
        assert all(s.threads <= fair for s in held if s.wide)
        if step % 3 == 2:
            held.pop(0)  # an unload frees its cores


# ------------------------------------------------------------------------- counting models

def test_places_itself_when_a_preset_or_the_environment_sets_threads() -> None:
    assert not places_itself({"ctx-size": "512"}, environ={})
    for key in ("threads", "threads-batch", "cpu-mask", "cpu-range", "cpu-strict"):
        assert places_itself({key: "1"}, environ={})
    assert places_itself({}, environ={"LLAMA_ARG_THREADS": "4"})


def test_all_layers_offloaded() -> None:
    assert all_layers_offloaded({}, None)
    assert all_layers_offloaded({"n-gpu-layers": "auto"}, 32)
    assert all_layers_offloaded({"n-gpu-layers": "99"}, 32)
    assert not all_layers_offloaded({"n-gpu-layers": "10"}, 32)
    assert not all_layers_offloaded({"n-gpu-layers": "99"}, None)  # unknown depth: CPU too


# ------------------------------------------------------------------------ reading the machine

def test_select_cores_keeps_one_logical_cpu_per_physical_core() -> None:
    core_of = {0: "a", 1: "b", 2: "a", 3: "b"}  # 2 cores with 2 SMT threads each
    assert select_cores([0, 1, 2, 3], core_of, None) == [0, 1]
    assert select_cores([2, 3], core_of, None) == [2, 3]  # affinity limits first


def test_select_cores_honours_a_cpu_quota() -> None:
    assert select_cores(range(16), {}, 4.0) == [0, 1, 2, 3]
    assert select_cores(range(16), {}, 2.5) == [0, 1, 2]
    assert select_cores(range(16), {}, 0.5) == [0]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_cgroup_v2_quota_is_the_tightest_along_the_path(tmp_path: Path) -> None:
    proc = write(tmp_path / "proc", "0::/system.slice/router.service\n")
    write(tmp_path / "cg/cpu.max", "max 100000\n")
    write(tmp_path / "cg/system.slice/cpu.max", "600000 100000\n")
    write(tmp_path / "cg/system.slice/router.service/cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(tmp_path / "cg", proc) == 6.0


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    proc = write(tmp_path / "proc", "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n")
    write(tmp_path / "cg/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "200000\n")
    write(tmp_path / "cg/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path / "cg", proc) == 2.0


def test_no_cgroup_limit(tmp_path: Path) -> None:
    proc = write(tmp_path / "proc", "0::/\n")
    write(tmp_path / "cg/cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(tmp_path / "cg", proc) is None
    assert cgroup_cpu_limit(tmp_path / "cg", tmp_path / "missing") is None


# ------------------------------------------------------------------- the supervisor's choice

def supervisor_with(presets: dict[str, dict[str, str]], *, gpus: bool = False,
                    replicas: int = 1, cpu_sharing: bool = True,
                    other_work: OtherWork | None = None) -> Supervisor:
    catalogue = Catalogue(models={
        name: ModelPreset(name, {"model": f"/m/{name}.gguf", **args},
                          replicas=replicas if name == "hot" else 1)
        for name, args in presets.items()})
    devices = [GpuDevice(0, "GPU-0", "Fake", 80 << 30)] if gpus else []
    return Supervisor(wire(Settings(cpu_sharing=cpu_sharing), catalogue, FlagTable([]),
                           Path("/bin/true"), httpx.AsyncClient(), EventBus(), gpus=devices,
                           cores=[0, 1, 2, 3], other_work=other_work or quiet_machine()))


def quiet_machine() -> OtherWork:
    """Other work as a machine doing nothing but the router reads it: none."""
    files = {"/proc/stat": "cpu  100 0 0 900 0 0 0 0 0 0\n"}
    work = OtherWork(read=files.get)
    work.sample([], now=0.0)
    work.sample([], now=1.0)
    return work


def test_a_cpu_model_gets_every_core_and_replicas_split_them() -> None:
    sup = supervisor_with({"chat": {}, "hot": {}}, replicas=2)
    assert sup.spawner.cpu_shares(sup.models["chat"], 1) == [CpuShare((0, 1, 2, 3))]
    assert sup.spawner.cpu_shares(sup.models["hot"], 2) == [CpuShare((0, 1)), CpuShare((2, 3))]


def test_a_gpu_model_gets_one_thread_and_a_partial_offload_computes_on_the_cpu() -> None:
    sup = supervisor_with({"all": {}, "none": {"device": "none"},
                           "part": {"n-gpu-layers": "10"}}, gpus=True)
    assert sup.spawner.cpu_shares(sup.models["all"], 1) == [CpuShare((0,))]
    assert sup.spawner.cpu_shares(sup.models["none"], 1) == [CpuShare((0, 1, 2, 3))]
    assert sup.spawner.cpu_shares(sup.models["part"], 1) == [CpuShare((0, 1, 2, 3))]


def test_no_share_for_a_preset_that_places_itself_or_with_sharing_off() -> None:
    sup = supervisor_with({"own": {"threads": "2"}, "chat": {}})
    assert sup.spawner.cpu_shares(sup.models["own"], 1) == [None]
    off = supervisor_with({"chat": {}}, cpu_sharing=False)
    assert off.cores == [] and off.spawner.cpu_shares(off.models["chat"], 2) == [None, None]


def test_children_spin_briefly_unless_the_environment_says_otherwise() -> None:
    assert spin_environment({}) == {"GOMP_SPINCOUNT": "3000"}
    assert spin_environment({"OMP_WAIT_POLICY": "active"}) == {}
    assert spin_environment({"GOMP_SPINCOUNT": "50"}) == {}


def test_a_share_alone_keeps_libgomps_spin_and_a_shared_one_waits_briefly() -> None:
    alone = CpuShare((0, 1))
    assert alone.environment({}) == {}
    shared = CpuShare((0, 1), shared=True)
    assert shared.environment({}) == {"GOMP_SPINCOUNT": "3000"}
    assert shared.environment({"OMP_WAIT_POLICY": "passive"}) == {}  # the router's wins
    assert shared.describe()["spin"] == "short"


def test_a_share_is_shared_only_where_another_share_holds_its_cores() -> None:
    assert shares_with(CpuShare((0, 1)), []) == CpuShare((0, 1))
    assert shares_with(CpuShare((0, 1)), [CpuShare((1, 2))]).shared
    assert not shares_with(CpuShare((0, 1)), [CpuShare((2, 3))]).shared
    # A one-thread GPU child is never paused: its thread would preempt a spinning sibling.
    assert shares_with(CpuShare((0, 1)), [CpuShare((0,))]).shared


def test_the_spawner_gives_a_lone_model_full_spin_and_a_second_one_a_short_one() -> None:
    sup = supervisor_with({"chat": {}, "code": {}})
    child = object.__new__(ChildProcess)
    child.cpu = CpuShare((0, 1, 2, 3))
    child._proc = None  # no process: no pid
    chat, code = sup.models["chat"], sup.models["code"]
    [share] = sup.spawner.cpu_shares(code, 1)
    assert sup.spawner.at_spawn(code, share) == CpuShare((0, 1, 2, 3))  # alone
    chat.state = replace(chat.state, starting=(child,))
    assert sup.spawner.at_spawn(code, share) == CpuShare((0, 1, 2, 3), shared=True)
    assert sup.spawner.at_spawn(chat, share) == CpuShare((0, 1, 2, 3))  # its own: not another
    chat.state = replace(chat.state, starting=(), replicas=(Replica(child),))
    assert sup.spawner.at_spawn(code, share).shared  # serving
    chat.state = replace(chat.state, replicas=(), stopping=(Replica(child),))
    assert not sup.spawner.at_spawn(code, share).shared  # on its way out
    assert sup.spawner.at_spawn(code, None) is None  # placed by its preset


# ------------------------------------------------------------------------ other work

STAT = "cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 0 0 1 0 0 0 0 0 0\nintr 1\n"


def proc_stat(utime: int, stime: int, name: str = "llama-server") -> str:
    return f"42 ({name}) S 1 42 42 0 -1 4194560 1 0 0 0 {utime} {stime} 0 0 20 0 8 0 1 1 1"


def test_cpu_time_is_read_from_proc() -> None:
    assert machine_busy_ticks("cpu  10 1 5 100 7 2 3 4 0 0\n") == 10 + 1 + 5 + 2 + 3 + 4
    assert machine_busy_ticks("cpu0 1 2 3\n") is None
    assert process_ticks(proc_stat(30, 12)) == 42
    assert process_ticks(proc_stat(1, 2, name="a) (b c")) == 3  # the name may hold ") ("
    assert process_ticks("garbage") is None


def test_other_work_is_the_machines_cpu_time_outside_the_router_and_its_children() -> None:
    files: dict[str, str] = {}
    work = OtherWork(read=files.get)
    assert work.cores is None and work.busy  # nothing known: the safe side
    files.update({"/proc/stat": STAT.format(busy=1000, idle=0),
                  "/proc/1/stat": proc_stat(100, 0), "/proc/2/stat": proc_stat(200, 0)})
    work.sample([1, 2], now=10.0)
    assert work.cores is None  # one sample: no interval yet
    # One second later: the machine spent 150 ticks, the router and its child 140 of them.
    files.update({"/proc/stat": STAT.format(busy=1150, idle=0),
                  "/proc/1/stat": proc_stat(120, 0), "/proc/2/stat": proc_stat(320, 0)})
    work.sample([1, 2], now=11.0)
    assert work.cores == pytest.approx(10 / CLOCK_TICKS) and not work.busy
    # Another process took a core's worth: busy.
    files.update({"/proc/stat": STAT.format(busy=1150 + CLOCK_TICKS, idle=0)})
    work.sample([1, 2], now=12.0)
    assert work.cores == pytest.approx(1.0) and work.busy
    # A child that started within the interval counts from nothing; one gone counts as other.
    files.update({"/proc/stat": STAT.format(busy=1150 + CLOCK_TICKS + 50, idle=0),
                  "/proc/3/stat": proc_stat(50, 0)})
    work.sample([1, 2, 3], now=13.0)
    assert work.cores == pytest.approx(0.0)
    # A read at a spawn samples on the spot unless the last sample is that recent.
    assert work.read([1, 2, 3], now=13.0 + MIN_WINDOW_S / 2) == pytest.approx(0.0)
    files.update({"/proc/stat": STAT.format(busy=1150 + 2 * CLOCK_TICKS + 50, idle=0)})
    assert work.read([1, 2, 3], now=14.0) == pytest.approx(1.0) and work.busy
    del files["/proc/stat"]  # /proc unreadable: nothing known
    work.sample([1], now=15.0)
    assert work.cores is None and work.busy


def test_a_busy_machine_makes_a_lone_child_wait_briefly() -> None:
    ticks = [100]
    work = OtherWork(read=lambda path: f"cpu  {ticks[0]} 0 0 900 0 0 0 0 0 0\n"
                     if path == "/proc/stat" else None)
    work.sample([], now=time.monotonic() - 1.0)
    sup = supervisor_with({"chat": {}}, other_work=work)
    chat = sup.models["chat"]
    [share] = sup.spawner.cpu_shares(chat, 1)
    assert not sup.spawner.at_spawn(chat, share).shared  # read at the spawn: quiet
    ticks[0] += 10 * CLOCK_TICKS  # the next sample (the accounting's) sees other work
    work.sample([], now=time.monotonic())
    assert sup.spawner.at_spawn(chat, share) == CpuShare((0, 1, 2, 3), shared=True)
    assert work.busy and work.cores is not None and work.cores >= BUSY_CORES
