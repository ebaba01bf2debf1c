"""Per-rollout diagnostics of the frozen coefficients every algorithm shares (gate, reward-direction flips)."""

from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from megatron_zcpo.algorithms.advantages import active_groups, group_advantages
from megatron_zcpo.algorithms.groups import Groups
from megatron_zcpo.algorithms.response_stats import ResponseStats


def coefficient_metrics(stats: ResponseStats, coefficients: Tensor) -> Dict[str, float]:
    """Scalars describing one rollout's coefficients, for any algorithm (see ``Algorithm.coefficient_metrics``).

    stats: the rollout's non-empty responses [N]; coefficients: their [N] coefficients.
    active_group_fraction (groups with G >= 2 and untied rewards), coef_abs_mean (mean |C|),
    reward_flip_fraction (share of responses with R_i != group mean whose coefficient points
    against R_i - mean R: the reference information reversed the reward's direction), and when
    the stats carry them: k1_negative_fraction (responses whose summed k1 is negative, F7).
    {} when there is no response.
    """
    coefficients = coefficients.to(torch.float64)
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
    return metrics
