"""The paper's drift statistics on K (F6, F7, GVPO's noise): K from k1 or the conditional KL, per group.

Every statistic here is on the paper's K, not on a method's coefficient C = a - beta * K, so it is
the same number whatever beta a run uses: K_i = D~_i - mean_{j in group} D~_j with the
length-normalised drift D~_i = D_i / T_i, D_i = sum_t kappa_{i,t} (conditional KL) or
sum_t (log pi_old - log pi_ref)(y_{i,t}) (k1, the sampled log-ratio). They are taken over the
responses of reward-active groups (at least two non-empty responses, rewards not all equal: the
groups whose coefficients use K); empty responses are left out of their group as
``Algorithm.coefficients`` leaves them out. All inputs are per-response scalars of a whole rollout
(:class:`~megatron_zcpo.algorithms.registry.ResponseStats`); every function returns 0-dim float64
tensors, NaN when no group is active (or the statistic is 0 / 0).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from megatron_zcpo.algorithms.advantages import active_groups
from megatron_zcpo.algorithms.groups import Groups
from megatron_zcpo.algorithms.response_stats import ResponseStats
from megatron_zcpo.algorithms.zcpo import centred_drift


class ActiveResponses(NamedTuple):
    """The responses the statistics use: a boolean row mask [N] and their groups."""

    rows: Tensor
    groups: Groups


def active_responses(stats: ResponseStats) -> ActiveResponses:
    """Non-empty responses of reward-active groups (see module doc) and the Groups of those rows."""
    nonempty = stats.lengths > 0
    rows = torch.zeros_like(nonempty)
    rows[nonempty] = active_groups(stats.rewards[nonempty], stats.group_ids[nonempty])
    return ActiveResponses(rows, Groups.of(stats.group_ids[rows]))


def active_k(sums: Tensor, stats: ResponseStats, active: ActiveResponses) -> Tensor:
    """K over the active rows: sums [N] (per-response D_i) / T_i, minus the mean of its group. Returns [n_active]."""
    normalised = sums.to(torch.float64)[active.rows] / stats.lengths.to(torch.float64)[active.rows]
    return centred_drift(normalised, active.groups)


def _nan() -> Tensor:
    return torch.tensor(math.nan, dtype=torch.float64)


def _rms(values: Tensor) -> Tensor:
    return values.square().mean().sqrt() if values.numel() else _nan()


def k1_drift_rmse(stats: ResponseStats) -> Tensor:
    """F7: RMSE between the k1-based and the conditional-KL-based K, sqrt(mean_i (K^k1_i - K^kappa_i)^2).

    Where the responses of a group share their prefixes' conditional KL, the difference is the
    token-sampling noise of k1 (ZCPO's own local residual is exactly 0). A ZCPO coefficient built
    from either K differs by beta times this (the coefficient-level residual).
    """
    active = active_responses(stats)
    return _rms(active_k(stats.k1_sum, stats, active) - active_k(stats.kl_sum, stats, active))


class DriftDispersion(NamedTuple):
    """F7 / Fig. 3g: within-group dispersion of K relative to the small-KL sampling-noise scale.

    reference_scale: sqrt(mean_i 2 D^kappa_i / T_i^2), the RMS over responses of the standard
    deviation that token sampling alone gives a length-normalised k1 drift; k1_ratio and
    kappa_ratio: the pooled within-group standard deviation of K^k1 and of K^kappa,
    sqrt(sum_q sum_i K_i^2 / sum_q (n_q - 1)), divided by that scale.
    """

    reference_scale: Tensor
    k1_ratio: Tensor
    kappa_ratio: Tensor


def drift_dispersion(stats: ResponseStats) -> DriftDispersion:
    """:class:`DriftDispersion` of a rollout.

    Why the scale: given its prefix, the sampled log-ratio delta of a token has variance
    Var_pi(delta) = 2 KL + O(KL^{3/2}) (exact to second order in the log-ratio), and the tokens'
    deviations from their conditional means are uncorrelated (martingale differences), so a
    response's D~^k1 carries sampling variance sum_t 2 kappa_t / T^2 around D~^kappa. The pooled
    sample variance (divisor n_q - 1) of independent responses has that mean variance as its
    expectation, so k1_ratio is about 1 when K^k1's dispersion is sampling noise alone.
    """
    active = active_responses(stats)
    lengths = stats.lengths.to(torch.float64)[active.rows]
    if lengths.numel() == 0:
        return DriftDispersion(_nan(), _nan(), _nan())
    reference = (2.0 * stats.kl_sum.to(torch.float64)[active.rows].clamp(min=0) / lengths.square()).mean().sqrt()
    dof = float((active.groups.sizes - 1).sum())

    def ratio(sums: Tensor) -> Tensor:
        dispersion = (active_k(sums, stats, active).square().sum() / dof).sqrt()
        return dispersion / reference if reference > 0 else _nan()

    return DriftDispersion(reference, ratio(stats.k1_sum), ratio(stats.kl_sum))


def gvpo_noise_rms(stats: ResponseStats, beta: float) -> Tensor:
    """GVPO's sampling noise (Fig. 4b): RMS of beta * ((S^k1_i - S^kappa_i) - its group mean).

    GVPO weights response i by beta * (x_i - mean x) - A_i with x_i the summed sampled log-ratio
    sum_t delta_{i,t} (not length-normalised, see algorithms/baselines.py gvpo_loss); given the
    prefixes, x_i's expectation is sum_t kappa_{i,t}, so this is the part of GVPO's centred
    reference term that is token-sampling noise, measured here against the run's reference.
    """
    active = active_responses(stats)
    residual = (stats.k1_sum.to(torch.float64) - stats.kl_sum.to(torch.float64))[active.rows]
    return beta * _rms(residual - active.groups.broadcast(active.groups.mean(residual)))


def head_variance_share(head_kl_sum: Tensor, stats: ResponseStats) -> Tensor:
    """F6: share of Var(K^kappa) carried by the first response tokens, sum_i K_i H_i / sum_i K_i^2.

    head_kl_sum [N]: per response, sum of kappa over its first tokens (the paper: 10). K^kappa
    splits linearly into H (the K built from those sums, still divided by the full T_i) plus the K
    of the remaining tokens, and Var(K) = Cov(K, H) + Cov(K, rest): the share is H's term, and the
    two shares add to 1 (the share can be negative when head and rest drift oppositely).
    """
    active = active_responses(stats)
    whole = active_k(stats.kl_sum, stats, active)
    head = active_k(head_kl_sum, stats, active)
    variance = whole.square().sum()
    return (whole * head).sum() / variance if variance > 0 else _nan()
