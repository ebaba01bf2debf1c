"""Colocated placement's trainer offload: parameters, gradients and optimizer states round-trip bit-exactly."""

import pytest

from megatron_zcpo.testing import run_distributed
from tests.cases.colocation_cases import offload_round_trip, plain_two_steps


@pytest.mark.parametrize(
    ("world", "tp", "bf16", "distributed_optimizer", "ep"),
    [(1, 1, False, False, 1), (2, 2, True, True, 1), (2, 1, True, True, 2)],
    ids=["fp32", "tp2-bf16-distopt", "ep2-moe-bf16-distopt"],
)
def test_offload_and_onload_round_trip_bit_exactly(world, tp, bf16, distributed_optimizer, ep):
    results = run_distributed(offload_round_trip, world, tp, bf16, distributed_optimizer, ep)
    reference = run_distributed(plain_two_steps, world, tp, bf16, distributed_optimizer, ep)
    for result, plain in zip(results, reference):
        assert result["emptied"] and result["exact"]
        assert result["freed"] == result["restored"] == result["total"] > 0
        deterministic = [k for k in plain if not k.startswith("time/") and not k.endswith("_per_s")]
        assert {k: result["next"][k] for k in deterministic} == {k: plain[k] for k in deterministic}
