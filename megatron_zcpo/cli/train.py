"""``zcpo train``: parse the command, then run the RL recipe (:mod:`megatron_zcpo.recipe.training`)."""

from __future__ import annotations

import argparse
import os
import sys

from megatron_zcpo.recipe.config import dump_run_config, load_run_config

STARTUP_CHECKED = "ZCPO_STARTUP_CHECKED"  # set once the start-up checks passed in this process tree


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a policy with the configured RL algorithm",
        description="Run the RL recipe of CONFIG (YAML); key=value overrides "
        "any field, e.g. algorithm.beta=4 train.steps=100.",
    )
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys)")
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes to start on this machine when not launched by torchrun/srun (default: TP*PP*CP); "
        "with --dry-run: the processes the run will have, even inside a launcher's task (a job script's "
        "one-task check passes its training GPUs)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the config and its layout (as the ranks would), print it with every default filled in, and exit",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run that logging.run_dir holds (checkpoints, metrics) and start a new one "
        "there (without it, checkpoint.resume=never into such a directory is refused)",
    )
    parser.add_argument(
        "--skip-memory-check",
        action="store_true",
        help="start even when the memory planner says the layout does not fit this node's GPUs",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_zcpo.training.preemption import PREEMPTED_EXIT_CODE, PreemptionGuard

    # From the first moment: a stop signal during start-up is remembered, never fatal (a launcher
    # stops before starting the ranks; a rank stops at its first safe point).
    with PreemptionGuard() as guard:
        code = _run(args, guard)
    return PREEMPTED_EXIT_CODE if code is None else code


def _run(args: argparse.Namespace, guard) -> int | None:
    """``zcpo train`` under ``guard``; None: stopped by a signal before anything was trained."""
    from megatron_zcpo.megatron.initialize import distributed_env_from_slurm
    from megatron_zcpo.recipe.launch import relaunch_with_torchrun, report_rank_failure, world_size_needed
    from megatron_zcpo.recipe.training import run_training
    from megatron_zcpo.training.preemption import PREEMPTED_EXIT_CODE, Preempted

    config = load_run_config(args.config, args.overrides)  # validate before starting anything
    distributed_env_from_slurm()
    world_size = (
        int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else world_size_needed(config, args.nproc)
    )
    if args.dry_run:
        # A one-task srun step (a job's check) sees SLURM_NTASKS=1, not the job's training world.
        world_size = args.nproc or world_size
        _dry_run_checks(config, world_size, memory_check=not args.skip_memory_check)
        print(dump_run_config(config), end="")
        return 0
    if os.environ.get("RANK", "0") == "0" and not os.environ.get(STARTUP_CHECKED):
        from megatron_zcpo.recipe.preflight import run_startup_checks

        # files, directories, reward function, layout, the run directory: before any process starts
        run_startup_checks(
            config, world_size=world_size, overwrite=args.overwrite, memory_check=not args.skip_memory_check
        )
        os.environ[STARTUP_CHECKED] = "1"  # the processes torchrun starts below inherit it
    if "RANK" not in os.environ:
        nproc = world_size
        if guard.received:  # nothing started yet, so nothing to save: requeue as after a checkpoint
            print(
                f"zcpo train: stopped by signal {guard.received} before starting (exit code "
                f"{PREEMPTED_EXIT_CODE}: requeue and resume)",
                file=sys.stderr,
            )
            return None
        if nproc > 1:
            return relaunch_with_torchrun(["train", args.config, *args.overrides], nproc, guard)
    try:
        summary = run_training(config, guard)
    except Preempted as stopped:
        print(f"zcpo train: {stopped}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except Exception as error:
        if not report_rank_failure(error):  # a rank of `zcpo train`'s own launch: the launcher prints it
            raise
        return 1
    return 0 if summary is not None else 1


def _dry_run_checks(config, world_size: int, memory_check: bool) -> None:
    """``--dry-run``: every start-up check of ``zcpo train`` (files, reward function, layout on
    ``world_size`` processes, directories) without opening the run; the layout goes to stderr."""
    from megatron_zcpo.recipe.preflight import StartupCheckError, startup_problems

    problems = startup_problems(config, world_size=world_size, memory_check=memory_check)
    if problems:
        raise StartupCheckError("start-up checks failed:\n  " + "\n  ".join(problems))
    parallel = config.parallel
    layout = f"TP{parallel.tensor} PP{parallel.pipeline} CP{parallel.context} EP{parallel.expert}"
    model_parallel = parallel.tensor * parallel.pipeline * parallel.context
    print(
        f"zcpo train --dry-run: valid on {world_size} processes: {layout} DP{world_size // model_parallel}",
        file=sys.stderr,
    )
