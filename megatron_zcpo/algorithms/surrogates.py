"""Clipped policy surrogates (PPO, DAPO clip-higher, dual clip) and split-exact loss aggregation."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

Normalizer = Union[Tensor, int, float]


class PolicyLossOutput(NamedTuple):
    """A clipped-surrogate loss and its detached diagnostics.

    loss: scalar, differentiable in logprob. clip_gate: [N, T] bool, True where the token's
    reward gradient is live (not clipped; padding is False). The fractions are over this call's
    unmasked tokens: clip_low (c < 0, ratio < 1 - clip_low), clip_high (c > 0, ratio > 1 +
    clip_high), dual_clip (c < 0, ratio > clip_c).
    """

    loss: Tensor
    clip_gate: Tensor
    clip_low_fraction: Tensor
    clip_high_fraction: Tensor
    dual_clip_fraction: Tensor


def check_token_tensors(mask: Tensor, **tensors: Optional[Tensor]) -> None:
    """Raise naming the tensor unless mask is [N, T] and every given tensor has its shape."""
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError(f"mask must be a [N, T] tensor, got shape {tuple(getattr(mask, 'shape', ()))}")
    for name, tensor in tensors.items():
        if tensor is not None and tuple(tensor.shape) != tuple(mask.shape):
            raise ValueError(f"{name} must have the mask's shape {tuple(mask.shape)}, got {tuple(tensor.shape)}")


def check_agg(agg: str) -> None:
    """Raise unless ``agg`` names a supported aggregation."""
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")


def aggregation_weights(mask: Tensor, agg: str, dtype: torch.dtype) -> Tensor:
    """Per-token weights w [N, T] such that the aggregated loss is sum(w * token_loss) / normalizer.

    token-mean and seq-mean-token-sum: w = mask; seq-mean-token-mean: w = mask / (the row's
    token count). Rows are whole inside one call (a response is never split across micro-batches).
    """
    check_agg(agg)
    weights = (mask != 0).to(dtype)
    if agg == "seq-mean-token-mean":
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1.0)
    return weights


def loss_normalizer(mask: Tensor, agg: str) -> Tensor:
    """This call's share of the normaliser: unmasked tokens (token-mean) or rows with >= 1 token.

    mask: [N, T]. Returns a 0-dim int64 tensor. Summing it over every micro-batch and
    data-parallel rank of a mini-batch gives the global normaliser that makes the split losses
    add up to the unsplit loss.
    """
    check_agg(agg)
    selected = mask != 0
    if agg == "token-mean":
        return selected.sum()
    return selected.any(dim=-1).sum()


def aggregate(token_losses: Tensor, mask: Tensor, agg: str, normalizer: Optional[Normalizer] = None) -> Tensor:
    """Scalar loss sum(w * token_losses) / normalizer with w = aggregation_weights(mask, agg).

    token_losses, mask: [N, T]. normalizer: the global count (see loss_normalizer); None uses this
    call's own count. A normaliser of 0 means there is nothing to average and gives 0. Positions
    outside the mask are ignored even if they hold NaN/inf.
    """
    if normalizer is None:
        normalizer = loss_normalizer(mask, agg)
    return weighted_sum(token_losses, aggregation_weights(mask, agg, token_losses.dtype), normalizer)


def weighted_sum(token_values: Tensor, weights: Tensor, normalizer: Normalizer) -> Tensor:
    """Scalar sum(weights * token_values) / normalizer; tokens of weight 0 are skipped even if NaN/inf.

    token_values, weights: [N, T]. A normaliser of 0 (nothing to average) gives 0.
    """
    weighted = torch.where(weights != 0, token_values * weights, torch.zeros_like(token_values))
    divisor = torch.as_tensor(normalizer, dtype=token_values.dtype, device=token_values.device)
    return weighted.sum() / divisor.clamp(min=1.0)


def check_clip_range(clip_low: float, clip_high: float, clip_c: Optional[float]) -> None:
    """Raise unless 0 <= clip_low < 1, clip_high >= 0 and clip_c is None or > 1."""
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low!r}")
    if not clip_high >= 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high!r}")
    if clip_c is not None and not clip_c > 1.0:
        raise ValueError(f"clip_c must be > 1 (dual clip) or None, got {clip_c!r}")


def per_token(name: str, coefficient: Tensor, mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A detached [N] per-response or [N, T] per-token coefficient as an [N, T] tensor of ``dtype``."""
    coefficient = coefficient.detach().to(dtype)
    if coefficient.shape == mask.shape[:1]:
        coefficient = coefficient[:, None].expand(mask.shape)
    check_token_tensors(mask, **{name: coefficient})
    return coefficient


