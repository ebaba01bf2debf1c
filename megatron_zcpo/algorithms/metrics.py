"""Per-rollout diagnostics of the frozen coefficients (gate, reward-direction flips, drift scale)."""

from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from megatron_zcpo.algorithms.advantages import active_groups, group_advantages
from megatron_zcpo.algorithms.config import AlgorithmConfig
from megatron_zcpo.algorithms.groups import Groups
from megatron_zcpo.algorithms.registry import ResponseStats, response_drift


def coefficient_metrics(stats: ResponseStats, coefficients: Tensor, config: AlgorithmConfig) -> Dict[str, float]:
    """Scalars describing one rollout's coefficients (computed once, on any rank that holds them all).

    stats: the rollout's ResponseStats [N]; coefficients: [N] from ``Algorithm.coefficients``;
    config: the algorithm's resolved config. Over non-empty responses:
    active_group_fraction (groups with G >= 2 and untied rewards), coef_abs_mean (mean |C|),
    reward_flip_fraction (share of responses with R_i != group mean whose coefficient points
    against R_i - mean R: the reference information reversed the reward's direction), and when
    the stats carry them: k1_negative_fraction (responses whose summed k1 is negative, F7),
    and for ZCPO drift_mean (mean D~ or D) and drift_peak_mean / drift_peak_max
    (beta * max_i |K_i| per active group: how far the drift term can move a coefficient whose
    reward part is at most 1).
    """
    nonempty = stats.lengths > 0
    stats = stats.rows(nonempty)
    coefficients = coefficients[nonempty].to(torch.float64)
    rewards = stats.rewards.to(torch.float64)
    metrics: Dict[str, float] = {}
    if rewards.numel() == 0:
        return metrics
    groups = Groups.of(stats.group_ids)
    active = active_groups(rewards, stats.group_ids)
    metrics["active_group_fraction"] = float(groups.max(active.to(torch.float64)).mean())
    metrics["coef_abs_mean"] = float(coefficients.abs().mean())
    centred = group_advantages(rewards, stats.group_ids, norm="none")
    directed = centred != 0
    flipped = (coefficients * centred < 0) & directed
    metrics["reward_flip_fraction"] = float(flipped.sum() / directed.sum().clamp(min=1))
    if stats.k1_sum is not None:
        metrics["k1_negative_fraction"] = float((stats.k1_sum < 0).to(torch.float64).mean())
    drift_field = stats.kl_sum if config.drift == "conditional_kl" else stats.k1_sum
    if config.name == "zcpo" and drift_field is not None:
        drift = response_drift(stats, config.drift, config.length_normalize).to(torch.float64)
        relative = drift - groups.broadcast(groups.mean(drift)) if config.center else drift
        peak = config.beta * groups.max(torch.where(active, relative.abs(), torch.zeros_like(relative)))
        peak = peak[groups.max(active.to(torch.float64)) > 0]
        metrics["drift_mean"] = float(drift.mean())
        if peak.numel():
            metrics["drift_peak_mean"] = float(peak.mean())
            metrics["drift_peak_max"] = float(peak.max())
    return metrics
