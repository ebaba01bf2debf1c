"""Starting the recipe's processes: how many, and re-running the command under torchrun on one machine."""

from __future__ import annotations

import os
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

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "megatron_zcpo.cli.main", *argv]
    try:
        torchrun(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception as error:  # torchrun's ChildFailedError: the failing rank's traceback was printed
        print(f"zcpo: a training process failed: {error}", file=sys.stderr)
        return 1
    return 0
