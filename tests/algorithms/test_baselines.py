"""RPG-REINFORCE (UFKL, RPG-style clip) and GVPO against hand-computed values."""

import math

import pytest
import torch

from megatron_zcpo.algorithms.baselines import gvpo_loss, rpg_loss

F64 = torch.float64


def _from_ratios(ratios):
    """log-probs with old_logprob = -1 and the given pi/pi_old ratios; [N, T] leaves."""
    old = torch.full_like(ratios, -1.0)
    return (old + ratios.log()).requires_grad_(True), old


def test_rpg_gradient_weights_by_hand():
    # row 0: A = +0.5, ratios 1.1 (open), 1.3 (>= 1 + 0.28: closed), 0.5 (open; clipped weight 0.8)
    # row 1: A = -0.5, ratios 0.7 (< 1 - 0.2: closed), 1.5 (open; clipped weight 1.28), 3.5 (>= clip_c: closed)
    ratios = torch.tensor([[1.1, 1.3, 0.5], [0.7, 1.5, 3.5]], dtype=F64)
    logprob, old = _from_ratios(ratios)
    out = rpg_loss(logprob, old, torch.tensor([0.5, -0.5], dtype=F64), torch.ones(2, 3), kl_coef=0.1)
    (grad,) = torch.autograd.grad(out.loss, logprob)
    # omega = A w + beta (1 - clip(w)):  0.55 - 0.01;  0.25 + 0.02;  -0.75 - 0.028
    expected = torch.tensor([[0.54, 0.0, 0.27], [0.0, -0.778, 0.0]], dtype=F64)
    torch.testing.assert_close(-grad * 6, expected, rtol=1e-13, atol=1e-15)
    assert torch.equal(out.clip_gate, expected != 0)
    assert out.clip_high_fraction.item() == pytest.approx(1 / 6)
    assert out.clip_low_fraction.item() == pytest.approx(1 / 6)
    assert out.dual_clip_fraction.item() == pytest.approx(1 / 6)


def test_rpg_frozen_reference_ratio():
    # rho = pi_ref / pi_old = 2 on the first token: omega = 0.5 * 1.1 + 0.1 * (2 - 1.1) = 0.64
    logprob, old = _from_ratios(torch.tensor([[1.1, 1.0]], dtype=F64))
    ref = old + torch.tensor([[math.log(2.0), 0.0]], dtype=F64)
    out = rpg_loss(
        logprob,
        old,
        torch.tensor([0.5], dtype=F64),
        torch.ones(1, 2),
        kl_coef=0.1,
        ref_logprob=ref,
        agg="seq-mean-token-sum",
    )
    (grad,) = torch.autograd.grad(out.loss, logprob)
    torch.testing.assert_close(-grad, torch.tensor([[0.64, 0.5]], dtype=F64), rtol=1e-13, atol=0)


def test_rpg_on_policy_reduces_to_reinforce():
    """At the snapshot (w = 1, reference = pi_old) the UFKL weight vanishes: gradient = -A / normaliser."""
    logprob, old = _from_ratios(torch.ones(3, 4, dtype=F64))
    advantage = torch.tensor([0.3, -1.2, 0.0], dtype=F64)
    out = rpg_loss(logprob, old, advantage, torch.ones(3, 4), kl_coef=0.5)
    (grad,) = torch.autograd.grad(out.loss, logprob)
    torch.testing.assert_close(-grad * 12, advantage[:, None].expand(3, 4))


def test_gvpo_loss_and_gradient_by_hand():
    beta = 0.5
    # group 7: log-ratios x = (0.3, -0.4, 0.4) over two tokens each (the masked token is garbage),
    # rewards (1, 0, 0) -> A = (2/3, -1/3, -1/3); group 9 is a singleton and contributes nothing
    old = torch.full((4, 2), -2.0, dtype=F64)
    steps = torch.tensor([[0.2, 0.1], [-0.4, 50.0], [0.1, 0.3], [0.7, 0.0]], dtype=F64)
    logprob = (old + steps).requires_grad_(True)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]])
    advantage = torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0], dtype=F64)
    loss = gvpo_loss(logprob, old, advantage, mask, torch.tensor([7, 7, 7, 9]), beta=beta, normalizer=4)
    # beta x = (0.15, -0.2, 0.2), mean 0.05 -> centred (0.1, -0.25, 0.15); residual r = centred - A
    residual = [-17 / 30, 1 / 12, 29 / 60]
    assert loss.item() == pytest.approx(sum(0.5 * r * r for r in residual) / 2 / 4, rel=1e-13)
    (grad,) = torch.autograd.grad(loss, logprob)
    # d/d logprob = beta * r_i / (G - 1) / normaliser on each of the row's tokens (sum_i r_i = 0)
    expected = torch.tensor([[r * beta / 2 / 4] * 2 for r in residual] + [[0.0, 0.0]], dtype=F64) * mask
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


def test_gvpo_on_policy_gradient_is_minus_beta_advantage():
    """At the snapshot x = 0: loss gradient = -beta * A_i / (G - 1) / normaliser per token (the paper's weight)."""
    logprob = torch.full((3, 2), -1.0, dtype=F64, requires_grad=True)
    advantage = torch.tensor([1.0, 0.5, -1.5], dtype=F64)
    loss = gvpo_loss(
        logprob,
        logprob.detach(),
        advantage,
        torch.ones(3, 2),
        torch.zeros(3, dtype=torch.int64),
        beta=0.1,
        normalizer=1,
    )
    (grad,) = torch.autograd.grad(loss, logprob)
    torch.testing.assert_close(grad, (-0.1 * advantage / 2)[:, None].expand(3, 2))


def test_gvpo_checks_row_shapes():
    with pytest.raises(ValueError, match="group_ids must have shape"):
        gvpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3), torch.zeros(3))
