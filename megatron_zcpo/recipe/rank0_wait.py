"""Waiting for global rank 0 off the training process groups, so a rollout of hours kills no rank.

Rank 0 alone drives the rollout engine: start-up (servers healthy, checked), each step's rollout
(dynamic sampling's rounds), evaluation, the weight push's commit. Meanwhile every other rank
waits for it. Waiting in a collective of the training groups would time out after
``parallel.collective_timeout_s`` (NCCL's watchdog then tears the process down: with
``TORCH_NCCL_ASYNC_ERROR_HANDLING`` at its default, 3), while the shipped examples' rollouts are
predicted at hours. So the ranks meet rank 0 in a collective of a group of their own: a gloo
group over all ranks on the CPU (no GPU stream, no watchdog) whose timeout is the budget of rank
0's longest stretch alone (:func:`megatron_zcpo.recipe.timeouts.rank0_wait_timeout_s`). Rank 0's
own phases are bounded by their own timeouts, and when rank 0 fails its launcher (torchrun, or
srun ``--kill-on-bad-exit``) ends the others, so this timeout is only a backstop. Once everyone
has met here, the training groups carry the data (the rollout's tensors, the weights) at once.
"""

from __future__ import annotations

import datetime
from typing import Any, List, Optional


class Rank0Wait:
    """A gloo group over every rank for meeting rank 0 after its solo phases (collective to build).

    ``timeout_s``: how long a rank may wait in it; None: no group of its own, the default group
    (for callers whose rank 0 has no solo phase, e.g. tests that drive the loop in lockstep).
    """

    def __init__(self, timeout_s: Optional[float]):
        import torch.distributed as dist

        self.timeout_s = timeout_s
        self.group = (
            None if timeout_s is None else dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        )

    def barrier(self) -> None:
        """Wait until every rank (rank 0 included) got here."""
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object) on every rank, once rank 0 got here."""
        import torch.distributed as dist

        holder = [value]
        dist.broadcast_object_list(holder, src=0, group=self.group)
        return holder[0]

    def gather(self, value: Any) -> Optional[List[Any]]:
        """Every rank's ``value`` (picklable) on rank 0, in rank order; None on the other ranks."""
        import torch.distributed as dist

        values = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(value, values, dst=0, group=self.group)
        return values
