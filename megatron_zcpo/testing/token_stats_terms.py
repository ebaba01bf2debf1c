"""Per-term checks of the token statistics against float64: each term's gradient (and value) on its own.

A gradient check of ``logprob + entropy + beta * KL`` is dominated by the one-hot target term of the
log-prob, so a dropped, tripled or sign-flipped KL gradient can pass it. Here each term (log-prob,
entropy, KL) is differentiated separately, on inputs where the policy differs from the reference
(KL >= 1e-2 per token), and compared by the relative norm of the difference with a tolerance per
term. Used by tests/ops (Triton's interpreter) and by ``benchmarks/bench_token_stats.py --gpu``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron_zcpo.ops.token_stats import TokenStats, fused_token_stats, vocab_parallel_token_stats
from megatron_zcpo.ops.token_stats_check import TERM_TOLERANCE, TERMS

VALUE_FIELDS = ("logprob", "entropy", "ref_logprob", "kl")
MIN_KL = 1e-2
"""The least per-token KL of the inputs below: the KL gradient is then far above rounding."""

# Values: relative to float64 (KL) or absolute + relative (the others), the float64 tests' bounds.
VALUE_RTOL, VALUE_ATOL, KL_RTOL = 2e-6, 2e-5, 1e-4


def unit(dtype: torch.dtype) -> float:
    """One unit of rounding of a 16-bit gradient dtype (0 for float32 / float64)."""
    return torch.finfo(dtype).eps if dtype in (torch.bfloat16, torch.float16) else 0.0


def relative_norm(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (inf for a non-finite difference)."""
    got, want = got.double(), want.double()
    error = float((got - want).norm() / want.norm().clamp_min(1e-300))
    return error if error == error else float("inf")


def drifted_logits(tokens: int, vocab: int, valid: int, seed: int = 0, device="cpu", dtype=torch.float32):
    """[tokens, vocab] policy logits (std 2), a reference 0.6 away (KL ~ 0.1 per token) and targets in
    [0, valid)."""
    gen = torch.Generator(device=device).manual_seed(seed)  # generated where used: GPU-sized inputs are large
    z = torch.randn(tokens, vocab, generator=gen, device=device) * 2.0
    zr = z + 0.6 * torch.randn(tokens, vocab, generator=gen, device=device)
    targets = torch.randint(0, valid, (tokens,), generator=gen, device=device)
    return z.to(dtype), zr.to(dtype), targets


def drifted_layer(
    tokens: int, hidden_size: int, vocab: int, valid: int, seed: int = 0, device="cpu", dtype=torch.float32
):
    """Hidden states [tokens, H], output layers [vocab, H] of a policy and a reference whose logits (std ~2)
    differ by ~0.6 (KL ~ 0.1 per token), and targets in [0, valid)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=gen, device=device)
    weight = torch.randn(vocab, hidden_size, generator=gen, device=device) * 2.0 / hidden_size**0.5
    ref_weight = weight + 0.6 * torch.randn(vocab, hidden_size, generator=gen, device=device) / hidden_size**0.5
    targets = torch.randint(0, valid, (tokens,), generator=gen, device=device)
    return (*(x.to(dtype) for x in (hidden, weight, hidden, ref_weight)), targets)


def upstream(rows: int, device) -> torch.Tensor:
    """[rows] upstream gradient of one term, different per row (a ramp from 0.5 to 1.5)."""
    return torch.linspace(0.5, 1.5, rows, dtype=torch.float32, device=device)


def _term_gradients(stats: TokenStats, leaves: Tuple[torch.Tensor, ...]) -> Dict[str, Tuple[torch.Tensor, ...]]:
    """{term: d(sum ramp * term)/d(leaves)}, one backward per term through the same forward."""
    ramp = upstream(stats.logprob.numel(), stats.logprob.device).view(stats.logprob.shape)
    out = {}
    for term in TERMS:
        value = getattr(stats, term)
        out[term] = torch.autograd.grad((ramp.to(value.dtype) * value).sum(), leaves, retain_graph=True)
    return out


def _min_kl(stats: TokenStats) -> float:
    assert stats.kl is not None, "the per-term checks need a reference"
    return float(stats.kl.detach().min())


def value_errors(stats: TokenStats, exact: TokenStats) -> Dict[str, float]:
    """{field: error / tolerance} of each value field (> 1: out of tolerance): KL relative, others rtol + atol."""
    out = {}
    for field in VALUE_FIELDS:
        got, want = getattr(stats, field).detach().double(), getattr(exact, field).detach().double()
        if field == "kl":
            bound = KL_RTOL * want.abs()
        else:
            bound = VALUE_ATOL + VALUE_RTOL * want.abs()
        out[field] = float(((got - want).abs() / bound).nan_to_num(float("inf")).max())
    return out


def logits_term_errors(z, zr, targets, backend: str = "triton", **options) -> Dict[str, float]:
    """Per term, the relative error of d(term)/d(logits) of ``backend`` against the float64 torch backend
    on the same (upcast) logits, divided by that term's tolerance (> 1: fails); also "min KL"."""
    logits = z.detach().clone().requires_grad_()
    stats = vocab_parallel_token_stats(logits, targets, zr, backend=backend, **options)
    exact_logits = z.detach().double().requires_grad_()
    exact = vocab_parallel_token_stats(exact_logits, targets, zr.double(), backend="torch", **options)
    got, want = _term_gradients(stats, (logits,)), _term_gradients(exact, (exact_logits,))
    tolerances = TERM_TOLERANCE["logits"]
    errors = {t: relative_norm(got[t][0], want[t][0]) / (tolerances[t] + unit(z.dtype)) for t in TERMS}
    errors["min KL"] = _min_kl(exact)
    return errors


