"""F1-F7 diagnostics through the trainer: closed-form cases on the tiny model, and equal values at every layout."""

import math

import pytest
import torch

from megatron_zcpo.testing import run_distributed
from tests.cases import diagnostics_cases


@pytest.fixture(scope="module")
def single(weights):
    return run_distributed(diagnostics_cases.hook_metrics, 1, 1, 1, *weights)[0]


@pytest.fixture(scope="module")
def closed(weights):
    return run_distributed(diagnostics_cases.closed_forms, 1, *weights)[0]


def _same(a, b, rel=1e-4, abs_=1e-7):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=rel, abs=abs_)


def test_hook_runs_every_family_through_train_step(single):
    for algorithm in ("zcpo", "grpo"):
        assert single[f"{algorithm}_update_change"] == 0.0  # the probes never reach the optimizer
        metrics = single[algorithm]
        for name in (
            "grad_kl_share",
            "f2_cancellation",
            "f2_kl_share_high_cancellation",
            "f3_tied_group_fraction",
            "f4_corr_length_kl_sum",
            "f5_kl_share_long",
            "f6_kl_top1pct_share",
            "f6_first_token_kl",
            "f6_head10_var_share",
            "f7_k1_drift_rmse",
            "f7_noise_reference_scale",
            "f7_k1_dispersion_ratio",
            "f7_gvpo_noise_rms",
        ):
            assert math.isfinite(metrics[f"diag/{name}"]), (algorithm, name)
        assert metrics["diag/f3_tied_group_fraction"] == 0.2  # one group of five has identical rewards
        assert 0 < metrics["diag/grad_kl_share"] < 1
        assert metrics["diag/f6_kl_top1pct_share"] < metrics["diag/f6_kl_top10pct_share"] <= 1
    assert single["zcpo"]["diag/grad_reward_norm"] != single["grpo"]["diag/grad_reward_norm"]
    # F1 after the step's updates: whatever gates closed, ZCPO's direct gradient there is zero
    assert single["zcpo"]["diag/f1_direct_grad_closed_norm"] == 0.0
    assert 0 <= single["grpo"]["diag/f1_closed_fraction"] < 1


@pytest.mark.parametrize(
    "tp,pp,world", [pytest.param(2, 1, 2, id="TP2"), pytest.param(1, 2, 2, id="PP2"), pytest.param(1, 1, 2, id="DP2")]
)
def test_layouts_give_the_single_process_values(single, weights, tp, pp, world):
    results = run_distributed(diagnostics_cases.hook_metrics, world, tp, pp, *weights)
    for rank, result in enumerate(results):
        for algorithm in ("zcpo", "grpo"):
            expected = single[algorithm]
            assert result[f"{algorithm}_update_change"] == 0.0
            assert result[algorithm].keys() == expected.keys()
            for name, value in expected.items():
                assert _same(result[algorithm][name], value), (rank, algorithm, name, result[algorithm][name], value)
            # bitwise the same on every rank (the trainer merges them into every rank's step metrics)
            assert all(_same(result[algorithm][k], v, rel=0, abs_=0) for k, v in results[0][algorithm].items())


