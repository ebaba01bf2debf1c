"""Preemption and time limits: SIGTERM/SIGUSR1 become one decision, taken by every rank at a safe point."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence, Tuple

# The exit status of a run stopped by a signal after its checkpoint: EX_TEMPFAIL ("try again"),
# what the examples' sbatch scripts requeue on (examples/common/zcpo_job.sh).
PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# A launcher that starts the ranks itself (``zcpo train`` on one machine) relays a stop signal to them
# through this file instead of signalling them: a rank that is still starting (its guard not yet
# installed) would die of the signal, while the file waits for its next safe point.
STOP_FILE_ENV = "ZCPO_STOP_FILE"
_received_early: Optional[int] = None  # a stop signal recorded by record_stop_signals()
_received_early_at = 0.0  # when (time.time())


def record_stop_signals() -> None:
    """Make a stop signal harmless from the start of a process and of every process it starts:
    remember it until a :class:`PreemptionGuard` takes over (the guard starts with it as received).
    Call first thing in an entry point; this module imports nothing heavy, so the window in which a
    signal still kills the process is the interpreter's own start-up.

    Slurm signals every process of a job step, not only the rank: megatron-core's checkpoint-queue
    ``Manager``, multiprocessing's resource tracker and forkserver, reward workers, tool sandboxes.
    One of them killed breaks the rank's next save (``BrokenPipeError``). So the stop signals are
    *blocked* here, in this thread and hence in every thread and process started after it (the mask
    is inherited through fork and exec, and installing a handler does not unblock); one thread takes
    them with ``sigwait`` and runs this process's Python handler for them (the guard's). Processes
    started from here on stop on other signals (SIGINT, SIGKILL), never on SIGTERM or SIGUSR1.
    """

    def remember(signum, frame) -> None:
        global _received_early, _received_early_at
        if not _received_early:
            _received_early, _received_early_at = signum, time.time()

    for signum in STOP_SIGNALS:
        signal.signal(signum, remember)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # CPython's resource tracker unblocks SIGINT and SIGTERM in the thread that first starts it
    # (resource_tracker.ensure_running, 3.11-3.13), and a process spawned by that thread later (a
    # forkserver, the checkpoint Manager) would die of SIGTERM: start it now (blocked: it survives
    # SIGUSR1; it ignores SIGTERM itself) and block again.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    threading.Thread(target=_run_handlers_of_blocked_signals, name="zcpo-stop-signals", daemon=True).start()


def _run_handlers_of_blocked_signals() -> None:
    """The thread of :func:`record_stop_signals`: every stop signal the process receives runs the
    Python handler installed for it when it arrives (the recorder, the guard, or none once ignored)."""
    while True:
        signum = signal.sigwait(STOP_SIGNALS)
        handler = signal.getsignal(signum)
        if callable(handler):
            handler(signum, None)


def ignore_stop_signals() -> None:
    """Ignore stop signals for the rest of this process: call once its run is over, so that a signal
    arriving while it exits cannot replace its exit code by a kill (the interpreter puts the default,
    terminating, handlers back while it shuts down; ignored signals stay ignored)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


class Preempted(Exception):
    """The run stopped at a safe point because a rank received ``signal_name``; a checkpoint of
    ``step`` exists (``saved``: written now or earlier; else nothing was trained since the last
    checkpoint or the start). ``abandoned``: the signal came during step ``step + 1``, which was
    abandoned in ``phase`` ("rollout" or "update"; nothing of it kept: a resumed run does it again);
    else during set-up or after the step in progress. ``where``: the message's own account of it."""

    def __init__(
        self,
        signal_name: str,
        step: int,
        saved: bool = True,
        abandoned: bool = False,
        phase: str = "rollout",
        where: Optional[str] = None,
    ):
        if where is None and abandoned:
            where = f"step {step + 1} abandoned during its {phase}; " + (
                f"checkpoint of step {step}" if saved else "nothing trained yet"
            )
        elif where is None:
            where = "checkpoint written" if saved else "during set-up: nothing trained since the last checkpoint"
        super().__init__(
            f"stopped at step {step} after {signal_name} ({where}; exit code {PREEMPTED_EXIT_CODE}: requeue and resume)"
        )
        self.signal_name, self.step, self.abandoned, self.phase = signal_name, step, abandoned, phase


@dataclass(frozen=True)
class UpdateProgress:
    """Where a step's update stands at one of its safe points (before its experience pass, before
    each mini-batch): ``done`` of ``total`` mini-batches trained (0: the weights are as the last
    completed step left them), in ``seconds``."""

    done: int
    total: int
    seconds: float = 0.0

    def seconds_left(self) -> Optional[float]:
        """The remaining mini-batches at the pace of the done ones; None before the first."""
        return self.seconds / self.done * (self.total - self.done) if self.done else None


