"""Preemption and time limits: SIGTERM/SIGUSR1 become one decision, taken by every rank at a safe point."""

from __future__ import annotations

import os
import signal
import threading
from typing import Dict, Optional, Sequence

# The exit status of a run stopped by a signal after its checkpoint: EX_TEMPFAIL ("try again"),
# what the examples' sbatch scripts requeue on (examples/common/zcpo_job.sh).
PREEMPTED_EXIT_CODE = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# A launcher that starts the ranks itself (``zcpo train`` on one machine) relays a stop signal to them
# through this file instead of signalling them: a rank that is still starting (its guard not yet
# installed) would die of the signal, while the file waits for its next safe point.
STOP_FILE_ENV = "ZCPO_STOP_FILE"
_received_early: Optional[int] = None  # a stop signal recorded by record_stop_signals()


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
        global _received_early
        _received_early = _received_early or signum

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
    checkpoint or the start). ``abandoned``: the signal came during step ``step + 1``'s rollout, which
    was abandoned (nothing of it trained; a resumed run generates it again); else during set-up or
    after the step in progress."""

    def __init__(self, signal_name: str, step: int, saved: bool = True, abandoned: bool = False):
        if abandoned:
            where = f"step {step + 1} abandoned during its rollout; " + (
                f"checkpoint of step {step}" if saved else "nothing trained yet"
            )
        else:
            where = "checkpoint written" if saved else "during set-up: nothing trained since the last checkpoint"
        super().__init__(
            f"stopped at step {step} after {signal_name} ({where}; exit code {PREEMPTED_EXIT_CODE}: requeue and resume)"
        )
        self.signal_name, self.step, self.abandoned = signal_name, step, abandoned


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
        self._previous: Dict[int, object] = {}
        self._relay_file: Optional[str] = None

    def _handle(self, signum, frame) -> None:
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
        self.received = self.received or _received_early  # recorded since __init__
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

    def should_stop(self) -> Optional[str]:
        """Collective: the name of the signal any rank received (the highest number), or None."""
        import torch
        import torch.distributed as dist

        from megatron_zcpo.utils.devices import compute_device

        flag = torch.tensor([float(self.requested())], device=compute_device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        return signal.Signals(signum).name if signum else None


def write_stop_request(path: str, signum: int) -> None:
    """Write ``signum`` to ``path`` atomically (a rank never reads a half-written file)."""
    partial = f"{path}.partial"
    with open(partial, "w") as request:
        request.write(str(int(signum)))
    os.replace(partial, path)
