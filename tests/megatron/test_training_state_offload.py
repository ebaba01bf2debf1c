"""Colocated placement's trainer offload: parameters, gradients and optimizer states round-trip bit-exactly."""

import pytest

from megatron_zcpo.testing import run_distributed
from tests.cases.colocation_cases import offload_round_trip, plain_two_steps


@pytest.mark.parametrize(("world", "tp", "bf16", "distributed_optimizer"), [(1, 1, False, False), (2, 2, True, True)])
def test_offload_and_onload_round_trip_bit_exactly(world, tp, bf16, distributed_optimizer):
    results = run_distributed(offload_round_trip, world, tp, bf16, distributed_optimizer)
    reference = run_distributed(plain_two_steps, world, tp, bf16, distributed_optimizer)
    for result, plain in zip(results, reference):
        assert result["emptied"] and result["exact"]
        assert result["freed"] == result["restored"] == result["total"] > 0
        deterministic = [k for k in plain if not k.startswith("time/") and not k.endswith("_per_s")]
        assert {k: result["next"][k] for k in deterministic} == {k: plain[k] for k in deterministic}
