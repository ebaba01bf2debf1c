"""Group advantages: std / max-abs / none against per-group float64 loops, ties, singletons, guards."""

import statistics

import pytest
import torch

from megatron_zcpo.algorithms.advantages import active_groups, group_advantages


def _random_groups(seed, sizes=(1, 2, 3, 5, 8)):
    """Rewards [N] float64 and shuffled int64 group ids with the given (unequal) sizes."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((size,), 1000 - 7 * q, dtype=torch.int64) for q, size in enumerate(sizes)])
    order = torch.randperm(ids.numel(), generator=gen)
    rewards = torch.randn(ids.numel(), generator=gen, dtype=torch.float64)
    return rewards, ids[order]


def _reference(rewards, ids, norm, eps):
    """Per-group Python loop with the statistics module (sample std, divisor G-1)."""
    out = [0.0] * len(rewards)
    for group in set(ids.tolist()):
        rows = [i for i, g in enumerate(ids.tolist()) if g == group]
        values = [rewards[i].item() for i in rows]
        mean = statistics.fmean(values)
        for i, value in zip(rows, values):
            centred = value - mean
            if len(values) < 2:
                out[i] = 0.0
            elif norm == "std":
                out[i] = centred / (statistics.stdev(values) + eps)
            elif norm == "max_abs":
                out[i] = centred / max(abs(v - mean) for v in values)
            else:
                out[i] = centred
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("norm", ["std", "max_abs", "none"])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_per_group_reference(norm, seed):
    rewards, ids = _random_groups(seed)
    got = group_advantages(rewards, ids, norm=norm, eps=1e-6)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _reference(rewards, ids, norm, 1e-6), rtol=1e-12, atol=1e-14)


def test_float32_by_default():
    rewards, ids = _random_groups(3)
    assert group_advantages(rewards.float(), ids).dtype == torch.float32
    assert group_advantages(rewards.to(torch.bfloat16), ids).dtype == torch.float32


@pytest.mark.parametrize("norm", ["std", "max_abs", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tied_groups_and_singletons_are_exactly_zero(norm, dtype):
    # 0.1 * 3 / 3 != 0.1 in floating point: a naive max-abs normalisation turns that residue into +-1
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, -2.0, 0.3, 0.3], dtype=dtype)
    ids = torch.tensor([4, 4, 4, 9, 2, 2, 5])
    got = group_advantages(rewards, ids, norm=norm)
    assert torch.equal(got[[0, 1, 2, 3]], torch.zeros(4, dtype=dtype))
    assert (got[4] < 0) and (got[5] > 0)
    assert torch.equal(active_groups(rewards, ids), torch.tensor([False, False, False, False, True, True, False]))


@pytest.mark.parametrize("group_size", [2, 5, 16])
def test_binary_rewards_scale_is_two_max_over_g(group_size):
    """With +-1 rewards and k correct of G, s_q = max|A| = 2 max(k, G-k) / G."""
    for correct in range(1, group_size):
        rewards = torch.tensor([1.0] * correct + [-1.0] * (group_size - correct), dtype=torch.float64)
        ids = torch.zeros(group_size, dtype=torch.int64)
        centred = group_advantages(rewards, ids, norm="none")
        scale = 2 * max(correct, group_size - correct) / group_size
        assert centred.abs().max().item() == pytest.approx(scale, rel=1e-14)
        torch.testing.assert_close(group_advantages(rewards, ids, norm="max_abs"), centred / scale)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_names_the_group(bad):
    rewards = torch.tensor([1.0, 0.0, bad, 2.0])
    with pytest.raises(ValueError, match="group id 31"):
        group_advantages(rewards, torch.tensor([7, 7, 31, 31]))


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="norm"):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.int64), norm="mean")
    with pytest.raises(ValueError, match="integer"):
        group_advantages(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="rewards must have shape"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.int64))
