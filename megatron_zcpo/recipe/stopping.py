"""A stop request inside a step: abandon the step, finish it, or exit unsaved, whichever loses least in the grace time.

A stop signal (Slurm's ``--signal=B:USR1@300``, a preemption's TERM) leaves the run
``checkpoint.stop_grace_s`` seconds. A step of a large model outlasts that (Qwen2.5-32B: ~3,500 s of
update in a ~10,500 s step), so a stop is taken where the step stands, not after it:

- during the rollout: the step is abandoned (rank 0's engine stops generating; recipe/rollout.py);
- during the update, before its first mini-batch (the weights are as the last completed step left
  them): abandoned alike, in a synchronous run (an overlapped or asynchronous one has already launched
  or taken the next step's rollout and cannot put it back: it goes on as below);
- during the update after a mini-batch, or before the first one when the newest checkpoint holds the
  last completed step: abandoned without a save when nothing unsaved would be lost; else the step is
  finished and saved if the remaining mini-batches (at the pace of the done ones) and a save (as long as
  the last one) fit in the grace time left, and otherwise the run exits at once, unsaved, so that the
  job still requeues (a kill at the time limit would not): the resumed run continues from the newest
  checkpoint (``checkpoint.every`` bounds what is trained again).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from megatron_zcpo.training.preemption import UpdateProgress


@dataclass(frozen=True)
class AbandonedStep:
    """A step ended by a stop request (``signal_name``) during its ``phase`` ("rollout" or "update";
    ``progress``: where the update stood)."""

    signal_name: str
    phase: str = "rollout"
    progress: Optional[UpdateProgress] = None

    @property
    def weights_changed(self) -> bool:
        """Whether a mini-batch of the step was trained (its weights are no longer a step's)."""
        return self.progress is not None and self.progress.done > 0


class UpdateStopCheck:
    """The trainer's ``stop_check`` (collective, every rank): at an update's safe point, the signal's name
    when the step should end there, None when it goes on (no request, or the step is to be finished).

    ``unsaved()``: completed steps the newest checkpoint does not hold (a fresh run's count from 0);
    ``last_save_s()``: how long the last save took (0 before the first); ``say``: rank 0's log line.
    """

    def __init__(
        self,
        guard,
        grace_s: float,
        synchronous: bool,
        unsaved: Callable[[], int],
        last_save_s: Callable[[], float],
        say: Callable[[str], None],
    ):
        self.guard, self.grace_s, self.synchronous = guard, grace_s, synchronous
        self.unsaved, self.last_save_s, self.say = unsaved, last_save_s, say
        self.finishing_said = False
        self.needed_s: Optional[float] = None  # the last estimate of a finish and a save (None: no pace yet)

    def __call__(self, progress: UpdateProgress) -> Optional[str]:
        left = progress.seconds_left()
        estimate = -1.0 if left is None else left + self.last_save_s()
        stop, (estimate, waited) = self.guard.stop_request(estimate, self.guard.seconds_since_request())
        if not stop:
            return None
        self.needed_s = None if estimate < 0 else estimate
        if self.unsaved() == 0 or (progress.done == 0 and self.synchronous):
            return stop  # abandoned: nothing unsaved is lost (the recipe saves the last completed step if needed)
        if self.needed_s is None or self.needed_s <= self.grace_s - waited:
            if self.needed_s is not None and not self.finishing_said:
                self.finishing_said = True
                self.say(
                    f"{stop}: finishing the step (its last {progress.total - progress.done} of {progress.total} mini-batches "
                    f"and a save, ~{self.needed_s:.0f} s, within checkpoint.stop_grace_s={self.grace_s:g})"
                )
            return None
        return stop

    def exit_unsaved_message(self, abandoned: AbandonedStep, step: int, checkpointed: Optional[int]) -> str:
        """What the stop says when step ``step + 1`` is left mid-update with completed steps unsaved."""
        progress = abandoned.progress
        assert progress is not None
        since = f"the checkpoint of step {checkpointed}" if checkpointed is not None else "the start"
        return (
            f"step {step + 1} stopped during its update after {progress.done} of {progress.total} mini-batches: "
            f"finishing and saving it (~{self.needed_s or 0:.0f} s) would outlast checkpoint.stop_grace_s="
            f"{self.grace_s:g} s; not saved: the resumed run continues from {since} "
            f"(lower checkpoint.every to lose less)"
        )
