"""``zcpo train``: parse the command, then run the RL recipe (:mod:`megatron_zcpo.recipe.training`)."""

from __future__ import annotations

import argparse
import os
import sys

from megatron_zcpo.recipe.config import dump_run_config, load_run_config

STARTUP_CHECKED = "ZCPO_STARTUP_CHECKED"  # set once the start-up checks passed in this process tree


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a policy with the configured RL algorithm",
                                   description="Run the RL recipe of CONFIG (YAML); key=value overrides "
                                               "any field, e.g. algorithm.beta=4 train.steps=100.")
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes to start on this machine when not launched by torchrun/srun "
                             "(default: TP*PP*CP)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config, print it with every default filled in, and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_zcpo.megatron.preemption import PREEMPTED_EXIT_CODE, PreemptionGuard

    # From the first moment: a stop signal during start-up is remembered, never fatal (a launcher
    # stops before starting the ranks; a rank stops at its first safe point).
    with PreemptionGuard() as guard:
        code = _run(args, guard)
    return PREEMPTED_EXIT_CODE if code is None else code


def _run(args: argparse.Namespace, guard) -> "int | None":
    """``zcpo train`` under ``guard``; None: stopped by a signal before anything was trained."""
    from megatron_zcpo.megatron.initialize import distributed_env_from_slurm
    from megatron_zcpo.megatron.preemption import PREEMPTED_EXIT_CODE, Preempted
    from megatron_zcpo.recipe.launch import relaunch_with_torchrun, world_size_needed
    from megatron_zcpo.recipe.training import run_training

    config = load_run_config(args.config, args.overrides)  # validate before starting anything
    if args.dry_run:
        print(dump_run_config(config), end="")
        return 0
    distributed_env_from_slurm()
    if os.environ.get("RANK", "0") == "0" and not os.environ.get(STARTUP_CHECKED):
        from megatron_zcpo.recipe.preflight import run_startup_checks

        run_startup_checks(config)  # files, directories, reward function: before any process starts
        os.environ[STARTUP_CHECKED] = "1"  # the processes torchrun starts below inherit it
    if "RANK" not in os.environ:
        nproc = world_size_needed(config, args.nproc)
        if guard.received:  # nothing started yet, so nothing to save: requeue as after a checkpoint
            print(f"zcpo train: stopped by signal {guard.received} before starting (exit code "
                  f"{PREEMPTED_EXIT_CODE}: requeue and resume)", file=sys.stderr)
            return None
        if nproc > 1:
            return relaunch_with_torchrun(["train", args.config, *args.overrides], nproc, guard)
    try:
        summary = run_training(config, guard)
    except Preempted as stopped:
        print(f"zcpo train: {stopped}", file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    return 0 if summary is not None else 1
