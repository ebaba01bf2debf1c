"""Comparison methods named by the ZCPO paper: RPG-REINFORCE (UFKL, RPG-style clip) and GVPO."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron_zcpo.algorithms.groups import Groups
from megatron_zcpo.algorithms.surrogates import (
    Normalizer,
    PolicyLossOutput,
    check_clip_range,
    check_token_tensors,
    gated_loss_output,
    per_token,
)


def rpg_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantage: Tensor,
    mask: Tensor,
    *,
    kl_coef: float = 1e-4,
    ref_logprob: Optional[Tensor] = None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: Optional[float] = 3.0,
    agg: str = "token-mean",
    normalizer: Optional[Normalizer] = None,
    token_weight: Optional[Tensor] = None,
) -> PolicyLossOutput:
    """RPG-REINFORCE with the unnormalised forward-KL (UFKL) correction and RPG-style clip.

    Follows Zhang, Liu, Yuan, Yuan, Gu, Yao, "On the Design of KL-Regularized Policy Gradient
    Algorithms for LLM Reasoning" (arXiv:2505.17508), as implemented in the authors' code
    (github.com/complex-reasoning/RPG, verl/trainer/ppo/core_algos.py, kl_type "rpg_rf_ufkl"
    with "clip_ppo"). Objective: E[R] - kl_coef * UKL(pi_ref || pi_theta), with
    UKL(p || q) = sum_y p log(p/q) + q - p, sampled from pi_old. With w = pi_theta/pi_old,
    w~ = clip(w, 1 - clip_low, 1 + clip_high) and rho = pi_ref/pi_old, each token's gradient
    weight is omega = A*w + kl_coef*(rho - w~) (rho = 1 when the reference is the refreshed
    sampling policy, ref_logprob=None, as in the authors' code), and the loss is
    -stopgrad(omega) * logprob where the RPG-style gate is open: A > 0 needs w < 1 + clip_high;
    A <= 0 needs w >= 1 - clip_low and, with clip_c, w < clip_c. Closed tokens give no gradient.

    logprob: [N, T] (differentiable); old_logprob, mask, ref_logprob, token_weight: [N, T];
    advantage: [N] or [N, T] (the paper's R - group mean). agg / normalizer as in policy_loss.
    Returns PolicyLossOutput (clip_high_fraction: A > 0 gated; clip_low_fraction: A <= 0 below
    1 - clip_low; dual_clip_fraction: A <= 0 at or above clip_c).
    """
    check_token_tensors(
        mask, logprob=logprob, old_logprob=old_logprob, ref_logprob=ref_logprob, token_weight=token_weight
    )
    check_clip_range(clip_low, clip_high, clip_c)
    advantage = per_token("advantage", advantage, mask, logprob.dtype)

    selected = mask != 0
    zeros = torch.zeros_like(logprob)
    with torch.no_grad():
        ratio = torch.exp(torch.where(selected, logprob - old_logprob, zeros))
        reference_ratio = (
            torch.exp(torch.where(selected, ref_logprob - old_logprob, zeros))
            if ref_logprob is not None
            else torch.ones_like(ratio)
        )
        weight = advantage * ratio + kl_coef * (reference_ratio - ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
        positive = advantage > 0
        clipped_high = positive & (ratio >= 1.0 + clip_high)
        clipped_low = ~positive & (ratio < 1.0 - clip_low)
        dual_clipped = ~positive & (ratio >= clip_c) if clip_c is not None else torch.zeros_like(selected)
        gate = selected & ~(clipped_high | clipped_low | dual_clipped)
    token_losses = torch.where(gate, -weight * logprob, zeros)
    return gated_loss_output(
        token_losses, mask, agg, normalizer, token_weight, gate, clipped_low, clipped_high, dual_clipped
    )


def gvpo_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    advantage: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    *,
    beta: float = 0.1,
    normalizer: Optional[Normalizer] = None,
) -> Tensor:
    """GVPO's group-variance loss (scalar, differentiable in logprob).

    Follows Zhang, Hong, Bao, Jiang, Song, Hong, Xiong, "GVPO: Group Variance Policy Optimization
    for Large Language Model Post-Training" (arXiv:2504.19599, NeurIPS 2025) and the authors' verl
    recipe (recipe/gvpo/gvpo_core_algos.py, compute_policy_loss_gvpo): with the sequence log-ratio
    x_i = beta * sum_t (logprob - old_logprob) against the previous policy,
        loss = sum_groups 1/(G-1) sum_i 1/2 ((x_i - mean_group x) - A_i)^2 / normalizer,
    where A_i = R_i - mean R is ``advantage`` (already centred over the whole group). Its
    gradient is beta/(G-1) * ((x_i - mean x) - A_i) * grad sum_t logprob: GVPO needs no importance
    weights and no clipping.

    logprob, old_logprob, mask: [N, T]; advantage, group_ids: [N]. Every group must lie whole in
    this call (the mean of x is over the rows given). Rows without a token are not group members;
    singleton groups contribute 0. normalizer: global count of rows with >= 1 token (default:
    this call's count).
    """
    check_token_tensors(mask, logprob=logprob, old_logprob=old_logprob)
    for name, rows in (("group_ids", group_ids), ("advantage", advantage)):
        if tuple(rows.shape) != tuple(mask.shape[:1]):
            raise ValueError(f"{name} must have shape {tuple(mask.shape[:1])} (one per row), got {tuple(rows.shape)}")
    selected = mask != 0
    members = selected.any(dim=-1)
    groups = Groups.of(group_ids[members])
    log_ratio = torch.where(selected, logprob - old_logprob.detach(), torch.zeros_like(logprob)).sum(dim=-1)
    scaled = beta * log_ratio[members]
    residual = scaled - groups.broadcast(groups.mean(scaled)) - advantage[members].detach().to(logprob.dtype)
    sizes = groups.broadcast(groups.sizes).to(logprob.dtype)
    inverse_dof = torch.where(sizes >= 2, 1.0 / (sizes - 1.0).clamp(min=1.0), torch.zeros_like(sizes))
    if normalizer is None:
        normalizer = members.sum()
    divisor = torch.as_tensor(normalizer, dtype=logprob.dtype, device=logprob.device)
    return (0.5 * residual.square() * inverse_dof).sum() / divisor.clamp(min=1.0)
