"""The ``zcpo`` console script: dispatches to subcommands."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def build_parser() -> argparse.ArgumentParser:
    from megatron_zcpo.cli import checkpoint, demo, evaluate, plan, report, train

    parser = argparse.ArgumentParser(prog="zcpo", description="ZCPO RL post-training on megatron-core")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in (train, demo, evaluate, plan, report, checkpoint):
        command.add_parser(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``zcpo`` console script; returns the process exit code.

    Called without ``argv`` (as a process's entry point), ``zcpo train`` holds stop signals from its
    first moment to its last (see :mod:`megatron_zcpo.training.preemption`)."""
    training_process = argv is None and sys.argv[1:2] == ["train"]
    if not training_process:
        return _dispatch(argv)
    from megatron_zcpo.training import preemption

    preemption.record_stop_signals()  # before the heavy imports: a preemption during start-up must not kill training
    code = _dispatch(argv)
    preemption.ignore_stop_signals()  # the run is over: its exit code stands, whatever arrives while exiting
    return code


def _dispatch(argv: Optional[List[str]]) -> int:
    from megatron_zcpo.utils.config_loader import ConfigError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides may also follow the options (`zcpo eval CONFIG --checkpoint X eval.k=32`).
    if extra and hasattr(args, "overrides") and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except ConfigError as error:
        print(f"zcpo {args.command}: config error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