# Collective: asked at an update's safe point, the name of the signal to stop there for, or None.
StopCheck = Callable[[UpdateProgress], Optional[str]]


class UpdateInterrupted(Exception):
    """A stop request taken at a safe point of a step's update (``progress``): the trainer stopped there."""

    def __init__(self, signal_name: str, progress: UpdateProgress):
        super().__init__(f"{signal_name} after {progress.done} of {progress.total} mini-batches")
        self.signal_name, self.progress = signal_name, progress


def stop_if_asked(stop_check: Optional[StopCheck], progress: UpdateProgress) -> None:
    """Raise :class:`UpdateInterrupted` when ``stop_check`` (collective; None: never) answers a signal's name."""
    stop = stop_check(progress) if stop_check is not None else None
    if stop:
        raise UpdateInterrupted(stop, progress)


class PreemptionGuard:
    """Remembers a stop signal instead of dying on it; :meth:`should_stop` makes it every rank's decision.

    Install on every rank (``with PreemptionGuard() as guard:``), as early as possible: a handled
    signal only records itself, so the update (and a checkpoint save) in progress completes. At each
    safe point every rank calls :meth:`should_stop`, a one-element all-reduce (MAX): all ranks stop
    after the same step, whichever rank got the signal. The rollout's owner (global rank 0) also
    watches :meth:`requested` during a step's rollout and abandons it (:mod:`megatron_zcpo.recipe.training`). A stop relayed by the launcher through the
    file named by ``$ZCPO_STOP_FILE`` counts as received (see :meth:`relay_to`). The previous
    handlers come back on exit.
    """

    def __init__(self, signals: Sequence[int] = STOP_SIGNALS):
        self.signals = tuple(signals)
        self.received: Optional[int] = _received_early
        self.received_at = _received_early_at  # when (time.time()), if received
        self._previous: Dict[int, object] = {}
        self._relay_file: Optional[str] = None

    def _handle(self, signum, frame) -> None:
        if not self.received:
            self.received_at = time.time()
        self.received = signum
        if self._relay_file is not None:
            write_stop_request(self._relay_file, signum)

    def relay_to(self, path: Optional[str]) -> None:
        """Launcher side: from now on a received stop signal is written to ``path`` (at once if one
        came already), where the ranks started with ``$ZCPO_STOP_FILE=path`` find it; None stops relaying."""
        self._relay_file = path
        if path is not None and self.received:
            write_stop_request(path, self.received)

    def __enter__(self) -> PreemptionGuard:
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        if not self.received and _received_early:  # recorded since __init__
            self.received, self.received_at = _received_early, _received_early_at
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def requested(self) -> int:
        """This process's stop request, not collective: the signal number received here or relayed
        through ``$ZCPO_STOP_FILE``, else 0."""
        if self.received:
            return int(self.received)
        path = os.environ.get(STOP_FILE_ENV)
        if path and os.path.exists(path):
            with open(path) as relayed:
                return int(relayed.read().strip() or signal.SIGTERM)
        return 0

    def seconds_since_request(self) -> float:
        """Seconds since this process's stop request arrived (the signal, or the relay file's writing); 0 without one."""
        if self.received:
            return max(0.0, time.time() - self.received_at)
        path = os.environ.get(STOP_FILE_ENV)
        try:
            return max(0.0, time.time() - os.path.getmtime(path)) if path else 0.0
        except OSError:  # no request relayed
            return 0.0

    def should_stop(self) -> Optional[str]:
        """Collective: the name of the signal any rank received (the highest number), or None."""
        return self.stop_request()[0]

    def stop_request(self, *values: float) -> Tuple[Optional[str], Tuple[float, ...]]:
        """Collective: (:meth:`should_stop`'s answer, each of ``values`` at its largest over the ranks),
        one all-reduce (MAX): the ranks decide on the same numbers (e.g. their estimates of the time left)."""
        import torch
        import torch.distributed as dist

        from megatron_zcpo.utils.devices import compute_device

        flags = torch.tensor([float(self.requested()), *values], dtype=torch.float64, device=compute_device())
        if dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signum, *maxima = flags.tolist()
        return (signal.Signals(int(signum)).name if signum else None), tuple(maxima)


def write_stop_request(path: str, signum: int) -> None:
    """Write ``signum`` to ``path`` atomically (a rank never reads a half-written file)."""
    partial = f"{path}.partial"
    with open(partial, "w") as request:
        request.write(str(int(signum)))
    os.replace(partial, path)
