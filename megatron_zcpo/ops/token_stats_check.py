"""The Triton backend's first-use cross-check against the torch backend, and the fallback it can trigger.

The Triton kernels (``token_stats_triton*.py``) are the default on CUDA, but so far they were
verified only under Triton's interpreter and by compiling them for sm_90 (benchmarks/RESULTS.md).
So the first time they run in a process for one kind of call -- logits or fused, the inputs'
dtypes, the shard width, with or without a reference, with or without a gradient, one or two
temperatures -- :mod:`megatron_zcpo.ops.token_stats` recomputes :data:`CHECK_ROWS` rows with the
torch backend and compares the values (and, when a gradient is wanted, the logit gradient of those
rows under a fixed upstream gradient). On a mismatch beyond the tolerances below, every rank of the
tensor-parallel group warns once and the process computes the token statistics with the torch
backend from then on (the call that failed included): correctness first on a long cluster run.

This module holds the comparison, the per-process state and the switch :data:`MODE`; the slices
are computed by the op.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

CHECK_ROWS = 4
# Both sides round, so twice tests/ops' float64 tolerances: values rtol 2e-6 / atol 2e-5; logit
# gradients from the logits rtol 1e-5 / atol 1e-6, or two units of the gradient's own dtype when
# larger (bf16 logits get a bf16 gradient, which the two backends may round one unit apart: up to
# one eps relative).
VALUE_RTOL, VALUE_ATOL = 4e-6, 4e-5
GRADIENT_RTOL, GRADIENT_ATOL = 2e-5, 2e-6
# Fused calls differentiate from float16 caches: the relative norm of the logit-gradient
# difference, twice the 3e-4 tests/ops allow the fused gradients against float64, plus one unit
# of the gradient's dtype (bf16 on CUDA, the gradient GEMMs' operand).
CACHED_GRADIENT_RELATIVE = 6e-4

MODE = "cuda"
"""When to check: ``"cuda"`` (first use on CUDA tensors; the default), ``"always"`` (also under
Triton's interpreter on CPU tensors: the tests) or ``"off"`` (benchmarks/bench_token_stats_gpu.py,
which compares every case with the torch backend itself)."""

_checked: set = set()
_fallback: Optional[str] = None


class TritonMismatchWarning(RuntimeWarning):
    """The Triton kernels disagreed with the torch backend on their first use; the torch backend runs instead."""


def due(key: tuple, device: torch.device) -> bool:
    """Whether this call is the first of its kind to be checked (see :data:`MODE`)."""
    if MODE == "off" or key in _checked or _fallback is not None:
        return False
    return MODE == "always" or device.type == "cuda"


def torch_instead() -> bool:
    """Whether a first-use check failed in this process: every later call uses the torch backend."""
    return _fallback is not None


def status() -> Dict[str, object]:
    """{"checked": kinds of call checked so far in this process, "fallback": the warning's text or None}."""
    return {"checked": len(_checked), "fallback": _fallback}


def reset() -> None:
    """Forget every check and the fallback (tests)."""
    global _fallback
    _checked.clear()
    _fallback = None


def check_rows(n_rows: int, device: torch.device) -> torch.Tensor:
    """The rows compared: up to :data:`CHECK_ROWS`, first and last included (the same on every rank)."""
    count = min(n_rows, CHECK_ROWS)
    return torch.linspace(0, n_rows - 1, count, device=device).round().long().unique()


def value_problems(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> List[str]:
    """One line per field whose Triton values ``got`` [r] differ from the torch values ``want`` [r]."""
    problems = []
    for field, expected in want.items():
        triton_value, expected = got[field].double(), expected.double()
        close = torch.isclose(triton_value, expected, rtol=VALUE_RTOL, atol=VALUE_ATOL, equal_nan=True)
        if not bool(close.all()):
            excess = torch.where(close, 0.0, (triton_value - expected).abs().nan_to_num(float("inf")))
            row = int(excess.argmax())
            problems.append(
                f"{field}: triton {float(triton_value[row]):.7g} vs torch {float(expected[row]):.7g} "
                f"(|diff| {float(excess[row]):.2e}; tolerance {VALUE_ATOL:.0e} + {VALUE_RTOL:.0e} x |torch|)"
            )
    return problems


def gradient_problem(got: torch.Tensor, want: torch.Tensor, cached: bool) -> Optional[str]:
    """A line when the Triton logit gradient ``got`` [r, columns] differs from the torch one ``want``.

    ``cached``: the fused backward (float16 caches), compared by the relative norm of the
    difference; else elementwise (see the tolerances above).
    """
    unit = torch.finfo(got.dtype).eps if got.dtype in (torch.bfloat16, torch.float16) else 0.0
    got, want = got.double(), want.double()
    if cached:
        relative = float((got - want).norm() / want.norm().clamp_min(1e-30))
        tolerance = CACHED_GRADIENT_RELATIVE + unit
        if relative <= tolerance:  # also False for NaN
            return None
        return f"logit gradient: relative difference {relative:.2e} (tolerance {tolerance:.1e})"
    rtol = max(GRADIENT_RTOL, 2 * unit)
    close = torch.isclose(got, want, rtol=rtol, atol=GRADIENT_ATOL, equal_nan=True)
    if bool(close.all()):
        return None
    excess = torch.where(close, 0.0, (got - want).abs().nan_to_num(float("inf")))
    index = int(excess.argmax())
    row, column = divmod(index, got.shape[1])
    return (
        f"logit gradient [{row}, {column}]: triton {float(got.flatten()[index]):.7g} vs torch "
        f"{float(want.flatten()[index]):.7g} (tolerance {GRADIENT_ATOL:.0e} + {rtol:.0e} x |torch|)"
    )


def conclude(
    key: tuple, described: str, problems: List[str], group: Optional[dist.ProcessGroup], device: torch.device
) -> bool:
    """Record the check of ``key``; True when the Triton results stand.

    Collective over ``group`` (one all-reduce, when given): the ranks decide together, since a
    fallback recomputes the call with the torch backend and its all-gather. On a mismatch, warn
    once (:class:`TritonMismatchWarning`) and switch the process to the torch backend.
    """
    global _fallback
    _checked.add(key)
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
