"""CPU sharing with the real llama-server: children generating at once on their own cores."""

from __future__ import annotations

import concurrent.futures
import subprocess
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from support import start_router, wait_until, write_presets

from router.host.cpus import BUSY_CORES, machine_cores
from router.llama.tinymodel import write_tiny_model

pytestmark = pytest.mark.real

# 2,000 tokens each. Taking turns on 2 cores, both finish in about 1 s; with llama.cpp's
# default threads and no turns, two children spin against each other: 15 to 160 s.
TOKENS = 2000
HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def long_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("cpu-models")
    return {name: write_tiny_model(directory / f"{name}.gguf", seed=seed, name=name,
                                   n_ctx_train=8192)
            for seed, name in ((21, "left"), (22, "right"))}


def presets(tmp_path: Path, models: dict[str, Path], extra: dict[str, str] | None = None
            ) -> Path:
    text = "[*]\nctx-size = 4096\nparallel = 1\n"
    for name, path in models.items():
        text += f"[{name}]\nmodel = {path}\n{(extra or {}).get(name, '')}"
    return write_presets(tmp_path / "cpu.ini", text)


def generate(url: str, model: str, tokens: int = TOKENS) -> dict[str, Any]:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens,
            "ignore_eos": True, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=HANG_GUARD_S * 2)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def child_argv(pid: int) -> list[str]:
    return psutil.Process(pid).cmdline()


def other_work(router: Any) -> float:
    """The router's reading of the machine's other work (``llamarouter_cpu_other_work_cores``),
    once it has one."""
    found: list[float] = []

    def read() -> bool:
        with router.client() as client:
            text = client.get("/metrics").text
        found[:] = [float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith("llamarouter_cpu_other_work_cores")]
        return bool(found)

    assert wait_until(read, HANG_GUARD_S), "no reading of the machine's other work"
    return found[0]


def expected_spin(before: float, after: float, alone: str) -> str | None:
    """What a child spawned between two readings of other work gets: ``alone`` (its answer on
    a quiet machine) when both were well under the threshold, ``short`` when both were well
    over it; None (not asserted) in between: this machine's other work is not the test's."""
    if max(before, after) < BUSY_CORES / 2:
        return alone
    if min(before, after) >= BUSY_CORES * 2:
        return "short"
    return None


def assert_spun_alone(status: dict[str, Any], before: float, after: float) -> None:
    """A child alone on its cores: libgomp's spin on a quiet machine, the short one on a busy
    one, and its environment says what ``/models`` says."""
    spin = expected_spin(before, after, "full")
    if spin is not None:
        assert status["cpu"]["spin"] == spin
    assert spin_count(status["pid"]) == ("3000" if status["cpu"]["spin"] == "short" else None)


def spin_count(pid: int) -> str | None:
    """The child's ``GOMP_SPINCOUNT`` (None: libgomp's default)."""
    return psutil.Process(pid).environ().get("GOMP_SPINCOUNT")


def option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_two_children_generating_at_once_both_finish(tmp_path: Path, llama_server: Path,
                                                     long_models: dict[str, Path]) -> None:
    cores = machine_cores()
    with start_router(tmp_path, "--presets", str(presets(tmp_path, long_models))) as router:
        before = other_work(router)
        for name in long_models:  # load both first: the race is between generations
            generate(router.url, name, 4)
        after = other_work(router)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(generate, router.url, name) for name in long_models]
            done, _ = concurrent.futures.wait(futures, timeout=HANG_GUARD_S)
            assert len(done) == 2, f"two children generating at once stalled:\n{router.log()}"
        for future in futures:
            assert future.result()["usage"]["completion_tokens"] == TOKENS

        placed = {name: router.models()[name]["status"] for name in long_models}
        shares = [status["cpu"] for status in placed.values()]
        assert all(share["placed_by"] == "router" for share in shares)
        # Each model has the whole machine; they took turns while both generated.
        assert [share["threads"] for share in shares] == [len(cores), len(cores)]
        with router.client() as client:
            metrics = client.get("/metrics").text
        turns = next(float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("llamarouter_cpu_turns_total"))
        assert (turns > 0) == (len(cores) > 1)
        assert "llamarouter_children_paused 0.0" in metrics  # nobody left paused
        # The first model loaded computed alone at its spawn: libgomp's own spin (on a quiet
        # machine). The second was spawned onto the first one's cores: its threads wait
        # briefly.
        wide = len(cores) > 1
        first = expected_spin(before, after, "full")
        if first is not None:
            assert [share["spin"] for share in shares] == [first, "short" if wide else first]
        if wide:
            assert shares[1]["spin"] == "short"
            assert spin_count(placed["right"]["pid"]) == "3000"
        assert spin_count(placed["left"]["pid"]) == ("3000" if shares[0]["spin"] == "short"
                                                     else None)
        for status, share in zip(placed.values(), shares, strict=True):
            argv = child_argv(status["pid"])
            assert option(argv, "--threads") == str(share["threads"])
            if len(cores) > 1:
                mask = int(option(argv, "--cpu-mask") or "0", 16)
                assert mask == sum(1 << c for c in share["cores"])


