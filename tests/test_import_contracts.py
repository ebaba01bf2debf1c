"""The layers of docs/DEVELOPING.md as a contract: ``lint-imports`` (.importlinter) keeps every one, and names what breaks one."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` of the dev extra (beside this Python) run in ``cwd`` on its .importlinter."""
    command = Path(sys.executable).with_name("lint-imports")
    if not command.exists():
        command = shutil.which("lint-imports")
    assert command, "lint-imports is missing: install the dev extra (pip install -e '.[dev]', import-linter)"
    return subprocess.run([str(command), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_package_keeps_its_import_contracts():
    result = lint_imports(ROOT)
    assert result.returncode == 0, f"an import contract of .importlinter is broken:\n{result.stdout}{result.stderr}"


def test_a_broken_contract_names_the_offending_import(tmp_path):
    """A copy of the package with an upward import, a cycle, a collective in the pure math and an SGLang import
    (the trainer's Python has none) fails every contract."""
    shutil.copytree(ROOT / "megatron_zcpo", tmp_path / "megatron_zcpo", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "tests").mkdir()
    for name in ("__init__.py", "import_contracts.py"):
        shutil.copy(ROOT / "tests" / name, tmp_path / "tests" / name)
    shutil.copy(ROOT / ".importlinter", tmp_path)
    kl = tmp_path / "megatron_zcpo" / "algorithms" / "kl.py"
    kl.write_text(
        kl.read_text() + "\n\ndef _upward():\n    from megatron_zcpo.recipe import config\n"
        "    from torch import distributed\n"
    )
    ops = tmp_path / "megatron_zcpo" / "ops" / "token_stats.py"
    ops.write_text(ops.read_text() + "\n\ndef _model():\n    from megatron.core.models.gpt import GPTModel\n")
    update = tmp_path / "megatron_zcpo" / "training" / "update.py"
    update.write_text(update.read_text() + "\n\ndef _back():\n    from megatron_zcpo.training import trainer\n")
    ipc = tmp_path / "megatron_zcpo" / "rollout" / "sglang" / "update_weight" / "tensor_ipc.py"
    ipc.write_text(
        ipc.read_text()
        + "\n\ndef _patch():\n    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions\n"
    )
    upward = kl.read_text().splitlines().index("    from megatron_zcpo.recipe import config") + 1
    result = lint_imports(tmp_path)
    report = " ".join(result.stdout.split())  # the report wraps long lines
    assert result.returncode == 1, report
    assert "Contracts: 0 kept, 5 broken." in report, report
    assert "megatron_zcpo.rollout.sglang.update_weight.tensor_ipc -> sglang" in report, report
    assert f"megatron_zcpo.algorithms.kl -> megatron_zcpo.recipe.config (l.{upward})" in report, report
    assert ".trainer -> .update" in report or ".update -> .trainer" in report, report
    assert (
        "megatron_zcpo.algorithms.kl is not allowed to import torch.distributed: - megatron_zcpo.algorithms.kl "
        f"(l.{upward + 1}): from torch import distributed"
    ) in report, report
    assert "megatron_zcpo.ops.token_stats is not allowed to import megatron.core.models" in report, report
