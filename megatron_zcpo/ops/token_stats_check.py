"""The Triton backend's first-use cross-check against the torch backend, and the fallback it can trigger.

The Triton kernels (``token_stats_triton*.py``) are the default on CUDA, but so far they were
verified only under Triton's interpreter and by compiling them for sm_90 (benchmarks/RESULTS.md).
So the first time they run in a process for one kind of call -- logits or fused, the inputs'
dtypes, the shard width, with or without a reference, with or without a gradient, one or two
temperatures -- :mod:`megatron_zcpo.ops.token_stats` recomputes a few rows *of that call* (the
first, the last, the middle and the one of largest KL) with the torch backend and compares the
values and, when a gradient is wanted, each term's logit gradient (log-prob, entropy, KL
separately, from the call's own saved numbers and, fused, its float16 caches) by the relative
norm of the difference, with a tolerance per term. A KL gradient is only informative where the
KL is not ~0 (at step 0 the policy equals the reference): while the call's largest KL is below
:data:`KL_CHECK_MIN`, the kind stays *pending* and the check runs again (one host sync per call
to read that KL) at the first call of that kind whose KL reaches it.

On a mismatch beyond the tolerances, or an exception in a Triton path of any rank (a compile
failure, an OOM), every rank of the tensor-parallel group warns once and the process computes the
token statistics with the torch backend from then on (the call that failed included):
correctness first on a long cluster run. The ranks decide together in the check's one all-reduce;
a rank whose Triton call raises recomputes it with the torch backend at once (the collectives of
both backends are the same: one all-gather per forward, the fused backward's all-reduce), so the
other ranks do not hang, and tells them at the next check.

This module holds the comparison, the per-process state and the switch :data:`MODE`; the slices
are computed by the op.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

TERMS = ("logprob", "entropy", "kl")
# Relative norm of (gradient - float64 gradient) per term, the bounds of the per-term tests
# (megatron_zcpo.testing.token_stats_terms). From logits: float32 recomputation; fused: from the
# float16 caches (2**-11 relative). One unit of a 16-bit gradient dtype is added to each.
TERM_TOLERANCE = {
    "logits": {"logprob": 1e-5, "entropy": 1e-5, "kl": 1e-4},
    "fused": {"logprob": 1e-3, "entropy": 1e-3, "kl": 2e-3},
}
# Both sides round, so the check allows twice those bounds, and twice the values' (rtol 2e-6 / atol
# 2e-5; the KL relative to itself, 1e-4, since it is second order and may be ~1e-3 or less).
VALUE_RTOL, VALUE_ATOL = 4e-6, 4e-5
KL_RTOL, KL_ATOL = 2e-4, 1e-12
KL_CHECK_MIN = 1e-3
"""The least per-token KL at which a check compares the KL gradient (see the module docstring)."""

MODE = "cuda"
"""When to check: ``"cuda"`` (first use on CUDA tensors; the default), ``"always"`` (also under
Triton's interpreter on CPU tensors: the tests) or ``"off"`` (benchmarks/bench_token_stats_gpu.py,
which compares every case with the torch backend itself)."""

_checked: Dict[tuple, bool] = {}  # kind of call -> True: checked; False: pending a KL >= KL_CHECK_MIN
_fallback: Optional[str] = None
_raised: Optional[str] = None  # this rank's Triton call raised: it uses torch, and says so at the next check


class TritonMismatchWarning(RuntimeWarning):
    """The Triton kernels disagreed with the torch backend on their first use; the torch backend runs instead."""


def due(key: tuple, device: torch.device, kl: Optional[torch.Tensor]) -> bool:
    """Whether this call is to be checked (see :data:`MODE`): the first of its kind, or a pending kind's
    first call whose KL [N] (merged over the group: the same on every rank) reaches :data:`KL_CHECK_MIN`.
    Never depends on this rank's own state, so that the ranks enter the check's collective together."""
    if MODE == "off" or _fallback is not None or _checked.get(key):
        return False
    if not (MODE == "always" or device.type == "cuda"):
        return False
    return key not in _checked or kl is None or kl.numel() == 0 or kl_seen(kl)


def kl_seen(kl: torch.Tensor) -> bool:
    """Whether the largest KL [N] reaches :data:`KL_CHECK_MIN` (NaN counts: the check must see it)."""
    return not bool(kl.detach().max() < KL_CHECK_MIN)


def torch_instead() -> bool:
    """Whether this process computes with the torch backend: a check failed, or a Triton call here raised."""
    return _fallback is not None or _raised is not None


def raised(error: Exception, where: str) -> None:
    """Record that this rank's Triton ``where`` raised ``error`` (its caller recomputes with torch); warn once."""
    global _raised
    if _raised is None:
        _raised = f"{where}: {type(error).__name__}: {str(error)[:300]}"
        warnings.warn(
            f"token statistics: the Triton kernels raised ({_raised}); this rank computes the token statistics "
            f"with the torch backend from now on, the others follow at the next first-use check",
            TritonMismatchWarning,
            stacklevel=3,
        )


