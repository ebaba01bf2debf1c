"""Sampled per-token KL estimators (k1, k2, k3) and the F1-C gradient-norm ratio."""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Per-token sampled estimate of KL(pi || pi_ref), differentiable in ``logprob``.

    logprob, ref_logprob: [...] log-probabilities of the sampled tokens under the policy and the
    reference. With Delta = logprob - ref_logprob: k1 = Delta; k2 = Delta^2 / 2;
    k3 = exp(-Delta) + Delta - 1 (computed as expm1(-Delta) + Delta, exact for small Delta).
    Returns a tensor of the same shape. ref_logprob is treated as a constant.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kind must be one of {KL_ESTIMATORS}, got {kind!r}")
    if logprob.shape != ref_logprob.shape:
        raise ValueError(f"logprob {tuple(logprob.shape)} and ref_logprob {tuple(ref_logprob.shape)} differ in shape")
    log_ratio = logprob - ref_logprob.detach()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(-log_ratio) + log_ratio


def masked_gradient_norm_ratio(
    logprob: Tensor, ref_logprob: Tensor, kind: str, token_weights: Tensor, keep: Tensor
) -> Tensor:
    """F1-C's alpha = ||g masked|| / ||g||, measured in per-token log-prob space (detached scalar).

    logprob, ref_logprob: [N, T]; token_weights: [N, T] the aggregation weight of each token in
    the loss (0 off the mask); keep: [N, T] bool, the tokens the masked KL loss keeps (open reward
    gate). g_t = token_weights_t * d kl_penalty_t / d logprob_t is the KL loss's gradient with
    respect to the per-token log-probs, up to the global normaliser (which cancels in the ratio).

    Why log-prob space: it is local to the micro-batch and costs no extra backward pass through
    the model, whereas parameter-space norms would need two more backward passes per micro-batch
    and do not add up across micro-batches. The parameter gradient is the Jacobian of the
    log-probs applied to g, so the ratio measures how much of the KL force the mask removes
    before the model's Jacobian mixes the tokens. Where ||g|| = 0 the KL term has no gradient to
    scale and alpha is 1.
    """
    probe = logprob.detach().requires_grad_(True)
    with torch.enable_grad():
        (token_gradient,) = torch.autograd.grad(kl_penalty(probe, ref_logprob, kind).sum(), probe)
    # padding may hold -inf log-probs (NaN gradients); those tokens have weight 0 and must stay out
    weighted = torch.where(token_weights != 0, token_gradient * token_weights, torch.zeros_like(token_gradient))
    full_norm = torch.linalg.vector_norm(weighted)
    masked_norm = torch.linalg.vector_norm(torch.where(keep, weighted, torch.zeros_like(weighted)))
    safe_norm = torch.where(full_norm > 0, full_norm, torch.ones_like(full_norm))
    return torch.where(full_norm > 0, masked_norm / safe_norm, torch.ones_like(full_norm))
