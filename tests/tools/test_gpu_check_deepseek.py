"""tools/gpu_check_deepseek.py: on a CPU every check but the Transformer Engine spec runs on the local spec and
passes (conversion with TE's checkpoint keys, logits, bit-exact export, the frozen bias), and it exits 3."""

import importlib.util
import subprocess
import sys
from pathlib import Path

from megatron_zcpo.testing.gpu_checks import EXIT_NO_GPU

ROOT = Path(__file__).resolve().parents[2]


def _load_tool():
    spec = importlib.util.spec_from_file_location("gpu_check_deepseek", ROOT / "tools" / "gpu_check_deepseek.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_the_cpu_parts_pass_and_the_te_spec_is_skipped_with_exit_3(tmp_path):
    tool = _load_tool()
    result = subprocess.run(
        [sys.executable, "tools/gpu_check_deepseek.py", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == EXIT_NO_GPU, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    for case in tool.CASES:
        for check in (
            "convert: TE spec's fused-norm keys",
            "logits vs transformers (local spec)",
            "export to HF bit for bit",
            "train step, bias rate 0",
        ):
            row = next(line for line in lines if line.startswith(f"[{case}] {check}"))
            assert "  ok  " in row, row
    assert "FAILED" not in result.stdout and "TE spec modules" not in result.stdout, result.stdout
    assert lines[-1] == tool.SKIPPED
    assert (tmp_path / "dsv3-yarn-groups" / "hf_back" / "config.json").is_file()