def status() -> Dict[str, object]:
    """{"checked": kinds of call fully checked, "pending": kinds awaiting a KL to check, "fallback": the
    warning's text or None}."""
    done = sum(_checked.values())
    return {"checked": done, "pending": len(_checked) - done, "fallback": _fallback}


def reset() -> None:
    """Forget every check and the fallback (tests)."""
    global _fallback, _raised
    _checked.clear()
    _fallback = _raised = None


def check_rows(n_rows: int, kl: Optional[torch.Tensor]) -> list:
    """The rows compared: first, middle, last and the one of largest KL [N] (the same on every rank)."""
    rows = {0, n_rows // 2, n_rows - 1} if n_rows else set()
    if kl is not None and n_rows:
        rows.add(int(kl.detach().reshape(-1).nan_to_num(float("inf")).argmax()))
    return sorted(rows)


def value_problems(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> List[str]:
    """One line per field whose Triton values ``got`` [r] differ from the torch values ``want`` [r]."""
    problems = []
    for field, expected in want.items():
        triton_value, expected = got[field].double(), expected.double()
        rtol, atol = (KL_RTOL, KL_ATOL) if field == "kl" else (VALUE_RTOL, VALUE_ATOL)
        close = torch.isclose(triton_value, expected, rtol=rtol, atol=atol, equal_nan=True)
        if not bool(close.all()):
            excess = torch.where(close, 0.0, (triton_value - expected).abs().nan_to_num(float("inf")))
            row = int(excess.argmax())
            problems.append(
                f"{field}: triton {float(triton_value[row]):.7g} vs torch {float(expected[row]):.7g} "
                f"(|diff| {float(excess[row]):.2e}; tolerance {atol:.0e} + {rtol:.0e} x |torch|)"
            )
    return problems


def gradient_problem(term: str, got: torch.Tensor, want: torch.Tensor, cached: bool) -> Optional[str]:
    """A line when the Triton logit gradient of one ``term`` ``got`` [r, columns] differs from the torch one
    ``want`` by more than twice :data:`TERM_TOLERANCE` (relative norm) plus one unit of a 16-bit dtype
    (the two backends may round a 16-bit gradient one unit apart). ``cached``: the fused backward."""
    unit = torch.finfo(got.dtype).eps if got.dtype in (torch.bfloat16, torch.float16) else 0.0
    tolerance = 2 * TERM_TOLERANCE["fused" if cached else "logits"][term] + unit
    got, want = got.double(), want.double()
    relative = float((got - want).norm() / want.norm().clamp_min(1e-30))
    if relative <= tolerance:  # also False for NaN
        return None
    return f"{term} logit gradient: relative difference {relative:.2e} (tolerance {tolerance:.1e})"


def conclude(
    key: tuple,
    described: str,
    problems: List[str],
    complete: bool,
    group: Optional[dist.ProcessGroup],
    device: torch.device,
) -> bool:
    """Record the check of ``key`` (``complete``: the KL gradient was compared too, or there is none);
    True when the Triton results stand.

    Collective over ``group`` (one all-reduce, when given): the ranks decide together, since a
    fallback recomputes the call with the torch backend and its all-gather. On a mismatch, or when
    a Triton call of this rank raised, warn once (:class:`TritonMismatchWarning`) and switch the
    process to the torch backend.
    """
    global _fallback
    _checked[key] = complete
    if _raised is not None:
        problems = problems + [f"a Triton call raised on this rank ({_raised})"]
    failed = torch.tensor([float(bool(problems))], device=device)
    if group is not None:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if not float(failed):
        return True
    found = "; ".join(problems) if problems else "another tensor-parallel rank found a mismatch"
    _fallback = (
        f"token statistics: the Triton kernels disagree with the torch backend on their first use "
        f"({described}): {found}. This process "
        f"computes the token statistics with the torch backend from now on (correct, slower on a GPU); "
        f"set train.token_stats_backend=torch to skip the Triton kernels, and please report this "
        f"with the GPU, torch and triton versions"
    )
    warnings.warn(_fallback, TritonMismatchWarning, stacklevel=3)
    return False
