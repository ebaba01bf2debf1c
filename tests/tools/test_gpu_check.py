"""tools/gpu_check.py: the CPU-checkable parts run and pass (`zcpo train` and its resume too), the GPU-only ones
are refused cleanly (exit 3)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_tool():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


gpu_check = _load_tool()


def test_without_a_gpu_the_cpu_parts_pass_and_the_rest_is_skipped_with_exit_3(tmp_path):
    result = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == gpu_check.EXIT_NO_GPU, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout[result.stdout.index("# gpu_check") :]
    for check in (
        "convert HF -> Megatron",
        "log-probs + 2 steps, fp32 TP1 (local spec)",
        "planner peak memory",
        "--verify converted model (local spec)",
        "zcpo train + resume",
    ):
        assert any(line.startswith(check) and "| ok " in line for line in table.splitlines()), (check, table)
    skipped = (
        "no GPU: skipped TE layer spec model, bf16 training on the GPU, bench_token_stats --gpu, measured peak memory"
    )
    assert result.stdout.rstrip().splitlines()[-1] == skipped
    assert (tmp_path / "megatron" / "model_config.json").is_file() and (tmp_path / "hf" / "config.json").is_file()


BENCH_OUTPUT = """# NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0; roofline HBM 4.8 TB/s, bf16 790 TFLOP/s

# stats 4096 x 152064, bf16 logits of policy and reference
  check 152064 T=1                   PASS  vs torch backend: ...
  check 152064 backward              {verdict}  512 rows ...
  peer (megatron CE + entropy)          17.700 ms  peak +    9504 MiB  HBM  15.0%  bf16      -  x peer   1.00
  ours (triton)                          1.200 ms  peak +      40 MiB  HBM  43.3%  bf16      -  x peer   0.07

# update 4096 x 5120 x 152064: forward + backward with the output-layer GEMMs, bf16
  check update vs torch backend      PASS  ...
  peer (bf16 layer + megatron CE)       36.400 ms  peak +    4752 MiB  HBM      -  bf16  67.0%  x peer   1.00
  ours (triton), logprob                29.000 ms  peak +    3000 MiB  HBM      -  bf16  84.0%  x peer   0.80

{summary}
"""
# The harness's closing line (benchmarks/bench_gpu_harness.py: verdict) on success and on a failed check.
PASSED_SUMMARY = "# token-stats GPU bench: PASS: 3/3 checks passed, targets met: stats, update; 180 s"
FAILED_SUMMARY = (
    "# token-stats GPU bench: FAIL (1): check 152064 backward failed\n# 2/3 checks passed, 2 targets met; 180 s"
)


@pytest.mark.parametrize(
    "verdict,failed,names,status", [("PASS", 0, "[]", "ok"), ("FAIL", 1, "['152064 backward']", "FAILED")]
)
def test_bench_row_reads_the_tables_and_the_checks(monkeypatch, tmp_path, verdict, failed, names, status):
    summary = PASSED_SUMMARY if verdict == "PASS" else FAILED_SUMMARY
    output = BENCH_OUTPUT.format(verdict=verdict, summary=summary)
    completed = subprocess.CompletedProcess([], failed, output, "")
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *args, **kwargs: completed)
    row = gpu_check.GpuCheck(tmp_path, "tiny", on_gpu=True).bench()
    assert row.status == status
    passed = 3 - failed
    assert row.measured == (
        f"stats 4096 x 152064: 1.20 ms (0.07x peer); update 4096 x 5120 x 152064: 29.00 ms "
        f"(0.80x peer); checks {passed}/3 pass"
    )


def test_gpu_rows_from_a_training_run(tmp_path):
    check = gpu_check.GpuCheck(tmp_path, "tiny", on_gpu=False)
    check.trained = {
        "te_modules": ["TELayerNormColumnParallelLinear", "TERowParallelLinear"],
        "use_te": True,
        "device": "NVIDIA H200",
        "peak_bytes": 2**30,
        "micro_batch_tokens": 1024,
        "kl_chunk_size": 1024,
    }
    assert check.te_spec().status == "ok"
    check.trained["te_modules"] = []
    assert check.te_spec().status == "FAILED"
    row = check.memory()
    assert row.measured.startswith("measured 1.000 GiB; predicted ") and row.expected.startswith(
        "ratio measured/predicted"
    )
    table = gpu_check.render([row]).splitlines()
    assert table[0].split(" | ")[0].strip() == "check" and table[1].startswith("planner peak memory")
