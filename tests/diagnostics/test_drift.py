"""The paper's drift statistics on K (F6's head share of Var(K), F7's RMSE and dispersion, GVPO's noise): closed forms."""

import math

import pytest
import torch

from megatron_zcpo.algorithms import AlgorithmConfig, ResponseStats, build_algorithm
from megatron_zcpo.diagnostics.drift import drift_dispersion, gvpo_noise_rms, head_variance_share, k1_drift_rmse


def _stats(group_ids, rewards, lengths, kl_sum, k1_sum):
    as64 = lambda values: torch.tensor(values, dtype=torch.float64)  # noqa: E731
    return ResponseStats(
        torch.tensor(group_ids), as64(rewards), as64(lengths), kl_sum=as64(kl_sum), k1_sum=as64(k1_sum)
    )


# Three groups of one-token responses: within a group every response shares the context, so the
# conditional KL is the same while k1 differs with the sampled token; group 2's rewards tie.
SINGLE_TOKEN = dict(
    group_ids=[0, 0, 0, 0, 1, 1, 1, 2, 2],
    rewards=[1, 0, 0, 1, 0, 1, 0, 1, 1],
    lengths=[1] * 9,
    kl_sum=[0.03] * 4 + [0.01] * 3 + [0.02] * 2,
    k1_sum=[0.2, -0.1, 0.05, 0.4, -0.3, 0.1, 0.2, 0.7, -0.2],
)


def test_f7_rmse_is_on_k_and_the_coefficient_residual_is_beta_times_it():
    stats = _stats(**SINGLE_TOKEN)
    k1 = stats.k1_sum
    centred = torch.cat([k1[:4] - k1[:4].mean(), k1[4:7] - k1[4:7].mean()])  # the tied group is left out
    expected = float(centred.square().mean().sqrt())
    assert float(k1_drift_rmse(stats)) == pytest.approx(expected, rel=1e-12)
    # For a ZCPO run: C^k1 - C^kappa = -beta (K^k1 - K^kappa), so the old coefficient-level figure was beta x.
    beta = 3.0
    coefficients = {
        drift: build_algorithm(AlgorithmConfig(name="zcpo", beta=beta, drift=drift).resolved())
        .coefficients(stats)
        .double()
        for drift in ("k1", "conditional_kl")
    }
    residual = (coefficients["k1"] - coefficients["conditional_kl"])[:7]
    assert float(residual.square().mean().sqrt()) == pytest.approx(beta * expected, rel=1e-12)
    # k1 equal to the conditional KL (no token-sampling noise): zero RMSE
    no_noise = _stats(**{**SINGLE_TOKEN, "k1_sum": [0.03] * 4 + [0.01] * 3 + [0.02] * 2})
    assert float(k1_drift_rmse(no_noise)) == 0.0


def test_f7_rmse_length_normalises_before_centring():
    # one group, T = (2, 4); k1 sums (1.0, 0.4) -> D~ (0.5, 0.1), K = (0.2, -0.2); kappa sums (0.2, 0.4) -> D~ = 0.1 both
    stats = _stats([0, 0], [1, 0], [2, 4], [0.2, 0.4], [1.0, 0.4])
    assert float(k1_drift_rmse(stats)) == pytest.approx(0.2, rel=1e-12)


def test_f7_dispersion_relative_to_the_small_kl_reference_scale_closed_form():
    # one active group of 4, T = 8 tokens each, conditional KL 0.01 per token (D^kappa = 0.08 each):
    # reference = sqrt(2 * 0.08 / 64) = 0.05; k1's D~ = c +- a with a = 0.03 -> K^k1 = (a, -a, a, -a),
    # pooled within-group sd = sqrt(4 a^2 / 3); K^kappa = 0.
    a, T = 0.03, 8
    k1 = [(0.01 + s * a) * T for s in (1, -1, 1, -1)]
    stats = _stats([5, 5, 5, 5, 6, 6], [1, 0, 0, 1, 1, 1], [T] * 4 + [3, 3], [0.08] * 4 + [9.0, 1.0], k1 + [4.0, 0.0])
    dispersion = drift_dispersion(stats)
    assert float(dispersion.reference_scale) == pytest.approx(0.05, rel=1e-12)
    assert float(dispersion.k1_ratio) == pytest.approx(math.sqrt(4 * a * a / 3) / 0.05, rel=1e-12)
    assert float(dispersion.kappa_ratio) == 0.0
    inactive = _stats([0, 0], [1, 1], [3, 3], [0.1, 0.2], [0.1, 0.3])
    assert all(math.isnan(float(value)) for value in drift_dispersion(inactive))


