"""Clipped surrogates: the min/clip formula, gate, dual clip, aggregations and split-exact normalisers."""

import pytest
import torch

from megatron_zcpo.algorithms.surrogates import aggregate, loss_normalizer, policy_loss

N, T = 6, 5


def _batch(seed, per_token_coef=False):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=gen, dtype=torch.float64) * 3
    logprob = old + 0.6 * torch.randn(N, T, generator=gen, dtype=torch.float64)  # ratios from ~0.2 to ~5
    shape = (N, T) if per_token_coef else (N,)
    coef = torch.randn(shape, generator=gen, dtype=torch.float64)
    mask = torch.rand(N, T, generator=gen) > 0.3
    mask[2] = False  # an empty row
    mask[0, 0] = True
    return logprob.requires_grad_(True), old, coef, mask


def _reference_token_losses(logprob, old, coef, clip_low, clip_high, clip_c):
    """verl/TRL-style formula: -min(r c, clip(r) c), then min with -clip_c c for c < 0."""
    c = coef if coef.dim() == 2 else coef[:, None].expand_as(logprob)
    ratio = torch.exp(logprob - old)
    losses = torch.maximum(-ratio * c, -torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * c)
    if clip_c is not None:
        losses = torch.where(c < 0, torch.minimum(losses, -clip_c * c), losses)
    return losses


def _reference_aggregate(losses, mask, agg):
    m = mask.to(losses.dtype)
    if agg == "token-mean":
        return (losses * m).sum() / m.sum()
    rows = m.sum(-1) > 0
    per_row = (losses * m).sum(-1)
    if agg == "seq-mean-token-mean":
        per_row = per_row[rows] / m.sum(-1)[rows]
    else:
        per_row = per_row[rows]
    return per_row.mean()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("clips", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 3.0)])
@pytest.mark.parametrize("per_token_coef", [False, True])
def test_matches_min_clip_formula_value_and_gradient(agg, clips, per_token_coef):
    clip_low, clip_high, clip_c = clips
    logprob, old, coef, mask = _batch(1, per_token_coef)
    out = policy_loss(logprob, old, coef, mask, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c, agg=agg)
    (grad,) = torch.autograd.grad(out.loss, logprob)
    reference = _reference_aggregate(_reference_token_losses(logprob, old, coef, *clips), mask, agg)
    (reference_grad,) = torch.autograd.grad(reference, logprob)
    torch.testing.assert_close(out[0], reference, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, reference_grad, rtol=1e-13, atol=1e-15)
    # the gate is open exactly where the token's reward gradient is non-zero
    assert torch.equal(out.clip_gate, (grad != 0))


def test_gate_and_fractions_by_case():
    # one row, tokens chosen to hit each case; c > 0 on row 0, c < 0 on row 1
    ratios = torch.tensor([[1.0, 1.5, 0.5, 1.28], [1.0, 0.5, 1.5, 4.0]], dtype=torch.float64)
    old = torch.zeros(2, 4, dtype=torch.float64)
    logprob = ratios.log().requires_grad_(True)
    mask = torch.ones(2, 4, dtype=torch.bool)
    out = policy_loss(logprob, old, torch.tensor([1.0, -1.0], dtype=torch.float64), mask, clip_c=3.0)
    expected_gate = torch.tensor([[True, False, True, True], [True, False, True, False]])
    assert torch.equal(out.clip_gate, expected_gate)
    assert out.clip_high_fraction.item() == pytest.approx(1 / 8)
    assert out.clip_low_fraction.item() == pytest.approx(1 / 8)
    assert out.dual_clip_fraction.item() == pytest.approx(1 / 8)
    # values: c > 0 clipped at 1 + 0.28; c < 0 clipped at 1 - 0.2; dual clip caps at 3 * |c|
    expected = torch.tensor([[-1.0, -1.28, -0.5, -1.28], [1.0, 0.8, 1.5, 3.0]], dtype=torch.float64)
    assert out.loss.item() == pytest.approx(expected.mean().item(), rel=1e-14)


def test_clipped_token_with_huge_ratio_has_a_finite_gradient():
    logprob = torch.tensor([[800.0, -1.0]], dtype=torch.float64, requires_grad=True)  # exp(800) overflows
    out = policy_loss(
        logprob, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2)
    )
    out.loss.backward()
    assert torch.isfinite(logprob.grad).all() and logprob.grad[0, 0] == 0


def test_padding_garbage_is_ignored():
    logprob, old, coef, mask = _batch(2)
    poisoned = torch.where(mask, logprob, torch.full_like(logprob, -float("inf")))
    out = policy_loss(poisoned, old, coef, mask)
    (grad,) = torch.autograd.grad(out.loss, logprob)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(out.loss, policy_loss(logprob, old, coef, mask).loss)


def test_token_weight_multiplies_each_token():
    logprob, old, coef, mask = _batch(3)
    weight = torch.rand(N, T, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got = policy_loss(logprob, old, coef, mask, token_weight=weight, agg="seq-mean-token-sum").loss
    reference = _reference_aggregate(
        _reference_token_losses(logprob, old, coef, 0.2, 0.28, None) * weight, mask, "seq-mean-token-sum"
    )
    torch.testing.assert_close(got, reference, rtol=1e-13, atol=0)


def test_aggregations_by_hand():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert aggregate(losses, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(losses, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(losses, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(losses, torch.zeros_like(mask), "token-mean").item() == 0.0
    assert loss_normalizer(mask, "token-mean").item() == 4
    assert loss_normalizer(mask, "seq-mean-token-mean").item() == 2
    with pytest.raises(ValueError, match="agg"):
        aggregate(losses, mask, "sum")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_and_data_parallel_split_is_exact(agg):
    """Rows split over 2 ranks x 2 micro-batches, each loss divided by the global normaliser."""
    logprob, old, coef, mask = _batch(4)
    full = policy_loss(logprob, old, coef, mask, agg=agg).loss
    (full_grad,) = torch.autograd.grad(full, logprob)
    splits = [[0, 5], [3], [1, 2], [4]]  # rank 0: micro-batches 0-1, rank 1: micro-batches 2-3
    normalizer = sum(loss_normalizer(mask[rows], agg) for rows in splits)
    total = sum(
        policy_loss(logprob[rows], old[rows], coef[rows], mask[rows], agg=agg, normalizer=normalizer).loss
        for rows in splits
    )
    (split_grad,) = torch.autograd.grad(total, logprob)
    torch.testing.assert_close(total, full, rtol=1e-14, atol=1e-16)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-14, atol=1e-16)


def test_bad_arguments_raise():
    logprob, old, coef, mask = _batch(5)
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(logprob, old, coef, mask, clip_c=0.5)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(logprob, old, coef, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="old_logprob"):
        policy_loss(logprob, old[:, :2], coef, mask)
    with pytest.raises(ValueError, match="coef"):
        policy_loss(logprob, old, coef[:3], mask)
