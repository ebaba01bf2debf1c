"""The ``zcpo`` console script: dispatches to subcommands."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zcpo", description="ZCPO RL post-training on megatron-core")
    parser.add_subparsers(dest="command", required=True)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``zcpo`` console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
