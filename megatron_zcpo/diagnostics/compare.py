"""The paper's comparison protocol: align runs by cumulative GPU time, and mean / standard error over seeds.

Appendix A of the paper selects each method's checkpoint at the same cumulative GPU compute time,
not the same step, and reports means over three seeds. A run's GPU time per step is its logged
``time/step`` (wall seconds of the whole step: rollout, training, weight push) times the GPUs the
step held (``time/world_size``, the training ranks, unless a count for the whole job is given).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

GPU_HOURS = "gpu_hours"  # the x-axis name of cumulative GPU time


def cumulative_gpu_hours(records: Sequence[Dict[str, float]], gpus: Optional[int] = None) -> List[float]:
    """Cumulative GPU-hours at the end of each record's step, in record order ([len(records)] floats).

    records: one dict per step, in step order, each with ``time/step`` (seconds) and, unless
    ``gpus`` is given, ``time/world_size``. Raises ValueError naming the first step without them
    (a run logged before GPU time was recorded needs ``gpus``; a step without ``time/step``
    cannot be placed).
    """
    total, out = 0.0, []
    for record in records:
        seconds = record.get("time/step", math.nan)
        count = gpus if gpus is not None else record.get("time/world_size", math.nan)
        if not (math.isfinite(seconds) and math.isfinite(count)):
            missing = "time/step" if not math.isfinite(seconds) else "time/world_size (give the GPU count)"
            raise ValueError(f"step {int(record.get('step', -1))} has no {missing}: cannot align by GPU-hours")
        total += seconds * count / 3600.0
        out.append(total)
    return out


def value_at(positions: Sequence[float], values: Sequence[float], budget: float) -> Tuple[float, float]:
    """(value, position) of the last finite value whose position is <= ``budget`` (NaN, NaN when none).

    positions: increasing (steps or cumulative GPU-hours); values: the metric at each position.
    This is checkpoint selection at a matched budget: never a later point, never the best one.
    """
    chosen = (math.nan, math.nan)
    for position, value in zip(positions, values):
        if position > budget:
            break
        if math.isfinite(value):
            chosen = (value, position)
    return chosen


def common_budget(ends: Sequence[float]) -> float:
    """The budget every run reached: the smallest of the runs' final positions (NaN for no run)."""
    return min(ends) if ends else math.nan


def mean_and_standard_error(values: Sequence[float]) -> Tuple[float, float, int]:
    """(mean, standard error of the mean, n) of the finite ``values``.

    SE = sample standard deviation (divisor n - 1) / sqrt(n); NaN with fewer than two values
    (mean NaN with none).
    """
    finite = [v for v in values if math.isfinite(v)]
    n = len(finite)
    if n == 0:
        return math.nan, math.nan, 0
    mean = sum(finite) / n
    if n < 2:
        return mean, math.nan, 1
    variance = sum((v - mean) ** 2 for v in finite) / (n - 1)
    return mean, math.sqrt(variance / n), n


def group_by_method(methods: Sequence[str]) -> Dict[str, List[int]]:
    """Run indices per method name, methods in order of first appearance."""
    groups: Dict[str, List[int]] = {}
    for index, method in enumerate(methods):
        groups.setdefault(method, []).append(index)
    return groups
