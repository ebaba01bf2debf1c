"""Every registered algorithm and KL variant trains one step through megatron's schedules and
gradient finalisation at TP2 and PP2 exactly as at TP1 (kl_loss=full runs PolicyWithReference)."""

import pytest
import torch

from megatron_zcpo.testing import run_distributed
from tests.cases import algorithm_cases

COMPARED = (
    "update/loss",
    "update/policy_loss",
    "update/kl_loss",
    "update/grad_norm",
    "experience/kl",
    "coef/coef_abs_mean",
)

LAYOUTS = [(2, 1), (1, 2)]


@pytest.fixture(scope="module")
def steps(weights):
    """TP1 in one process, then TP2 and PP2 in the same two processes: every variant, one step each."""
    single = run_distributed(algorithm_cases.every_variant, 1, [(1, 1)], *weights, timeout=600)[0]
    parallel = run_distributed(algorithm_cases.every_variant, 2, LAYOUTS, *weights, timeout=600)
    return single, parallel


def test_registry_variants_cover_every_algorithm():
    from megatron_zcpo.algorithms.config import KL_LOSSES
    from megatron_zcpo.algorithms.registry import ALGORITHMS

    variants = algorithm_cases.VARIANTS.values()
    assert {v["name"] for v in variants} == set(ALGORITHMS)
    assert {v.get("kl_loss", "k3" if v["name"] == "grpo" else "none") for v in variants} == set(KL_LOSSES)
    assert {v.get("drift") for v in variants if v["name"] == "zcpo"} == {None, "k1"}


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=["TP2", "PP2"])
@pytest.mark.parametrize("variant", list(algorithm_cases.VARIANTS))
def test_variant_matches_single_process(steps, weights, variant, tp, pp):
    single, parallel = steps
    expected = single[1, 1, variant]
    moved = max((expected["params"][n] - w).abs().max().item() for n, w in weights[0].items())
    assert moved > 1e-4 and expected["metrics"]["update/grad_norm"] > 0
    for rank, result in enumerate(rank[tp, pp, variant] for rank in parallel):
        for name in COMPARED:
            if name in expected["metrics"]:
                assert result["metrics"][name] == pytest.approx(expected["metrics"][name], rel=1e-5, abs=1e-6), (
                    rank,
                    name,
                )
        if result["coefficients"] is not None:  # the last pipeline stage
            torch.testing.assert_close(result["coefficients"], expected["coefficients"], rtol=1e-5, atol=1e-6)
        for name, value in expected["params"].items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=0, msg=name)
        if expected["probe_norm"] is not None:  # the diagnostics' probe with the reference alongside
            assert result["probe_norm"] == pytest.approx(expected["probe_norm"], rel=1e-5)
    if "kl_coef" in algorithm_cases.VARIANTS[variant]:
        assert abs(expected["metrics"]["update/kl_loss"]) > 1e-6
