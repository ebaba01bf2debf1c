"""ZCPO calibration: per-response drift and the zero-sum calibrated coefficients C_i = a_i - beta*K_i."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_zcpo.algorithms.advantages import active_groups, group_advantages
from megatron_zcpo.algorithms.groups import Groups, float_dtype


def sequence_drift(token_values: Tensor, mask: Tensor, length_normalize: bool = True) -> Tensor:
    """Per-response drift D_i (or D~_i) from per-token values.

    token_values: [N, T] per-token drift (conditional KL kappa, or k1 Delta = old - ref);
    mask: [N, T] (bool or 0/1) response tokens. Returns [N]: the sum over the masked tokens of
    each row, divided by the row's token count when ``length_normalize``. Rows without a token
    get 0 (no division by zero); values under the mask's zeros are ignored even if NaN/inf.
    float32, or float64 when token_values are float64.
    """
    if token_values.dim() != 2 or mask.shape != token_values.shape:
        raise ValueError(f"token_values and mask must both be [N, T]; got {tuple(token_values.shape)} "
                         f"and {tuple(mask.shape)}")
    selected = mask != 0
    values = token_values.to(float_dtype(token_values))
    totals = torch.where(selected, values, torch.zeros_like(values)).sum(dim=-1)
    if not length_normalize:
        return totals
    counts = selected.sum(dim=-1).to(values.dtype)
    return totals / counts.clamp(min=1.0)


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
    """ZCPO's detached per-response coefficients (SPEC section 1, steps 3-5).

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
    relative_drift = drift - groups.broadcast(groups.mean(drift)) if center else drift
    coefficients = advantages - beta * relative_drift
    if not gate:
        return coefficients  # inactive groups already have a_i = 0
    return torch.where(active_groups(rewards, group_ids), coefficients, torch.zeros_like(coefficients))
