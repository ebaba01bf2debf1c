"""Pure tensor statistics of the F1-F7 diagnostics: shares, correlations, concentration, cancellation.

Functions that summarise values spread over data-parallel ranks take ``reduce``: a function that
sums a tensor over the ranks (identity for one process), so the single-process and the
distributed results are the same numbers.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

Reduce = Callable[[Tensor], Tensor]

# +inf's float32 bit pattern: every finite non-negative float32 lies in [0, _INF_BITS).
_INF_BITS = 0x7F800000


def _identity(tensor: Tensor) -> Tensor:
    return tensor


def _ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """numerator / denominator, NaN where the denominator is 0 (the quantity is undefined there)."""
    return torch.where(
        denominator != 0,
        numerator / torch.where(denominator != 0, denominator, 1.0),
        torch.full_like(numerator, math.nan),
    )


class BranchGeometry(NamedTuple):
    """Norms and angle of a reward-branch gradient g_R and a KL-branch gradient g_K (0-dim float64 each).

    total_norm = ||g_R + g_K||; kl_share = ||g_K|| / ||g_R + g_K||, the KL / total gradient-norm
    ratio (NaN when the total is 0).
    """

    reward_norm: Tensor
    kl_norm: Tensor
    total_norm: Tensor
    cosine: Tensor
    kl_share: Tensor


def branch_geometry(reward_sq: float, kl_sq: float, cross: float) -> BranchGeometry:
    """BranchGeometry from the inner products <g_R, g_R>, <g_K, g_K> and <g_R, g_K> of two gradients."""
    reward_sq, kl_sq, cross = (torch.tensor(float(v), dtype=torch.float64) for v in (reward_sq, kl_sq, cross))
    reward_norm, kl_norm = reward_sq.clamp(min=0).sqrt(), kl_sq.clamp(min=0).sqrt()
    total_norm = (reward_sq + kl_sq + 2 * cross).clamp(min=0).sqrt()
    return BranchGeometry(
        reward_norm, kl_norm, total_norm, _ratio(cross, reward_norm * kl_norm), _ratio(kl_norm, total_norm)
    )


def cancellation_rate(sum_norm: Tensor, token_norms: Tensor, token_count: int) -> Tensor:
    """Reward-gradient cancellation c_R = 1 - ||sum_t u_t|| / sum_t ||u_t|| over a set of tokens.

    sum_norm: 0-dim ||sum_t u_t||, the norm of the set's gradient; token_norms: [m] ||u_t|| of a
    uniform sample of the set's ``token_count`` tokens (all of them when m = token_count, then
    the rate is exact). The denominator is estimated as token_count * mean(token_norms), an
    unbiased estimate, so a noisy sample can give c_R slightly below 0. NaN when the estimate is 0
    (no reward gradient at all).
    """
    token_norms = torch.as_tensor(token_norms, dtype=torch.float64).reshape(-1)
    sum_norm = torch.as_tensor(sum_norm, dtype=torch.float64)
    if token_norms.numel() == 0:
        return torch.tensor(math.nan, dtype=torch.float64)
    return 1.0 - _ratio(sum_norm, token_count * token_norms.mean())


def pearson(x: Tensor, y: Tensor) -> Tensor:
    """Pearson correlation of x [n] and y [n] (0-dim float64); NaN with fewer than 2 points or a constant."""
    x, y = x.to(torch.float64).reshape(-1), y.to(torch.float64).reshape(-1)
    if x.shape != y.shape:
        raise ValueError(f"pearson needs x and y of one shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.numel() < 2:
        return torch.tensor(math.nan, dtype=torch.float64)
    dx, dy = x - x.mean(), y - y.mean()
    return _ratio((dx * dy).sum(), (dx.square().sum() * dy.square().sum()).sqrt())


def decile_medians(values: Tensor, keys: Tensor) -> Tensor:
    """Median of ``values`` [n] over the ceil(n/10) items with the lowest and with the highest ``keys`` [n].

    Returns [2] float64: (lowest decile, highest decile); ties in keys keep the items' order; NaN
    values (undefined shares) are skipped, and an empty decile gives NaN.
    """
    values, keys = values.to(torch.float64).reshape(-1), keys.to(torch.float64).reshape(-1)
    if values.numel() == 0:
        return torch.full((2,), math.nan, dtype=torch.float64)
    size = math.ceil(values.numel() / 10)
    order = torch.sort(keys, stable=True).indices
    return torch.stack([torch.nanquantile(values[order[:size]], 0.5), torch.nanquantile(values[order[-size:]], 0.5)])


def top_shares(values: Tensor, fractions: Sequence[float], reduce: Optional[Reduce] = None) -> Tensor:
    """Share of sum(values) carried by the ceil(f * n) largest values, for every fraction f (F6).

    values: [n] this rank's non-negative per-token values (negatives count as 0), n summed over
    ranks by ``reduce``. Exact: the k-th largest value is found by bisection on its float32 bit
    pattern (monotone for non-negative floats), 31 rounds of one small ``reduce`` each, so no
    rank ever gathers another's tokens; ties at the k-th value are split so exactly k values
    count. Returns [len(fractions)] float64; NaN when the sum is 0.
    """
    reduce = reduce or _identity
    values = values.detach().to(torch.float32).reshape(-1)
    values = torch.where(values > 0, values, torch.zeros_like(values))  # also turns -0.0 into +0.0
    bits = values.view(torch.int32).to(torch.int64)
    count, total = reduce(
        torch.stack([torch.tensor(float(values.numel()), dtype=torch.float64), values.to(torch.float64).sum()])
    )
    wanted = torch.tensor([math.ceil(f * float(count)) for f in fractions], dtype=torch.float64)
    low = torch.zeros(len(fractions), dtype=torch.int64)  # invariant: at least `wanted` values have bits >= low
    high = torch.full((len(fractions),), _INF_BITS, dtype=torch.int64)
    for _ in range(31):  # a fixed count: every rank must join the same number of reductions
        middle = (low + high + 1) // 2
        enough = reduce((bits[None, :] >= middle[:, None]).sum(dim=1).to(torch.float64)) >= wanted
        low, high = torch.where(enough, middle, low), torch.where(enough, high, middle - 1)
    kth_value = low.to(torch.int32).view(torch.float32).to(torch.float64)
    above = bits[None, :] > low[:, None]
    above_count, above_sum = reduce(
        torch.stack([above.sum(dim=1).to(torch.float64), (above * values.to(torch.float64)[None, :]).sum(dim=1)])
    )
    top_sum = above_sum + (wanted - above_count) * kth_value
    return _ratio(top_sum, total.expand_as(top_sum))


def position_profile(token_values: Tensor, mask: Tensor, boundaries: Sequence[int]) -> Tensor:
    """Per-position-bucket sums and counts of per-token values (F6: KL by position).

    token_values, mask: [N, T] (position t = t-th response token); boundaries: increasing
    positions b_0 < b_1 < ... splitting positions into [0, b_0), [b_0, b_1), ..., [b_last, inf).
    Returns [2, len(boundaries) + 1] float64: row 0 the sums of the masked values per bucket,
    row 1 the token counts (add over ranks, then divide for the means).
    """
    if token_values.shape != mask.shape or token_values.dim() != 2:
        raise ValueError(
            f"token_values and mask must both be [N, T], got {tuple(token_values.shape)} and {tuple(mask.shape)}"
        )
    selected = mask != 0
    bucket = torch.bucketize(torch.arange(token_values.shape[1]), torch.tensor(list(boundaries)), right=True)
    bucket = bucket[None, :].expand_as(token_values)[selected]
    values = token_values.to(torch.float64)[selected]
    out = torch.zeros(2, len(boundaries) + 1, dtype=torch.float64)
    out[0].index_add_(0, bucket, values)
    out[1].index_add_(0, bucket, torch.ones_like(values))
    return out
