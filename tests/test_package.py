"""The package surface: every public name of API.md imports from `megatron_zcpo`, lazily and CUDA-free."""

import subprocess
import sys

API_NAMES = (
    "group_advantages",
    "sequence_drift",
    "zcpo_coefficients",
    "kl_penalty",
    "policy_loss",
    "vocab_parallel_token_stats",
    "setup_megatron",
)


def test_import_pulls_no_cuda_only_package():
    code = (
        "import sys, megatron_zcpo as m\n"
        f"for name in {API_NAMES!r} + tuple(m.__all__): getattr(m, name)\n"
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('transformer_engine', 'apex', 'sglang', 'sglang_router'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_bare_import_is_light():
    code = "import sys, megatron_zcpo\nprint(int('megatron.core' in sys.modules), int('torch' in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["0", "0"], result.stdout + result.stderr


def test_unknown_name_raises_attribute_error():
    import megatron_zcpo

    try:
        _ = megatron_zcpo.no_such_name
    except AttributeError as error:
        assert "no_such_name" in str(error)
    else:
        raise AssertionError("expected AttributeError")
