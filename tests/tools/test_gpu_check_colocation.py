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
    # On a CPU only the offload runs; the CUDA IPC push and the colocated train need GPUs and say so.
    assert result.stdout.count("\nok   ") == 1 and "FAIL" not in result.stdout, result.stdout
    assert "\nok   trainer state offload on cpu" in result.stdout, result.stdout
    assert "\nskip per-GPU CUDA IPC push, colocated zcpo train: no GPU" in result.stdout, result.stdout
