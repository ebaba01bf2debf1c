"""ZCPO calibration in one place: per-response drift D_i, centred drift K_i and C_i = a_i - beta*K_i.

The drift of a response is its summed (or length-normalised) divergence from the reference:
:func:`sequence_drift` computes it from per-token values [N, T], :func:`response_drift` from the
per-response sums the trainer gathers (``ResponseStats``); :func:`centred_drift` subtracts the group
mean; :func:`zcpo_coefficients` is the formula; :func:`drift_metrics` reports its scale per rollout.
"""

from __future__ import annotations

import math
from typing import Dict

import torch
from torch import Tensor

from megatron_zcpo.algorithms.advantages import active_groups, group_advantages
from megatron_zcpo.algorithms.groups import Groups, float_dtype
from megatron_zcpo.algorithms.response_stats import ResponseStats


def sequence_drift(token_values: Tensor, mask: Tensor, length_normalize: bool = True) -> Tensor:
    """Per-response drift D_i (or D~_i) from per-token values.

    token_values: [N, T] per-token drift (conditional KL kappa, or k1 Delta = old - ref);
    mask: [N, T] (bool or 0/1) response tokens. Returns [N]: the sum over the masked tokens of
    each row, divided by the row's token count when ``length_normalize``. Rows without a token
    get 0 (no division by zero); values under the mask's zeros are ignored even if NaN/inf.
    float32, or float64 when token_values are float64.
    """
    if token_values.dim() != 2 or mask.shape != token_values.shape:
        raise ValueError(
            f"token_values and mask must both be [N, T]; got {tuple(token_values.shape)} and {tuple(mask.shape)}"
        )
    selected = mask != 0
    values = token_values.to(float_dtype(token_values))
    totals = torch.where(selected, values, torch.zeros_like(values)).sum(dim=-1)
    if not length_normalize:
        return totals
    counts = selected.sum(dim=-1).to(values.dtype)
    return totals / counts.clamp(min=1.0)


def response_drift(stats: ResponseStats, drift: str = "conditional_kl", length_normalize: bool = True) -> Tensor:
    """ZCPO's per-response drift [N] from rollout stats: D_i = kl_sum (or k1_sum for drift='k1'),
    divided by the length T_i when ``length_normalize`` (0 for empty responses)."""
    name = "kl_sum" if drift == "conditional_kl" else "k1_sum"
    drift_sum = getattr(stats, name)
    if drift_sum is None:
        raise ValueError(f"ResponseStats.{name} is needed for drift={drift!r}")
    values = drift_sum.to(float_dtype(stats.rewards))
    if not length_normalize:
        return values
    lengths = stats.lengths.to(values.dtype)
    return torch.where(lengths > 0, values / lengths.clamp(min=1.0), torch.zeros_like(values))


def centred_drift(drift: Tensor, groups: Groups, center: bool = True) -> Tensor:
    """K_i: the drift [N] minus its group's mean when ``center`` (else the drift itself); [N]."""
    return drift - groups.broadcast(groups.mean(drift)) if center else drift


def zcpo_coefficients(
    rewards: Tensor,
    drift: Tensor,
    group_ids: Tensor,
    beta: float,
    *,
    reward_norm: str = "max_abs",
    center: bool = True,
    gate: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """ZCPO's detached per-response coefficients: group advantage minus beta times the centred drift.

    rewards, drift, group_ids: [N]; drift is D~_i (or D_i, or a k1 drift: the ablations pick).
    C_i = a_i - beta * K_i with a_i = group_advantages(rewards, group_ids, norm=reward_norm, eps)
    and K_i = drift_i - mean of drift over the group when ``center`` (else drift_i). In an active
    group (G >= 2 and s_q = max|R - mean R| > 0) with center=True, sum_i C_i = 0 and C is the
    unique minimiser of 1/2 sum (c_i - a_i)^2 + beta sum c_i drift_i subject to sum c_i = 0.
    gate=True: inactive groups get C_i = 0. gate=False: their a_i is 0 and they keep -beta*K_i.
    Returns [N], float32 (float64 when rewards are float64). Raises ValueError naming the group
    id of a NaN/inf reward or drift.
    """
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta >= 0):
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
    groups = Groups.of(group_ids)
    groups.check_rows("drift", drift)
    advantages = group_advantages(rewards, group_ids, norm=reward_norm, eps=eps)
    drift = drift.to(advantages.dtype)
    groups.check_finite("drift", drift)
    relative_drift = centred_drift(drift, groups, center)
    coefficients = advantages - beta * relative_drift
    if not gate:
        return coefficients  # inactive groups already have a_i = 0
    return torch.where(active_groups(rewards, group_ids), coefficients, torch.zeros_like(coefficients))


def drift_metrics(stats: ResponseStats, config) -> Dict[str, float]:
    """The drift's scale over one rollout's non-empty responses ``stats`` [N] (``config``: ZCPO's
    resolved AlgorithmConfig): drift_mean (mean D~ or D) and drift_peak_mean / drift_peak_max
    (beta * max_i |K_i| per active group: how far the drift term can move a coefficient whose
    reward part is at most 1). {} when the stats lack the configured drift's sums.
    """
    drift_sum = stats.kl_sum if config.drift == "conditional_kl" else stats.k1_sum
    if drift_sum is None:
        return {}
    groups = Groups.of(stats.group_ids)
    active = active_groups(stats.rewards.to(torch.float64), stats.group_ids)
    drift = response_drift(stats, config.drift, config.length_normalize).to(torch.float64)
    relative = centred_drift(drift, groups, config.center)
    peak = config.beta * groups.max(torch.where(active, relative.abs(), torch.zeros_like(relative)))
    peak = peak[groups.max(active.to(torch.float64)) > 0]
    metrics = {"drift_mean": float(drift.mean())}
    if peak.numel():
        metrics["drift_peak_mean"] = float(peak.mean())
        metrics["drift_peak_max"] = float(peak.max())
    return metrics
