"""KL baselines: k1/k2/k3 values and gradients, KL in the reward, full conditional KL, F1-B and F1-C."""

import math

import pytest
import torch

from megatron_zcpo.algorithms.advantages import group_advantages
from megatron_zcpo.algorithms.config import AlgorithmConfig
from megatron_zcpo.algorithms.kl import kl_penalty
from megatron_zcpo.algorithms.registry import ResponseStats, build_algorithm


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_estimator_values_and_gradients(kind):
    logprob = torch.tensor([-0.1, -2.0, -0.7, -3.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-0.3, -1.2, -0.7, -0.5], dtype=torch.float64)
    values = kl_penalty(logprob, ref, kind)
    (grad,) = torch.autograd.grad(values.sum(), logprob)
    for lp, r, value, slope in zip(logprob.tolist(), ref.tolist(), values.tolist(), grad.tolist()):
        delta = lp - r
        expected = {
            "k1": (delta, 1.0),
            "k2": (delta**2 / 2, delta),
            "k3": (math.exp(-delta) + delta - 1, 1 - math.exp(-delta)),
        }[kind]
        assert value == pytest.approx(expected[0], rel=1e-13, abs=1e-15)
        assert slope == pytest.approx(expected[1], rel=1e-13, abs=1e-15)


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_k1_and_k3_are_unbiased_for_the_conditional_kl(kind):
    """E_{v ~ pi}[k(log pi_v, log ref_v)] = KL(pi || ref), checked exactly over a 7-token vocabulary."""
    gen = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), dim=0)
    logq = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), dim=0)
    exact = torch.nn.functional.kl_div(logq, logp, log_target=True, reduction="sum")
    expectation = (logp.exp() * kl_penalty(logp, logq, kind)).sum()
    assert expectation.item() == pytest.approx(exact.item(), rel=1e-12)


def test_k3_is_accurate_for_tiny_differences():
    delta = torch.tensor([1e-9, 1e-6, -1e-6, 1e-3], dtype=torch.float64)
    got = kl_penalty(delta, torch.zeros_like(delta), "k3")
    series = delta**2 / 2 - delta**3 / 6 + delta**4 / 24
    torch.testing.assert_close(got, series, rtol=1e-6, atol=0)
    assert (kl_penalty(delta.float(), torch.zeros(4), "k3") >= 0).all()


def _batch(seed):
    """Two groups, four responses of up to 5 tokens, ratios wide enough to clip both ways."""
    gen = torch.Generator().manual_seed(seed)
    old = -1.0 - torch.rand(4, 5, generator=gen, dtype=torch.float64)
    logprob = (old + 0.5 * torch.randn(4, 5, generator=gen, dtype=torch.float64)).requires_grad_(True)
    ref = old + 0.3 * torch.randn(4, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    coefficients = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    return logprob, old, ref, mask, coefficients


def _gradient(config, logprob, old, ref, mask, coefficients):
    algorithm = build_algorithm(config)
    out = algorithm.loss(logprob, old, mask, coefficients, normalizer=algorithm.normalizer_count(mask), ref_logprob=ref)
    (grad,) = torch.autograd.grad(out.loss, logprob)
    return grad, out


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_f1_controls_mask_or_rescale_the_kl_gradient(kind, agg):
    logprob, old, ref, mask, coefficients = _batch(0)
    common = dict(name="dapo", kl_loss=kind, kl_coef=0.3, agg=agg)
    reward_only, _ = _gradient(AlgorithmConfig(name="dapo", agg=agg), logprob, old, ref, mask, coefficients)
    vanilla, out = _gradient(AlgorithmConfig(**common), logprob, old, ref, mask, coefficients)
    masked, _ = _gradient(AlgorithmConfig(**common, f1_control="mask_clipped"), logprob, old, ref, mask, coefficients)
    scaled, scaled_out = _gradient(
        AlgorithmConfig(**common, f1_control="match_masked_norm"), logprob, old, ref, mask, coefficients
    )
    gate = out.clip_gate
    assert (~gate & (mask != 0)).any() and gate.any()
    kl_gradient = vanilla - reward_only
    # F1-B: no KL force where the reward gate is closed, unchanged elsewhere
    torch.testing.assert_close(masked - reward_only, torch.where(gate, kl_gradient, 0.0), rtol=1e-12, atol=1e-15)
    # F1-C: the full KL gradient scaled by ||masked|| / ||full|| (per-token log-prob space)
    alpha = torch.where(gate, kl_gradient, 0.0).norm() / kl_gradient.norm()
    assert 0 < alpha < 1
    torch.testing.assert_close(scaled_out.metrics["kl_alpha"], alpha, rtol=1e-12, atol=0)
    torch.testing.assert_close(scaled - reward_only, alpha * kl_gradient, rtol=1e-12, atol=1e-15)


def test_f1c_alpha_is_one_when_the_kl_gradient_vanishes():
    logprob, old, _, mask, coefficients = _batch(1)
    config = AlgorithmConfig(name="grpo", kl_loss="k2", f1_control="match_masked_norm")
    _, out = _gradient(config, logprob, old, logprob.detach(), mask, coefficients)
    assert out.metrics["kl_alpha"].item() == 1.0 and out.metrics["kl_loss"].item() == 0.0


@pytest.mark.parametrize("f1_control", ["none", "mask_clipped"])
def test_full_conditional_kl_loss_gradient(f1_control):
    logprob, old, _, mask, coefficients = _batch(2)
    current_kl = torch.rand(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(9)).requires_grad_(True)
    algorithm = build_algorithm(AlgorithmConfig(name="grpo", kl_loss="full", kl_coef=0.2, f1_control=f1_control))
    assert algorithm.needs_current_kl and algorithm.needs_reference
    out = algorithm.loss(logprob, old, mask, coefficients, normalizer=20, current_kl=current_kl)
    (grad,) = torch.autograd.grad(out.loss, current_kl)
    keep = (mask != 0) & (out.clip_gate if f1_control == "mask_clipped" else True)
    torch.testing.assert_close(grad, torch.where(keep, 0.2 / 20, 0.0).to(torch.float64))
    with pytest.raises(ValueError, match="needs current_kl"):
        algorithm.loss(logprob, old, mask, coefficients, normalizer=20)


def test_kl_in_reward_subtracts_the_summed_k1():
    stats = ResponseStats(
        group_ids=torch.tensor([5, 5, 5, 8, 8]),
        rewards=torch.tensor([1.0, -1.0, 1.0, 0.0, 1.0], dtype=torch.float64),
        lengths=torch.tensor([3, 4, 2, 6, 1]),
        k1_sum=torch.tensor([0.5, -0.2, 2.0, 0.1, 0.3], dtype=torch.float64),
    )
    algorithm = build_algorithm({"name": "dapo", "kl_in_reward_coef": 0.1})
    assert algorithm.required_stats == ("k1_sum",) and algorithm.needs_reference
    expected = group_advantages(stats.rewards - 0.1 * stats.k1_sum, stats.group_ids, norm="std")
    torch.testing.assert_close(algorithm.coefficients(stats), expected)
    with pytest.raises(ValueError, match="ResponseStats.k1_sum is required"):
        algorithm.coefficients(ResponseStats(stats.group_ids, stats.rewards, stats.lengths))
