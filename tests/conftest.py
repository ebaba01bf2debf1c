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


def pytest_collection_modifyitems(config, items):
    """Give every test its xdist group: its file's, or the shared one its file belongs to."""
    root = config.rootpath
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        path = item.path.relative_to(root).as_posix()
        group = next((name for prefix, name in SHARED_GROUPS.items() if path.startswith(prefix)), path)
        item.add_marker(pytest.mark.xdist_group(group))