def test_f2_shared_prefix_cancels_exactly(closed):
    """Mirrored groups: identical responses in the same context, equal weights, opposite coefficients."""
    result = closed["mirrored_groups"]
    for algorithm in ("zcpo", "grpo"):
        metrics = result[algorithm]
        assert metrics["diag/f2_cancellation"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["diag/f2_group_cancellation_mean"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["diag/grad_reward_norm"] < 1e-6
    # vanilla: the KL loss does not cancel, so it is the whole gradient of these groups
    assert result["grpo"]["diag/grad_kl_norm"] > 1e-4
    for name in (
        "grad_kl_share",
        "f2_kl_share_low_cancellation",
        "f2_kl_share_high_cancellation",
        "f5_kl_share_short",
        "f5_kl_share_long",
    ):
        assert result["grpo"][f"diag/{name}"] == pytest.approx(1.0, abs=1e-4), name
    # ZCPO: identical responses have identical drift, so K = 0 and there is no KL branch at all
    assert result["zcpo"]["diag/grad_kl_norm"] == 0.0
    assert result["zcpo"]["diag/f2_kl_share_high_cancellation"] == 0.0


def test_f7_single_token_groups(closed):
    result = closed["single_token_groups"]
    samples, kl, k1 = result["samples"], result["kl"].double(), result["k1"].double()
    group_ids = torch.tensor([s.group_id for s in samples])
    centred = []
    for group in (0, 1):  # group 2 has identical rewards: gated out of both coefficients
        members = group_ids == group
        assert float(kl[members].max() - kl[members].min()) < 1e-6  # one context: one conditional KL
        assert float(k1[members].max() - k1[members].min()) > 1e-2  # k1 differs with the sampled token
        centred.append(k1[members] - k1[members].mean())
    # K, not beta * K (beta = 2 in this run): one-token responses, so K^k1 is k1 minus its group mean
    expected_rms = torch.cat(centred).square().mean().sqrt()
    metrics = result["metrics"]
    assert metrics["diag/f7_k1_drift_rmse"] == pytest.approx(float(expected_rms), rel=1e-4)
    assert metrics["diag/f7_gvpo_noise_rms"] == pytest.approx(0.1 * float(expected_rms), rel=1e-4)  # gvpo_beta 0.1
    assert metrics["diag/f7_kappa_dispersion_ratio"] == pytest.approx(0.0, abs=1e-3)  # one context: K^kappa = 0
    assert metrics["diag/f7_k1_negative_fraction"] == pytest.approx(float((k1 < 0).double().mean()))


def test_f1_closed_gates(closed):
    result = closed["clipped_last_minibatch"]
    for case in result.values():
        metrics = case["metrics"]
        assert case["first"] == {}  # F1 is measured before the last mini-batch only
        assert metrics["diag/f1_closed_tokens"] == case["closed_tokens"] > 0
        assert metrics["diag/f1_closed_fraction"] == pytest.approx(case["closed_tokens"] / case["trainable_tokens"])
        assert metrics["diag/f1_kl_grad_norm"] > 0
    # ZCPO: the direct gradient at closed gates is exactly zero; the KL branch alone is not
    assert result["zcpo"]["metrics"]["diag/f1_direct_grad_closed_norm"] == 0.0
    assert 0 < result["zcpo"]["metrics"]["diag/f1_kl_share_closed"] < 1
    # vanilla: the KL loss keeps pushing there, and that is all the direct gradient there is
    vanilla = result["grpo"]["metrics"]
    assert 0 < vanilla["diag/f1_kl_share_closed"] < 1
    assert vanilla["diag/f1_direct_grad_closed_norm"] == pytest.approx(
        vanilla["diag/f1_kl_share_closed"] * vanilla["diag/f1_kl_grad_norm"], rel=1e-5
    )
    # F1-B masks the KL loss at closed gates: nothing is left there
    masked = result["grpo_f1b"]["metrics"]
    assert masked["diag/f1_kl_share_closed"] == 0.0 and masked["diag/f1_direct_grad_closed_norm"] == 0.0


def test_f3_identical_reward_groups(closed):
    result = closed["tied_groups"]
    for metrics in result.values():
        assert metrics["diag/f3_tied_group_fraction"] == 0.2
    assert result["zcpo"]["diag/f3_tied_grad_norm"] == 0.0  # gated: no gradient at all
    assert result["dapo"]["diag/f3_tied_grad_norm"] == 0.0  # no KL anywhere
    assert result["grpo"]["diag/f3_tied_grad_norm"] > 0  # the independent KL loss alone
    assert result["zcpo_ungated"]["diag/f3_tied_grad_norm"] > 0  # -beta * K_i without the gate
    assert result["dapo"]["diag/grad_kl_norm"] == 0.0 and math.isnan(result["dapo"]["diag/f4_corr_length_penalty"])
    assert result["zcpo"]["diag/f4_corr_length_kl_sum"] > 0.9  # summed KL grows with length (F4)
