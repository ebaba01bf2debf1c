"""Per-response scalars of a whole rollout (rewards, groups, lengths, drift sums): what the algorithms calibrate from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megatron_zcpo.algorithms.groups import Groups


@dataclass
class ResponseStats:
    """Per-response scalars of a whole rollout (gathered over data-parallel ranks), all [N].

    group_ids: int prompt ids; rewards; lengths: response token counts T_i; kl_sum: sum over the
    response of the conditional KL(pi_old || pi_ref) at the sampling snapshot (ZCPO's D_i);
    k1_sum: sum over the response of old_logprob - ref_logprob (k1 drift, KL in the reward).
    """

    group_ids: Tensor
    rewards: Tensor
    lengths: Tensor
    kl_sum: Optional[Tensor] = None
    k1_sum: Optional[Tensor] = None

    def validate(self, required: tuple = ()) -> None:
        """Raise naming the field, row and group id for a missing required field, a shape mismatch,
        a negative length or a NaN/inf reward or required value of a non-empty response."""
        groups = Groups.of(self.group_ids)
        for name in ("rewards", "lengths") + tuple(required):
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"ResponseStats.{name} is required by this algorithm and is missing")
            groups.check_rows(f"ResponseStats.{name}", value)
        if bool((self.lengths < 0).any()):
            row = int((self.lengths < 0).nonzero()[0, 0])
            raise ValueError(
                f"ResponseStats.lengths[{row}] = {self.lengths[row].item()} is negative "
                f"(group id {int(self.group_ids[row])})"
            )
        nonempty = self.lengths > 0  # an empty response's drift is undefined and never used
        for name in ("rewards",) + tuple(required):
            value = getattr(self, name)
            groups.check_finite(f"ResponseStats.{name}", torch.where(nonempty, value, torch.zeros_like(value)))

    def rows(self, keep: Tensor) -> ResponseStats:
        """The responses where ``keep`` [N] bool is True."""
        return dataclasses.replace(
            self, **{name: value[keep] for name, value in vars(self).items() if value is not None}
        )
