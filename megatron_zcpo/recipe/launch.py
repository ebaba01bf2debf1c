"""Starting the recipe's processes: how many, and re-running the command under torchrun on one machine."""

from __future__ import annotations

import os
import signal
import sys
from typing import Optional, Sequence

from megatron_zcpo.recipe.config import RunConfig


def world_size_needed(config: RunConfig, nproc: Optional[int]) -> int:
    """Processes to start on this machine: ``--nproc``, else one model-parallel replica."""
    return nproc or config.parallel.tensor * config.parallel.pipeline * config.parallel.context


def relaunch_with_torchrun(argv: Sequence[str], nproc: int) -> int:
    """Re-run the ``zcpo`` command ``argv`` under torchrun with ``nproc`` local processes (the CPU
    default path); returns the exit code."""
    from torch.distributed.run import main as torchrun

    from megatron_zcpo.utils.runtime import free_port

    from megatron_zcpo.megatron.preemption import PREEMPTED_EXIT_CODE, STOP_SIGNALS

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Stop signals go to the workers, which stop at their next safe point with a checkpoint; torchrun
    # would instead pass SIGTERM on and kill them 30 s later, and dies on SIGUSR1.
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGINT,SIGHUP,SIGQUIT"
    previous = {signum: signal.signal(signum, _forward_to_children) for signum in STOP_SIGNALS}
    args = ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "megatron_zcpo.cli.main", *argv]
    try:
        torchrun(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception as error:  # torchrun's ChildFailedError: the failing rank's traceback was printed
        codes = {failure.exitcode for failure in getattr(error, "failures", {}).values()}
        if PREEMPTED_EXIT_CODE in codes:  # stopped by a signal after its checkpoint (the others follow)
            return PREEMPTED_EXIT_CODE
        print(f"zcpo: a training process failed: {error}", file=sys.stderr)
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def _forward_to_children(signum, frame) -> None:
    """Pass a stop signal on to this process's child processes (the training ranks)."""
    import psutil

    for child in psutil.Process().children():
        try:
            child.send_signal(signum)
        except psutil.NoSuchProcess:
            pass
