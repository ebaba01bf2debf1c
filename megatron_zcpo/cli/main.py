"""The ``zcpo`` console script: dispatches to subcommands."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def build_parser() -> argparse.ArgumentParser:
    from megatron_zcpo.cli import train

    parser = argparse.ArgumentParser(prog="zcpo", description="ZCPO RL post-training on megatron-core")
    subparsers = parser.add_subparsers(dest="command", required=True)
    train.add_parser(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``zcpo`` console script; returns the process exit code."""
    from megatron_zcpo.utils.config_loader import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as error:
        print(f"zcpo {args.command}: config error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
