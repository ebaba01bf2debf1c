"""Starting the recipe's processes: how many, re-running the command under torchrun on one machine,
and telling the user which rank failed first and why (once, last)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from megatron_zcpo.recipe.config import RunConfig

# Ranks started by relaunch_with_torchrun write their error here instead of printing it: the
# launcher prints the first failing rank's, once, after torchrun has stopped them all.
FAILURE_DIR_ENV = "ZCPO_FAILURE_DIR"


def world_size_needed(config: RunConfig, nproc: Optional[int]) -> int:
    """Processes to start on this machine: ``--nproc``, else one model-parallel replica."""
    return nproc or config.parallel.tensor * config.parallel.pipeline * config.parallel.context


def relaunch_with_torchrun(argv: Sequence[str], nproc: int, guard=None) -> int:
    """Re-run the ``zcpo`` command ``argv`` under torchrun with ``nproc`` local processes (the CPU
    default path); returns the exit code.

    ``guard`` is this process's installed :class:`~megatron_zcpo.training.preemption.PreemptionGuard`
    (None: one is installed for the launch): a stop signal to this process is relayed to the ranks
    through a file (``$ZCPO_STOP_FILE``), never as a signal, so a rank still starting up cannot die
    of it; each rank stops at its next safe point.
    """
    from torch.distributed.run import main as torchrun

    from megatron_zcpo.training.preemption import PREEMPTED_EXIT_CODE, STOP_FILE_ENV, PreemptionGuard

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
    os.environ[FAILURE_DIR_ENV] = os.path.join(relay_dir, "failures")
    os.mkdir(os.environ[FAILURE_DIR_ENV])
    guard.relay_to(os.environ[STOP_FILE_ENV])
    args = [
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "megatron_zcpo.cli.main",
        *argv,
    ]
    try:
        with _quiet_torchrun():
            torchrun(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception as error:  # torchrun's ChildFailedError, with each rank's exit code
        codes = {rank: failure.exitcode for rank, failure in getattr(error, "failures", {}).items()}
        if PREEMPTED_EXIT_CODE in codes.values():  # stopped by a signal after its checkpoint (the others follow)
            return PREEMPTED_EXIT_CODE
        print(
            failure_summary(Path(os.environ[FAILURE_DIR_ENV]), codes, nproc)
            or f"zcpo train: a training process failed: {error}",
            file=sys.stderr,
        )
        return 1
    finally:
        guard.relay_to(None)
        os.environ.pop(STOP_FILE_ENV, None)
        os.environ.pop(FAILURE_DIR_ENV, None)
        shutil.rmtree(relay_dir, ignore_errors=True)
    return 0


class _quiet_torchrun:
    """Silence torchrun's own log lines (which process it signalled, its failure table) while it runs:
    :func:`failure_summary` says what failed, once."""

    def __enter__(self):
        import logging

        self.logger = logging.getLogger("torch.distributed.elastic")
        self.level = self.logger.level
        self.logger.setLevel(logging.CRITICAL)

    def __exit__(self, *exc_info):
        self.logger.setLevel(self.level)


def report_rank_failure(error: BaseException) -> bool:
    """In a rank started by :func:`relaunch_with_torchrun`: record ``error`` (and its traceback) for
    the launcher, which prints the first failing rank's; returns True. Elsewhere (a single process,
    srun's tasks): returns False and the caller lets the error propagate as usual."""
    directory = os.environ.get(FAILURE_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return False
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "time": time.time(),
        "error": f"{type(error).__name__}: {error}",
        "traceback": "".join(traceback.format_exception(error)),
    }
    staged = os.path.join(directory, f".rank_{rank}.json")
    with open(staged, "w") as handle:
        json.dump(record, handle)
    os.replace(staged, os.path.join(directory, f"rank_{rank}.json"))
    return True


def _exit_description(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        why = " (killed: out of memory?)" if -code == signal.SIGKILL else ""
        return f"was stopped by {name}{why}"
    return f"exited with code {code}"


def failure_summary(directory: Path, exit_codes: Dict[int, int], world_size: int) -> Optional[str]:
    """What to tell the user when ranks failed: the first failing rank's traceback, its error last,
    after one line about the other ranks. ``directory``: the ranks' error records
    (:func:`report_rank_failure`); ``exit_codes``: torchrun's failed ranks and their exit codes
    (all there is to say when no rank recorded an error: killed, or failed before recording). None
    when nothing is known."""
    records = sorted(
        (json.loads(path.read_text()) for path in directory.glob("rank_*.json")),
        key=lambda record: (record["time"], record["rank"]),
    )
    if not records:
        if not exit_codes:
            return None
        return "zcpo train: " + "; ".join(
            f"rank {rank} {_exit_description(code)}" for rank, code in sorted(exit_codes.items())
        )
    first = records[0]
    same = sorted(r["rank"] for r in records[1:] if r["error"] == first["error"])
    other = [
        f"rank {r['rank']}: {r['error'].splitlines()[0][:200]}" for r in records[1:] if r["error"] != first["error"]
    ]
    recorded = {r["rank"] for r in records}
    stopped = [
        f"rank {rank} {_exit_description(code)}" for rank, code in sorted(exit_codes.items()) if rank not in recorded
    ]
    notes: List[str] = []
    if same:
        notes.append(f"rank{'s' if len(same) > 1 else ''} {', '.join(map(str, same))} failed with the same error")
    notes += other + stopped
    head = f"zcpo train: rank {first['rank']} of {world_size} failed first" + (
        f" ({'; '.join(notes)})" if notes else ""
    )
    return f"{head}; its error:\n{first['traceback'].rstrip()}"