def fused_term_errors(
    hidden, weight, ref_hidden, ref_weight, targets, backend: str = "triton", **options
) -> Dict[str, float]:
    """Per term and input (hidden, weight), the relative error of the gradient of ``backend``'s fused op
    against float64, divided by that term's tolerance; also "min KL". The hidden gradient is the
    all-reduced one under tensor parallelism, the weight gradient this rank's shard."""
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    stats = fused_token_stats(h, w, targets, ref_hidden, ref_weight, backend=backend, **options)
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    exact = fused_token_stats(h64, w64, targets, ref_hidden.double(), ref_weight.double(), backend="torch", **options)
    got, want = _term_gradients(stats, (h, w)), _term_gradients(exact, (h64, w64))
    tolerances = TERM_TOLERANCE["fused"]
    errors = {}
    for term in TERMS:
        for name, index in (("hidden", 0), ("weight", 1)):
            bound = tolerances[term] + unit(got[term][index].dtype)
            errors[f"{term} {name}"] = relative_norm(got[term][index], want[term][index]) / bound
    errors.update({f"{field} value": e for field, e in value_errors(stats, exact).items()})
    errors["min KL"] = _min_kl(exact)
    return errors


def fused_value_errors(
    hidden, weight, ref_hidden, ref_weight, targets, backend: str = "triton", **options
) -> Dict[str, float]:
    """The no-gradient fused op (the experience pass: no caches) against float64: {field: error / tolerance}
    (see :func:`value_errors`) and "min KL"."""
    with torch.no_grad():
        stats = fused_token_stats(hidden, weight, targets, ref_hidden, ref_weight, backend=backend, **options)
        exact = fused_token_stats(
            hidden.double(), weight.double(), targets, ref_hidden.double(), ref_weight.double(), **options
        )
    errors = value_errors(stats, exact)
    errors["min KL"] = _min_kl(exact)
    return errors


def failures(errors: Dict[str, float], min_kl: Optional[float] = MIN_KL) -> list:
    """The entries of an ``*_errors`` result out of tolerance (> 1), and "min KL" when below ``min_kl``."""
    bad = [f"{k} {v:.2g}x tolerance" for k, v in errors.items() if k != "min KL" and not v <= 1.0]
    if min_kl is not None and not errors["min KL"] >= min_kl:
        bad.append(f"min KL {errors['min KL']:.2g} < {min_kl:g}: the KL gradient is not exercised")
    return bad
