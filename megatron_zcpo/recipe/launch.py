"""Starting the recipe's processes: how many, and re-running the command under torchrun on one machine."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Optional, Sequence

from megatron_zcpo.recipe.config import RunConfig


def world_size_needed(config: RunConfig, nproc: Optional[int]) -> int:
    """Processes to start on this machine: ``--nproc``, else one model-parallel replica."""
    return nproc or config.parallel.tensor * config.parallel.pipeline * config.parallel.context


def relaunch_with_torchrun(argv: Sequence[str], nproc: int, guard=None) -> int:
    """Re-run the ``zcpo`` command ``argv`` under torchrun with ``nproc`` local processes (the CPU
    default path); returns the exit code.

    ``guard`` is this process's installed :class:`~megatron_zcpo.megatron.preemption.PreemptionGuard`
    (None: one is installed for the launch): a stop signal to this process is relayed to the ranks
    through a file (``$ZCPO_STOP_FILE``), never as a signal, so a rank still starting up cannot die
    of it; each rank stops at its next safe point.
    """
    from torch.distributed.run import main as torchrun

    from megatron_zcpo.megatron.preemption import PREEMPTED_EXIT_CODE, STOP_FILE_ENV, PreemptionGuard

    if guard is None:
        with PreemptionGuard() as guard:
            return relaunch_with_torchrun(argv, nproc, guard)
    from megatron_zcpo.utils.runtime import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torchrun must leave SIGTERM and SIGUSR1 to the guard (it would pass SIGTERM on and kill the
    # ranks 30 s later, and it dies on SIGUSR1).
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGINT,SIGHUP,SIGQUIT"
    relay_dir = tempfile.mkdtemp(prefix="zcpo-stop-")
    os.environ[STOP_FILE_ENV] = os.path.join(relay_dir, "requested")
    guard.relay_to(os.environ[STOP_FILE_ENV])
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
        guard.relay_to(None)
        os.environ.pop(STOP_FILE_ENV, None)
        shutil.rmtree(relay_dir, ignore_errors=True)
    return 0
