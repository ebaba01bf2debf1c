"""tools/gpu_check_moe.py: on a CPU (SequentialMLP experts, no TE) every row passes and it exits 3."""

import subprocess
import sys
from pathlib import Path

from megatron_zcpo.testing.gpu_checks import EXIT_NO_GPU

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_gpu_every_check_passes_on_the_cpu_with_exit_3(tmp_path):
    result = subprocess.run(
        [sys.executable, "tools/gpu_check_moe.py", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == EXIT_NO_GPU, result.stdout + result.stderr[-3000:]
    rows = result.stdout.splitlines()[:-1]
    assert len(rows) >= 6 and all("  ok  " in row for row in rows), result.stdout
    for mode in ("experience", "rollout"):
        assert any(row.startswith(f"train step, routing_replay={mode} ") for row in rows), result.stdout
    assert result.stdout.splitlines()[-1] == "no GPU: ran on the CPU"
