"""Named training metrics summed on each rank and reduced over the whole world in one all-reduce."""

from __future__ import annotations

import math
from typing import Dict

import torch

from megatron_zcpo.utils.devices import compute_device


class MetricAccumulator:
    """Sums and counts of named metrics, reduced over the whole world in one all-reduce."""

    def __init__(self):
        self.sums: Dict[str, float] = {}
        self.counts: Dict[str, float] = {}
        self.maxima: Dict[str, float] = {}

    def add(self, name: str, total: float, count: float = 1.0) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(total)
        self.counts[name] = self.counts.get(name, 0.0) + float(count)

    def add_max(self, name: str, value: float) -> None:
        self.maxima[name] = max(self.maxima.get(name, -math.inf), float(value))

    def reduce(self, contribute: bool) -> Dict[str, float]:
        """Global means (sum of totals / sum of counts) and maxima of every metric any rank added.

        Ranks with ``contribute=False`` add nothing (e.g. TP replicas of the same values). The
        metric names are unioned over ranks first, so ranks may have added different ones.
        """
        import torch.distributed as dist

        local = (sorted(self.sums), sorted(self.maxima)) if contribute else ([], [])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        names_sum = sorted({n for names, _ in everyone for n in names})
        names_max = sorted({n for _, names in everyone for n in names})
        sums = torch.tensor(
            [[self.sums.get(n, 0.0), self.counts.get(n, 0.0)] for n in names_sum] + [[0.0, 0.0]], dtype=torch.float64
        )
        maxima = torch.tensor([self.maxima.get(n, -math.inf) for n in names_max] + [-math.inf], dtype=torch.float64)
        if not contribute:
            sums.zero_()
            maxima.fill_(-math.inf)
        device = compute_device()
        sums, maxima = sums.to(device), maxima.to(device)
        dist.all_reduce(sums)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        out = {n: (sums[i, 0] / sums[i, 1]).item() if sums[i, 1] > 0 else float("nan") for i, n in enumerate(names_sum)}
        out.update({n: maxima[i].item() for i, n in enumerate(names_max)})
        return out
