"""GPU detection, per-process usage, budgets and placement, with a fake nvidia-smi; a GPU device
held open, with a fake /proc."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
from support import fake_nvidia_smi

from router.core.scheduler import RAM
from router.host import gpus
from router.host.gpus import (
    GpuDevice,
    budgets,
    detect,
    holds_gpu_device,
    placement,
    usage_by_pid,
)
from router.host.memory import BASE_OVERHEAD_BYTES, Estimate

MiB = 1 << 20
GiB = 1 << 30
TWO = [[0, "GPU-a", "NVIDIA H200", 143771], [1, "GPU-b", "NVIDIA H200", 143771]]


def install_fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, config: dict[str, Any]
                 ) -> None:
    """Put a fake ``nvidia-smi`` first on PATH, answering from ``config``."""
    for name, value in fake_nvidia_smi(tmp_path, config).items():
        monkeypatch.setenv(name, value)


def test_no_nvidia_smi_means_no_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect() == []
    assert usage_by_pid([]) == {}


@pytest.mark.process
def test_detect_and_usage(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    install_fake(monkeypatch, tmp_path, {
        "gpus": [*TWO, [2, "GPU-c", "broken", "[N/A]"]],
        "apps": [[123, "GPU-a", 1024], [123, "GPU-b", 10], [123, "GPU-a", 1],
                 [456, "GPU-b", 5], [789, "GPU-a", "[N/A]"], [9, "GPU-unknown", 3]]})
    devices = detect()
    assert devices == [GpuDevice(0, "GPU-a", "NVIDIA H200", 143771 * MiB),
                       GpuDevice(1, "GPU-b", "NVIDIA H200", 143771 * MiB)]
    assert [d.pool for d in devices] == ["gpu0", "gpu1"]
    assert usage_by_pid(devices) == {123: {"gpu0": 1025 * MiB, "gpu1": 10 * MiB},
                                     456: {"gpu1": 5 * MiB}}


@pytest.mark.process
def test_failing_or_hanging_nvidia_smi_means_no_gpus(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    install_fake(monkeypatch, tmp_path, {"gpus": TWO, "exit": 9})
    assert detect() == []
    bin_dir = tmp_path / "slow"
    bin_dir.mkdir()
    slow = bin_dir / "nvidia-smi"
    slow.write_text(f"#!{sys.executable}\nimport time; time.sleep(30)\n")
    slow.chmod(slow.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(gpus, "NVIDIA_SMI_TIMEOUT_S", 0.5)
    assert detect() == []


DEVICES = [GpuDevice(0, "GPU-a", "x", 80 * GiB), GpuDevice(1, "GPU-b", "x", 40 * GiB)]


def test_budgets() -> None:
    margin = gpus.DEFAULT_MARGIN_BYTES
    auto = {"gpu0": 80 * GiB - margin, "gpu1": 40 * GiB - margin}
    assert budgets(None, DEVICES) == auto
    assert budgets("auto", DEVICES) == auto
    assert budgets("off", DEVICES) == {}
    assert budgets("20G", DEVICES) == {"gpu0": 20 * GiB, "gpu1": 20 * GiB}
    assert budgets("1=10G", DEVICES) == {"gpu0": auto["gpu0"], "gpu1": 10 * GiB}
    assert budgets(None, []) == {}
    with pytest.raises(ValueError, match="no GPU 7"):
        budgets("7=1G", DEVICES)
    with pytest.raises(ValueError, match="INDEX=SIZE"):
        budgets("a=1G", DEVICES)


ESTIMATE = Estimate(weights_bytes=8 * GiB, kv_cache_bytes=2 * GiB,
                    overhead_bytes=BASE_OVERHEAD_BYTES + GiB, prompt_cache_bytes=2 * GiB,
                    n_layer=40)


def test_without_gpus_everything_is_ram() -> None:
    assert placement(ESTIMATE, {}, []) == {RAM: ESTIMATE.total_bytes}
    assert placement(ESTIMATE, {"device": "none"}, DEVICES) == {RAM: ESTIMATE.total_bytes}
    assert placement(ESTIMATE, {"n-gpu-layers": "0"}, DEVICES) == {RAM: ESTIMATE.total_bytes}


def test_full_offload_splits_evenly_and_keeps_the_prompt_cache_in_ram() -> None:
    got = placement(ESTIMATE, {}, DEVICES)
    assert got == {RAM: BASE_OVERHEAD_BYTES + 2 * GiB, "gpu0": 5 * GiB + GiB, "gpu1": 5 * GiB}
    assert sum(got.values()) == ESTIMATE.total_bytes
    assert placement(ESTIMATE, {"ngl": "all"}, DEVICES) == got
    assert placement(ESTIMATE, {"n-gpu-layers": "999"}, DEVICES) == got


def test_partial_offload() -> None:
    got = placement(ESTIMATE, {"n-gpu-layers": "10", "device": "CUDA1"}, DEVICES)
    offloaded = (10 * GiB) // 4
    assert got == {RAM: ESTIMATE.total_bytes - offloaded - GiB, "gpu1": offloaded + GiB}


def test_split_mode_none_uses_the_main_gpu_only() -> None:
    got = placement(ESTIMATE, {"split-mode": "none", "main-gpu": "1"}, DEVICES)
    assert set(got) == {RAM, "gpu1"}
    assert got["gpu1"] == 10 * GiB + GiB


def test_tensor_split_proportions() -> None:
    got = placement(ESTIMATE, {"tensor-split": "3,1"}, DEVICES)
    assert got["gpu0"] == int(10 * GiB * 0.75) + GiB
    assert got["gpu1"] == int(10 * GiB * 0.25)


def fake_process(proc: Path, pid: int, targets: list[str]) -> None:
    """``proc/PID/fd/N`` links to ``targets``, as ``/proc`` shows a process's descriptors."""
    fds = proc / str(pid) / "fd"
    fds.mkdir(parents=True)
    for number, target in enumerate(targets):
        (fds / str(number)).symlink_to(target)


@pytest.mark.parametrize("device", ["/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd",
                                    "/dev/dri/renderD128", "/dev/accel/accel0", "/dev/dxg"])
def test_a_process_with_any_vendors_gpu_device_open_may_hold_gpu_memory(
        tmp_path: Path, device: str) -> None:
    fake_process(tmp_path, 7, ["pipe:[1234]", "/models/a.gguf", device, "socket:[99]"])
    assert holds_gpu_device(7, proc=str(tmp_path)) is True


def test_a_cpu_child_holds_no_gpu_device_and_an_unreadable_one_is_unknown(
        tmp_path: Path) -> None:
    fake_process(tmp_path, 7, ["pipe:[1234]", "/models/a.gguf", "/dev/null", "/dev/drivers"])
    fake_process(tmp_path, 8, [])  # a zombie: no descriptors
    assert holds_gpu_device(7, proc=str(tmp_path)) is False
    assert holds_gpu_device(8, proc=str(tmp_path)) is False
    assert holds_gpu_device(9, proc=str(tmp_path)) is None  # gone, or not Linux
    assert holds_gpu_device(os.getpid()) is False  # this test process, on the real /proc
