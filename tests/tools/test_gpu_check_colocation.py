"""tools/gpu_check_colocation.py: on a CPU its checks run on host tensors, pass, and it exits 3 (no GPU)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_gpu_the_checks_run_on_the_cpu_and_exit_3():
    result = subprocess.run(
        [sys.executable, "tools/gpu_check_colocation.py"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 3, result.stdout + result.stderr[-3000:]
    assert result.stdout.count("\nok   ") == 2 and "FAIL" not in result.stdout, result.stdout
