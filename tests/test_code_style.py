"""The repository's code habits, run by `make test`: ruff's lint and format checks, mypy on the pure layers."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL_DIR = Path(sys.executable).parent


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(TOOL_DIR / command[0]), *command[1:]], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize(
    "command",
    [("ruff", "check", "."), ("ruff", "format", "--check", "--diff", "."), ("mypy",)],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_code_style(command):
    """ruff.toml and mypy.ini say what is checked; fix a finding (or, where it is intended, mark that line)."""
    result = _run(*command)
    assert result.returncode == 0, f"`{' '.join(command)}` found:\n{result.stdout}\n{result.stderr}"


def test_ruff_finds_a_planted_problem(tmp_path):
    """The check can fail: an unused import in a copied module is reported."""
    planted = tmp_path / "planted.py"
    planted.write_text("import os\n")
    result = _run("ruff", "check", "--config", str(ROOT / "ruff.toml"), str(planted))
    assert result.returncode == 1 and "F401" in result.stdout, result.stdout
