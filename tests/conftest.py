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
