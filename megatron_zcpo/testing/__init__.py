"""Test helpers users' own CI can import: the multi-rank harness and SGLang test doubles.

:func:`run_distributed` runs a function in N spawned gloo processes (from :mod:`megatron_zcpo.utils.spawn`);
:mod:`megatron_zcpo.testing.mock_server` and :mod:`megatron_zcpo.testing.mock_router` are an SGLang server and
router speaking the HTTP protocol of the versions they name (``python -m megatron_zcpo.testing.mock_server``);
:mod:`megatron_zcpo.testing.real_sglang` installs and runs the real sglang-router and reads SGLang's own
parser and request schema from its wheels.
"""

from megatron_zcpo.utils.spawn import DistributedRunFailure as DistributedTestFailure
from megatron_zcpo.utils.spawn import run_distributed

__all__ = ["DistributedTestFailure", "run_distributed"]
