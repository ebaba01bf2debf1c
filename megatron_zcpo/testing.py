"""The multi-rank test harness: :func:`run_distributed` (from :mod:`megatron_zcpo.utils.spawn`) for tests."""

from megatron_zcpo.utils.spawn import DistributedRunFailure as DistributedTestFailure
from megatron_zcpo.utils.spawn import run_distributed

__all__ = ["DistributedTestFailure", "run_distributed"]
