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
    result = subprocess.run([sys.executable, "tools/gpu_check.py", "--out", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == gpu_check.EXIT_NO_GPU, result.stdout[-3000:] + result.stderr[-3000:]
    table = result.stdout[result.stdout.index("# gpu_check"):]
    for check in ("convert HF -> Megatron", "log-probs + 2 steps, fp32 TP1 (local spec)", "planner peak memory",
                  "--verify converted model (local spec)", "zcpo train + resume"):
        assert any(line.startswith(check) and "| ok " in line for line in table.splitlines()), (check, table)
    skipped = "no GPU: skipped TE layer spec model, bf16 training on the GPU, bench_token_stats --gpu, measured peak memory"
    assert result.stdout.rstrip().splitlines()[-1] == skipped
    assert (tmp_path / "megatron" / "model_config.json").is_file() and (tmp_path / "hf" / "config.json").is_file()


BENCH_OUTPUT = """# GPU: NVIDIA H200, torch 2.10, 4096 tokens x 152064 vocab, hidden 5120, bf16 inputs
             ours (logits):     1.20 ms  peak +     40 MiB  2.08 TB/s = 48% of H200 HBM
               ours fused:     9.00 ms  peak +    600 MiB  560 TFLOP/s = 71% of H200 bf16
                    check: bf16 GEMM with fp32 output vs upcast operands: KL max rel diff {kl}, logprob max abs diff 1.0e-06
"""


@pytest.mark.parametrize("kl,status", [("3.1e-05", "ok"), ("5.0e-01", "FAILED")])
def test_bench_row_reads_the_roofline_and_the_gemm_check(monkeypatch, tmp_path, kl, status):
    completed = subprocess.CompletedProcess([], 0, BENCH_OUTPUT.format(kl=kl), "")
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda *args, **kwargs: completed)
    row = gpu_check.GpuCheck(tmp_path, "tiny", on_gpu=True).bench()
    assert row.status == status
    assert row.measured == f"KL rel diff {kl}; 48% HBM, 71% bf16"


def test_gpu_rows_from_a_training_run(tmp_path):
    check = gpu_check.GpuCheck(tmp_path, "tiny", on_gpu=False)
    check.trained = {"te_modules": ["TELayerNormColumnParallelLinear", "TERowParallelLinear"], "use_te": True,
                     "device": "NVIDIA H200", "peak_bytes": 2 ** 30, "micro_batch_tokens": 1024, "kl_chunk_size": 1024}
    assert check.te_spec().status == "ok"
    check.trained["te_modules"] = []
    assert check.te_spec().status == "FAILED"
    row = check.memory()
    assert row.measured.startswith("measured 1.000 GiB; predicted ") and row.expected.startswith("ratio measured/predicted")
    table = gpu_check.render([row]).splitlines()
    assert table[0].split(" | ")[0].strip() == "check" and table[1].startswith("planner peak memory")
