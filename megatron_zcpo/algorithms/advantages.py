"""Group-relative reward advantages (GRPO std, ZCPO max-abs, Dr.GRPO none) and the reward-active gate."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_zcpo.algorithms.groups import Groups, float_dtype

REWARD_NORMS = ("std", "max_abs", "none")


def _centred_rewards(rewards: Tensor, groups: Groups) -> tuple[Tensor, Tensor]:
    """A_i = R_i - mean of its group, and the [N] mask of responses whose group's rewards all tie.

    Ties are detected as max == min, not as A == 0: the mean of equal floats is not always that
    float (three rewards of 0.1 average to 0.1 + 1e-17), and max-abs normalisation would blow
    such a rounding residue up to +-1. Tied groups get A exactly 0.
    """
    groups.check_rows("rewards", rewards)
    rewards = rewards.to(float_dtype(rewards))
    groups.check_finite("reward", rewards)
    tied = groups.broadcast(groups.max(rewards) == groups.min(rewards))
    centred = rewards - groups.broadcast(groups.mean(rewards))
    return centred.masked_fill(tied, 0.0), tied


def group_advantages(rewards: Tensor, group_ids: Tensor, norm: str = "std", eps: float = 1e-6) -> Tensor:
    """Group-relative advantages.

    rewards: [N]; group_ids: [N] integer prompt ids (any order, groups of any size).
    A_i = R_i - mean of R over the group. norm="std" (GRPO): A_i / (sample std of the group with
    divisor G-1, + eps); "max_abs" (ZCPO): A_i / max_j |A_j| over the group, 0 where that max is 0;
    "none" (Dr.GRPO): A_i. Singletons and groups whose rewards all tie get exactly 0.
    Returns [N], float32 (float64 when rewards are float64). Raises ValueError naming the group id
    of a NaN/inf reward.
    """
    if norm not in REWARD_NORMS:
        raise ValueError(f"norm must be one of {REWARD_NORMS}, got {norm!r}")
    groups = Groups.of(group_ids)
    centred, _ = _centred_rewards(rewards, groups)
    if norm == "none":
        return centred
    if norm == "std":
        degrees_of_freedom = (groups.sizes - 1).clamp(min=1).to(centred.dtype)
        std = (groups.sum(centred.square()) / degrees_of_freedom).sqrt()
        return centred / (groups.broadcast(std) + eps)
    scale = groups.broadcast(groups.max(centred.abs()))
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.where(scale > 0, centred / safe_scale, torch.zeros_like(centred))


def active_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """The ZCPO reward gate B_q = 1{G >= 2} * 1{s_q > 0}, per response.

    rewards, group_ids: [N]. Returns [N] bool: True where the response's group has at least two
    members whose rewards are not all equal.
    """
    _, tied = _centred_rewards(rewards, Groups.of(group_ids))
    return ~tied  # a singleton's rewards trivially tie, so G >= 2 is implied