def masked_fraction(flags: Tensor, selected: Tensor) -> Tensor:
    """Fraction (0-dim, detached) of the selected tokens [N, T] where flags [N, T] is True."""
    return (flags & selected).sum() / selected.sum().clamp(min=1)


def policy_loss(
    logprob: Tensor,
    old_logprob: Tensor,
    coef: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: Optional[float] = None,
    agg: str = "token-mean",
    normalizer: Optional[Normalizer] = None,
    token_weight: Optional[Tensor] = None,
) -> PolicyLossOutput:
    """The clipped surrogate with a detached coefficient (PPO / DAPO clip-higher / dual clip).

    logprob: [N, T] current log-probs of the sampled tokens (differentiable); old_logprob: [N, T]
    at the sampling snapshot; coef: [N] per response or [N, T] per token (detached); mask: [N, T].
    ratio = exp(logprob - old_logprob); per token -min(ratio*c, clip(ratio, 1-clip_low,
    1+clip_high)*c), and for c < 0 with clip_c given, capped at -clip_c*c (dual clip).
    token_weight: optional detached [N, T] factor on each token's loss (e.g. truncated importance
    sampling against the rollout engine). agg: token-mean | seq-mean-token-mean |
    seq-mean-token-sum; normalizer: global token count (token-mean) or global count of rows with
    >= 1 token (seq-mean modes), default this call's own count, so that summing the losses of any
    split of a mini-batch reproduces the unsplit loss and gradient exactly.
    Returns PolicyLossOutput (its first item / .loss is the scalar loss).
    """
    check_token_tensors(mask, logprob=logprob, old_logprob=old_logprob, token_weight=token_weight)
    check_clip_range(clip_low, clip_high, clip_c)
    coef = per_token("coef", coef, mask, logprob.dtype)

    selected = mask != 0
    with torch.no_grad():
        ratio = torch.exp(torch.where(selected, logprob - old_logprob, torch.zeros_like(logprob)))
        clipped_high = (coef > 0) & (ratio > 1.0 + clip_high)
        clipped_low = (coef < 0) & (ratio < 1.0 - clip_low)
        dual_clipped = (coef < 0) & (ratio > clip_c) if clip_c is not None else torch.zeros_like(selected)
        gate = selected & ~(clipped_high | clipped_low | dual_clipped)
        # the constant a closed gate pins the ratio to (the clip bound that min/max selected)
        pinned_ratio = torch.full_like(logprob, clip_c if clip_c is not None else 0.0)
        pinned_ratio = torch.where(clipped_high, logprob.new_tensor(1.0 + clip_high), pinned_ratio)
        pinned_ratio = torch.where(clipped_low, logprob.new_tensor(1.0 - clip_low), pinned_ratio)
    # exp only where the gate is open: a clipped token's huge ratio must not leak inf*0 = NaN
    # into the backward pass
    live_ratio = torch.exp(torch.where(gate, logprob - old_logprob.detach(), torch.zeros_like(logprob)))
    token_losses = -coef * torch.where(gate, live_ratio, pinned_ratio)
    return gated_loss_output(
        token_losses, mask, agg, normalizer, token_weight, gate, clipped_low, clipped_high, dual_clipped
    )


def gated_loss_output(
    token_losses: Tensor,
    mask: Tensor,
    agg: str,
    normalizer: Optional[Normalizer],
    token_weight: Optional[Tensor],
    gate: Tensor,
    clipped_low: Tensor,
    clipped_high: Tensor,
    dual_clipped: Tensor,
) -> PolicyLossOutput:
    """Aggregate per-token losses [N, T] (times the detached ``token_weight``) into a
    PolicyLossOutput with the clip gate and the clip fractions over the masked tokens."""
    if token_weight is not None:
        token_losses = token_losses * token_weight.detach()
    selected = mask != 0
    return PolicyLossOutput(
        loss=aggregate(token_losses, mask, agg, normalizer),
        clip_gate=gate,
        clip_low_fraction=masked_fraction(clipped_low, selected),
        clip_high_fraction=masked_fraction(clipped_high, selected),
        dual_clip_fraction=masked_fraction(dual_clipped, selected),
    )
