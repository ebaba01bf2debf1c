"""Preemption and time limits: SIGTERM/SIGUSR1 become one decision, taken by every rank at a safe point."""

from __future__ import annotations

import signal
from typing import Dict, Optional, Sequence

import torch

from megatron_zcpo.megatron.platform import compute_device

# The exit status of a run stopped by a signal after its checkpoint: EX_TEMPFAIL ("try again"),
# what the examples' sbatch scripts requeue on (examples/common/zcpo_job.sh).
PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """The run stopped at a safe point because a rank received ``signal_name``; a checkpoint exists."""

    def __init__(self, signal_name: str, step: int):
        super().__init__(f"stopped at step {step} after {signal_name} (checkpoint written; "
                         f"exit code {PREEMPTED_EXIT_CODE}: requeue and resume)")
        self.signal_name, self.step = signal_name, step


class PreemptionGuard:
    """Remembers a stop signal instead of dying on it; :meth:`should_stop` makes it every rank's decision.

    Install on every rank (``with PreemptionGuard() as guard:``): a handled signal only records
    itself, so the step (and a checkpoint save) in progress completes. At each safe point every
    rank calls :meth:`should_stop`, a one-element all-reduce (MAX): all ranks stop after the same
    step, whichever rank got the signal. The previous handlers come back on exit.
    """

    def __init__(self, signals: Sequence[int] = STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: Optional[int] = None
        self._previous: Dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def __enter__(self) -> "PreemptionGuard":
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def should_stop(self) -> Optional[str]:
        """Collective: the name of the signal any rank received (the highest number), or None."""
        import torch.distributed as dist

        flag = torch.tensor([float(self.received or 0)], device=compute_device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        return signal.Signals(signum).name if signum else None
