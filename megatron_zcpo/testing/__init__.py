"""Test helpers users' own CI can import: the multi-rank harness and SGLang test doubles.

:func:`run_distributed` runs a function in N gloo processes (from :mod:`megatron_zcpo.utils.spawn`);
:mod:`megatron_zcpo.testing.mock_server` and :mod:`megatron_zcpo.testing.mock_router` are an SGLang server and
router speaking the HTTP protocol of the versions they name (``python -m megatron_zcpo.testing.mock_server``);
:mod:`megatron_zcpo.testing.real_sglang` installs and runs the real sglang-router and reads SGLang's own
parser and request schema from its wheels.
"""

from megatron_zcpo.utils.spawn import DistributedRunFailure as DistributedTestFailure
from megatron_zcpo.utils.spawn import preload_in_ranks, run_distributed

# What the project's multi-rank tests import in every rank (their cases build and train models).
preload_in_ranks(["megatron_zcpo.megatron.model", "megatron_zcpo.training.trainer"])

__all__ = ["DistributedTestFailure", "run_distributed"]
