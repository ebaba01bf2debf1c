"""Shared pytest settings and fixtures: quiet CPU fallback warnings, threads, the trainer tests' weights."""

import os
import warnings

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
# Triton decides at import whether its jit functions (its own standard library included) run in the
# interpreter, and megatron-core imports triton; without a GPU the kernel tests need the interpreter, so
# it is chosen here, before any test module imports either.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (is|are) not installed.*")


@pytest.fixture(scope="session")
def weights():
    """(policy, reference) global weights of the tiny trainer model (tests/cases/trainer_cases.py), built once."""
    from megatron_zcpo.testing import run_distributed
    from tests.cases import trainer_cases

    return run_distributed(trainer_cases.policy_and_reference, 1)[0]


# `make test` runs two pytest-xdist workers with ``--dist loadgroup``: a group's tests run in one worker,
# in collection order. Every test file is a group (its module fixtures are built once); a folder whose
# files share something one machine has once is one group: the real SGLang servers (one per release per
# session, killers last: tests/rollout/sglang/real/conftest.py). Tests that start servers take free ports
# (or, the example jobs, their own random loopback subnet); the one-machine Slurm cluster is one file's.
SHARED_GROUPS = {"tests/rollout/sglang/real/": "real-sglang-servers"}
# The workers take the groups in collection order (`--no-loadscope-reorder`: xdist would order them by
# their number of tests, which put the one-test demo guard near the end): longest first, so that the last
# groups taken are short and both workers finish together. Seconds each group took beside the other
# worker (2-core Xeon VM, 2026-12-05); unlisted groups are shorter and keep their order.
GROUP_SECONDS = {
    "tests/cli/test_example_jobs_slurm.py": 470,
    "real-sglang-servers": 390,
    "tests/cli/test_demo_learning_guard.py": 280,
    "tests/cli/test_example_jobs.py": 250,
    "tests/training/test_trainer_layouts.py": 225,
    "tests/training/test_lora.py": 220,
    "tests/recipe/test_exact_resume.py": 200,
    "tests/megatron/test_parallel.py": 190,
    "tests/cli/test_user_mistakes.py": 150,
    "tests/cli/test_demo_end_to_end.py": 145,
    "tests/megatron/test_sequence_parallel.py": 125,
    "tests/megatron/test_deepseek_training.py": 100,
    "tests/megatron/test_moe_layouts.py": 95,
    "tests/recipe/test_colocated.py": 95,
    "tests/recipe/test_interrupted_step.py": 90,
    "tests/cli/test_train.py": 80,
    "tests/recipe/test_cluster_time_scales.py": 80,
    "tests/checkpoint/test_trainer_checkpoint.py": 75,
    "tests/checkpoint/test_checkpoint_faults.py": 60,
    "tests/recipe/test_overlap.py": 70,
    "tests/convert/test_convert_deepseek.py": 65,
    "tests/tools/test_gpu_check.py": 55,
    "tests/recipe/test_weight_push_stages.py": 55,
    "tests/megatron/test_training_state_offload.py": 55,
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups from the markers
def pytest_collection_modifyitems(config, items):
    """Give every test its xdist group (its file's, or the shared one its file belongs to) and put the
    groups in the order the workers should take them (:data:`GROUP_SECONDS`; a group's own order kept)."""
    root = config.rootpath
    groups = {}
    for item in items:
        marker = item.get_closest_marker("xdist_group")
        if marker is None:
            path = item.path.relative_to(root).as_posix()
            group = next((name for prefix, name in SHARED_GROUPS.items() if path.startswith(prefix)), path)
            item.add_marker(pytest.mark.xdist_group(group))
        else:
            group = marker.args[0] if marker.args else marker.kwargs.get("name", "default")
        groups[item] = group
    items.sort(key=lambda item: -GROUP_SECONDS.get(groups[item], 0))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """On an xdist worker under ``--dist loadgroup``: refuse to run when the groups did not reach the test ids
    (pytest 9.2 keeps a node's id where pytest-xdist 3.8 cannot suffix it; every test would then be its own
    group, module fixtures built in both workers and the real servers started twice)."""
    if getattr(session.config.option, "loadgroup", False) and any("@" not in item.nodeid for item in session.items):
        raise pytest.UsageError(
            f"pytest-xdist's groups were not applied (pytest {pytest.__version__}): install the pytest the "
            "dev extra pins (setup.py)"
        )