def test_f7_dispersion_ratio_is_one_when_k1_is_pure_sampling_noise():
    """Monte Carlo: responses of T tokens sampled from pi in one context, pi close to pi_ref.

    Var_pi(log pi - log pi_ref) = 2 KL to second order, so the ratio measures about 1: exactly
    sqrt(Var / (2 KL)) up to the sampling error of 3,000 responses.
    """
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(32, generator=generator, dtype=torch.float64)
    ref_logits = logits + 0.15 * torch.randn(32, generator=generator, dtype=torch.float64)
    logp, ref_logp = torch.log_softmax(logits, -1), torch.log_softmax(ref_logits, -1)
    p, delta = logp.exp(), logp - ref_logp
    kl = float((p * delta).sum())
    exact_ratio = math.sqrt(float((p * (delta - kl).square()).sum()) / (2 * kl))
    groups, G, T = 375, 8, 16
    tokens = torch.multinomial(p.expand(groups * G, -1), T, replacement=True, generator=generator)
    stats = ResponseStats(
        torch.arange(groups).repeat_interleave(G),
        torch.arange(groups * G).double() % 2,
        torch.full((groups * G,), float(T), dtype=torch.float64),
        kl_sum=torch.full((groups * G,), T * kl, dtype=torch.float64),
        k1_sum=delta[tokens].sum(-1),
    )
    dispersion = drift_dispersion(stats)
    assert abs(exact_ratio - 1) < 0.05  # the small-KL approximation itself
    assert float(dispersion.k1_ratio) == pytest.approx(exact_ratio, rel=0.04)  # sd of the estimate ~ 1.4%
    assert float(dispersion.reference_scale) == pytest.approx(math.sqrt(2 * kl / T), rel=1e-12)
    # and the RMSE on K is the k1 noise itself: sqrt((G-1)/G) of the per-response sd
    assert float(k1_drift_rmse(stats)) == pytest.approx(
        exact_ratio * math.sqrt(2 * kl / T) * math.sqrt((G - 1) / G), rel=0.04
    )


def test_gvpo_noise_rms_is_beta_times_the_centred_sequence_sum_residual():
    # residual S^k1 - S^kappa = (1.5, -0.5, 3.5, -2.5) in group 0 (mean 0.5 -> (1, -1, 3, -3)): RMS sqrt(5);
    # not length-normalised (GVPO's x_i is a sum); group 1 is tied and left out.
    stats = _stats(
        [0, 0, 0, 0, 1, 1],
        [1, 0, 1, 0, 2, 2],
        [3, 30, 7, 1, 2, 2],
        [0.5, 1.0, 0.5, 3.0, 0.0, 0.0],
        [2.0, 0.5, 4.0, 0.5, 9.0, -9.0],
    )
    assert float(gvpo_noise_rms(stats, beta=0.1)) == pytest.approx(0.1 * math.sqrt(5.0), rel=1e-12)


def test_f6_head_share_of_var_k_closed_form():
    # one group of two responses of T = 20: head (first 10 tokens) kappa sums differ by 0.04, the
    # rest by 0.96, so K = +-(0.04 + 0.96) / 40 and the head's share of Var(K) is 0.04 / 1.00.
    kl_sum = [0.10 + 0.04 + 0.96, 0.10]
    head = torch.tensor([0.05 + 0.04, 0.05], dtype=torch.float64)
    stats = _stats([0, 0], [1, 0], [20, 20], kl_sum, [0.0, 0.0])
    assert float(head_variance_share(head, stats)) == pytest.approx(0.04, rel=1e-12)
    # the head's and the rest's shares add to 1, whatever the lengths
    stats = _stats([0, 0, 0, 1, 1], [1, 0, 0, 1, 0], [20, 12, 30, 5, 9], [0.9, 0.4, 1.3, 0.2, 0.5], [0] * 5)
    head = torch.tensor([0.3, 0.2, 0.1, 0.15, 0.05], dtype=torch.float64)
    share = float(head_variance_share(head, stats))
    assert share + float(head_variance_share(stats.kl_sum - head, stats)) == pytest.approx(1.0, rel=1e-12)
    # every drift in the head: share 1; no drift differences at all: undefined
    assert float(head_variance_share(stats.kl_sum, stats)) == pytest.approx(1.0, rel=1e-12)
    flat = _stats([0, 0], [1, 0], [4, 4], [0.4, 0.4], [0, 0])
    assert math.isnan(float(head_variance_share(torch.tensor([0.1, 0.2], dtype=torch.float64), flat)))
