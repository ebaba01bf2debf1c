"""Reductions over responses grouped by prompt id (ids in any order, groups of any size)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def float_dtype(tensor: Tensor) -> torch.dtype:
    """The dtype the algorithm core computes in: float64 stays float64, everything else is float32."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Groups:
    """The grouping of N responses into Q prompt groups.

    ids: [Q] the distinct group ids (sorted); index: [N] position of each response's group in
    ``ids``; sizes: [Q] number of responses per group.
    """

    ids: Tensor
    index: Tensor
    sizes: Tensor

    @classmethod
    def of(cls, group_ids: Tensor) -> Groups:
        """Group responses by ``group_ids`` [N] (integer ids, any order, any values)."""
        if not isinstance(group_ids, Tensor) or group_ids.dim() != 1:
            raise ValueError(f"group_ids must be a 1-D tensor [N], got {_describe(group_ids)}")
        if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
            raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}")
        ids, index, sizes = torch.unique(group_ids, return_inverse=True, return_counts=True)
        return cls(ids=ids, index=index, sizes=sizes)

    def check_rows(self, name: str, values: Tensor) -> None:
        """Raise unless ``values`` is a tensor of shape [N] matching the grouping."""
        if not isinstance(values, Tensor) or values.shape != self.index.shape:
            raise ValueError(
                f"{name} must have shape {tuple(self.index.shape)} like group_ids, got {_describe(values)}"
            )

    def check_finite(self, name: str, values: Tensor) -> None:
        """Raise naming the group id and row of the first NaN/inf in ``values`` [N]."""
        bad = ~torch.isfinite(values)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            group = int(self.ids[self.index[row]])
            raise ValueError(
                f"{name} of response row {row} in group id {group} is {values[row].item()}; "
                f"{int(bad.sum())} non-finite value(s) in total"
            )

    def sum(self, values: Tensor) -> Tensor:
        """[N] -> [Q] per-group sums (differentiable)."""
        return values.new_zeros(self.ids.shape[0]).index_add(0, self.index, values)

    def mean(self, values: Tensor) -> Tensor:
        """[N] -> [Q] per-group means (differentiable)."""
        return self.sum(values) / self.sizes.to(values.dtype)

    def max(self, values: Tensor) -> Tensor:
        """[N] -> [Q] per-group maxima."""
        start = values.new_full((self.ids.shape[0],), float("-inf"))
        return start.scatter_reduce(0, self.index, values, "amax", include_self=True)

    def min(self, values: Tensor) -> Tensor:
        """[N] -> [Q] per-group minima."""
        start = values.new_full((self.ids.shape[0],), float("inf"))
        return start.scatter_reduce(0, self.index, values, "amin", include_self=True)

    def broadcast(self, per_group: Tensor) -> Tensor:
        """[Q] -> [N]: each response gets its group's value."""
        return per_group[self.index]


def _describe(value) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{type(value).__name__}"