def test_a_model_alone_gets_every_core(tmp_path: Path, llama_server: Path,
                                       long_models: dict[str, Path]) -> None:
    ini = presets(tmp_path, long_models)
    with start_router(tmp_path, "--presets", str(ini)) as router:
        before = other_work(router)
        generate(router.url, "left", 4)
        after = other_work(router)
        status = router.models()["left"]["status"]
        cores = machine_cores()
        assert status["cpu"]["threads"] == len(cores)
        assert status["cpu"]["cores"] == (cores if len(cores) > 1 else None)
        assert option(child_argv(status["pid"]), "--threads") == str(len(cores))
        assert_spun_alone(status, before, after)


def test_a_model_swapped_in_computes_alone_at_full_spin(
        tmp_path: Path, llama_server: Path, long_models: dict[str, Path]) -> None:
    ini = presets(tmp_path, long_models)
    with start_router(tmp_path, "--presets", str(ini), "--models-max", "1") as router:
        generate(router.url, "left", 4)
        before = other_work(router)
        generate(router.url, "right", 4)  # evicts left: right never shares its cores
        after = other_work(router)
        models = router.models()
        assert models["left"]["status"]["value"] == "unloaded"
        status = models["right"]["status"]
        assert_spun_alone(status, before, after)


def test_a_busy_machine_makes_a_lone_child_wait_briefly(
        tmp_path: Path, llama_server: Path, long_models: dict[str, Path]) -> None:
    ini = presets(tmp_path, long_models)
    busy = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(2)]
    try:
        with start_router(tmp_path, "--presets", str(ini)) as router:
            # Two processes that never rest: at least a core's worth of other work.
            assert wait_until(lambda: other_work(router) >= BUSY_CORES * 2, HANG_GUARD_S)
            generate(router.url, "left", 4)
            status = router.models()["left"]["status"]
            assert status["cpu"]["spin"] == "short"
            assert spin_count(status["pid"]) == "3000"
    finally:
        for process in busy:
            process.kill()
            process.wait()


def test_two_models_loading_at_once_see_each_other(tmp_path: Path, llama_server: Path,
                                                   long_models: dict[str, Path]) -> None:
    ini = presets(tmp_path, long_models)
    with start_router(tmp_path, "--presets", str(ini)) as router:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            loads = [pool.submit(httpx.post, router.url + "/models/load?wait=1",
                                 json={"model": name}, timeout=HANG_GUARD_S)
                     for name in long_models]
            assert [load.result().status_code for load in loads] == [200, 200]
        spins = sorted(router.models()[name]["status"]["cpu"]["spin"] for name in long_models)
        # Whichever spawned second saw the first one's cores taken.
        if len(machine_cores()) > 1:
            assert "short" in spins


def test_the_routers_environment_decides_the_spin_when_it_sets_one(
        tmp_path: Path, llama_server: Path, long_models: dict[str, Path]) -> None:
    ini = presets(tmp_path, long_models)
    with start_router(tmp_path, "--presets", str(ini), env={"GOMP_SPINCOUNT": "777"}) as router:
        for name in long_models:
            generate(router.url, name, 4)
        for name in long_models:
            status = router.models()[name]["status"]
            assert status["cpu"]["spin"] == "environment"
            assert spin_count(status["pid"]) == "777"


def test_a_preset_that_sets_threads_places_its_child_itself(
        tmp_path: Path, llama_server: Path, long_models: dict[str, Path]) -> None:
    ini = presets(tmp_path, long_models, {"left": "threads = 1\n"})
    with start_router(tmp_path, "--presets", str(ini)) as router:
        generate(router.url, "left", 4)
        status = router.models()["left"]["status"]
        assert status["cpu"] == {"threads": "1", "cores": None, "placed_by": "preset"}
        argv = child_argv(status["pid"])
        assert argv.count("--threads") == 1 and option(argv, "--threads") == "1"
        assert "--cpu-mask" not in argv and "--cpu-strict" not in argv


def test_pass_through_threads_win(tmp_path: Path, llama_server: Path,
                                  long_models: dict[str, Path]) -> None:
    ini = presets(tmp_path, long_models)
    with start_router(tmp_path, "--presets", str(ini), child_args=("--threads", "1")) as router:
        generate(router.url, "left", 4)
        argv = child_argv(router.models()["left"]["status"]["pid"])
        assert option(argv, "--threads") == "1" and "--cpu-mask" not in argv


def test_cpu_sharing_can_be_turned_off(tmp_path: Path, llama_server: Path,
                                       long_models: dict[str, Path]) -> None:
    ini = presets(tmp_path, long_models)
    with start_router(tmp_path, "--presets", str(ini), "--no-cpu-sharing") as router:
        generate(router.url, "left", 4)
        status = router.models()["left"]["status"]
        assert status["cpu"]["placed_by"] == "llama-server"
        argv = child_argv(status["pid"])
        assert "--threads" not in argv and "--cpu-mask" not in argv
        assert "GOMP_SPINCOUNT" not in psutil.Process(status["pid"]).environ()
