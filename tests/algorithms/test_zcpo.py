"""ZCPO calibration: drift, zero sum, shift invariance, drift ordering, gate, closed form (KKT), ablations."""

import pytest
import torch

from megatron_zcpo.algorithms.advantages import active_groups, group_advantages
from megatron_zcpo.algorithms.zcpo import sequence_drift, zcpo_coefficients

SIZES = (1, 2, 3, 4, 7, 16)


def _rollout(seed, sizes=SIZES, tie_group=True):
    """Shuffled groups of unequal sizes: float64 rewards (one all-tied group), drifts and ids."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((size,), 50 + 13 * q, dtype=torch.int64) for q, size in enumerate(sizes)])
    rewards = torch.randint(0, 3, (ids.numel(),), generator=gen).to(torch.float64) - 1.0
    rewards = rewards + 0.1 * torch.rand(ids.numel(), generator=gen, dtype=torch.float64)
    if tie_group:
        rewards[ids == 50 + 13 * (len(sizes) - 2)] = 0.25
    drift = 0.01 + 0.2 * torch.rand(ids.numel(), generator=gen, dtype=torch.float64)
    order = torch.randperm(ids.numel(), generator=gen)
    return rewards[order], drift[order], ids[order]


def _group_sums(values, ids):
    return {g: values[ids == g].sum().item() for g in ids.unique().tolist()}


def test_sequence_drift_sums_and_means_masked_tokens():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0], [7.0, 8.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    torch.testing.assert_close(
        sequence_drift(values, mask, length_normalize=False), torch.tensor([3.0, 10.0, 0.0], dtype=torch.float64)
    )
    torch.testing.assert_close(sequence_drift(values, mask.bool()), torch.tensor([1.5, 5.0, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="token_values and mask"):
        sequence_drift(values, mask[:, :2])


@pytest.mark.parametrize("reward_norm", ["max_abs", "std", "none"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_zero_sum_in_every_active_group(reward_norm, seed):
    rewards, drift, ids = _rollout(seed)
    coefficients = zcpo_coefficients(rewards, drift, ids, beta=4.0, reward_norm=reward_norm)
    active = active_groups(rewards, ids)
    assert active.any() and (~active).any()
    for group, total in _group_sums(coefficients, ids).items():
        assert abs(total) < 1e-12, f"group {group} sums to {total}"
    assert torch.equal(coefficients[~active], torch.zeros_like(coefficients[~active]))
    assert coefficients[active].abs().min() > 0


def test_shared_drift_shift_changes_nothing():
    rewards, drift, ids = _rollout(3)
    shifts = {g: 10.0 * (k + 1) for k, g in enumerate(ids.unique().tolist())}
    shifted = drift + torch.tensor([shifts[g] for g in ids.tolist()], dtype=torch.float64)
    torch.testing.assert_close(
        zcpo_coefficients(rewards, shifted, ids, beta=4.0),
        zcpo_coefficients(rewards, drift, ids, beta=4.0),
        rtol=0,
        atol=1e-12,
    )


def test_equal_rewards_lower_drift_gets_larger_coefficient():
    rewards = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 0.0], dtype=torch.float64)
    drift = torch.tensor([0.30, 0.10, 0.20, 0.05, 0.50, 0.10], dtype=torch.float64)
    coefficients = zcpo_coefficients(rewards, drift, torch.zeros(6, dtype=torch.int64), beta=0.5)
    for i in range(6):
        for j in range(6):
            if rewards[i] == rewards[j] and drift[i] < drift[j]:
                assert coefficients[i] > coefficients[j]
    # beta = 0 removes the preference
    plain = zcpo_coefficients(rewards, drift, torch.zeros(6, dtype=torch.int64), beta=0.0)
    assert plain[0] == plain[1] == plain[2]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("beta", [0.04, 4.0])
def test_closed_form_is_the_constrained_minimiser(seed, beta):
    """C = argmin 1/2 sum (c - a)^2 + beta sum c D~  s.t. sum c = 0, solved per group by its KKT system."""
    rewards, drift, ids = _rollout(seed)
    got = zcpo_coefficients(rewards, drift, ids, beta=beta)
    advantages = group_advantages(rewards, ids, norm="max_abs")
    active = active_groups(rewards, ids)
    for group in ids[active].unique().tolist():
        rows = (ids == group).nonzero().flatten()
        size = rows.numel()
        kkt = torch.zeros(size + 1, size + 1, dtype=torch.float64)
        kkt[:size, :size] = torch.eye(size, dtype=torch.float64)
        kkt[:size, size] = 1.0
        kkt[size, :size] = 1.0
        rhs = torch.cat([advantages[rows] - beta * drift[rows], torch.zeros(1, dtype=torch.float64)])
        solution = torch.linalg.solve(kkt, rhs)[:size]
        torch.testing.assert_close(got[rows], solution, rtol=1e-12, atol=1e-13)


def test_gate_ties_and_singletons():
    rewards = torch.tensor([0.1, 0.1, 0.1, 3.0, 1.0, -1.0], dtype=torch.float64)
    drift = torch.tensor([0.1, 0.2, 0.6, 0.3, 0.2, 0.4], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 2, 2])
    gated = zcpo_coefficients(rewards, drift, ids, beta=2.0)
    assert torch.equal(gated[:4], torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(gated[4:], torch.tensor([1.0 + 0.2, -1.0 - 0.2], dtype=torch.float64))
    ungated = zcpo_coefficients(rewards, drift, ids, beta=2.0, gate=False)
    # reward part 0, drift part kept: K = drift - group mean (0.3 for the tied group, itself for the singleton)
    torch.testing.assert_close(ungated[:4], torch.tensor([0.4, 0.2, -0.6, 0.0], dtype=torch.float64))
    torch.testing.assert_close(ungated[4:], gated[4:])


def test_ablation_switches():
    rewards = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 0])  # group 0: rows 0, 1, 2, 4; group 1: the singleton row 3
    token_kl = torch.tensor(
        [[0.1, 0.3, 0.0], [0.2, 0.0, 0.0], [0.4, 0.4, 0.4], [0.5, 0.0, 0.0], [0.3, 0.1, 0.2]], dtype=torch.float64
    )
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    beta = 0.5
    mean_drift = sequence_drift(token_kl, mask)
    total_drift = sequence_drift(token_kl, mask, length_normalize=False)
    torch.testing.assert_close(mean_drift, torch.tensor([0.2, 0.2, 0.4, 0.5, 0.2], dtype=torch.float64))
    active = torch.tensor([True, True, True, False, True])
    a_max = torch.tensor([1.0, -1.0, -1.0, 0.0, 1.0], dtype=torch.float64)  # mean 0, s_q = 1

    def expected(a, k):
        return torch.where(active, a - beta * k, torch.zeros_like(a))

    group0 = ids == 0
    centred_mean = mean_drift - torch.where(group0, mean_drift[group0].mean(), mean_drift[3])
    centred_total = total_drift - torch.where(group0, total_drift[group0].mean(), total_drift[3])
    torch.testing.assert_close(zcpo_coefficients(rewards, mean_drift, ids, beta), expected(a_max, centred_mean))
    # no centring: K_i <- D~_i (the zero sum is lost)
    torch.testing.assert_close(
        zcpo_coefficients(rewards, mean_drift, ids, beta, center=False), expected(a_max, mean_drift)
    )
    # no length normalisation: K_i <- D_i - mean D
    torch.testing.assert_close(zcpo_coefficients(rewards, total_drift, ids, beta), expected(a_max, centred_total))
    # std normalisation: a_i <- (R - mean) / (sample std + eps); sample std of (1, -1, -1, 1) is sqrt(4/3)
    a_std = a_max / ((4.0 / 3.0) ** 0.5 + 1e-6)
    torch.testing.assert_close(
        zcpo_coefficients(rewards, mean_drift, ids, beta, reward_norm="std"), expected(a_std, centred_mean)
    )
    # k1 drift: any per-token values work, including negative sampled log-ratios
    k1 = torch.tensor(
        [[-0.3, 0.1, 9.0], [0.2, 9.0, 9.0], [0.0, 0.1, -0.4], [1.0, 9.0, 9.0], [0.3, 0.3, 0.3]], dtype=torch.float64
    )
    k1_drift = sequence_drift(k1, mask)
    torch.testing.assert_close(k1_drift, torch.tensor([-0.1, 0.2, -0.1, 1.0, 0.3], dtype=torch.float64))
    centred_k1 = k1_drift - torch.where(group0, k1_drift[group0].mean(), k1_drift[3])
    torch.testing.assert_close(zcpo_coefficients(rewards, k1_drift, ids, beta), expected(a_max, centred_k1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_drift_names_the_group(bad):
    drift = torch.tensor([0.1, 0.2, bad, 0.0])
    with pytest.raises(ValueError, match="drift of response row 2 in group id 12"):
        zcpo_coefficients(torch.tensor([1.0, 0.0, 1.0, 0.0]), drift, torch.tensor([3, 3, 12, 12]), beta=1.0)


def test_bad_beta_and_shapes_raise():
    ids = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="beta"):
        zcpo_coefficients(torch.zeros(2), torch.zeros(2), ids, beta=-1.0)
    with pytest.raises(ValueError, match="drift must have shape"):
        zcpo_coefficients(torch.zeros(2), torch.zeros(3), ids, beta=1.0)
