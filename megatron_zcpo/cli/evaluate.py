"""``zcpo eval``: avg@k / pass@k of a policy (HF directory or Megatron checkpoint) on held-out data."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_zcpo.recipe.config import load_run_config


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("eval", help="evaluate a policy: avg@k and pass@k on held-out data",
                                   description="Evaluate CONFIG's model (or --checkpoint) with CONFIG's "
                                               "eval section (data, k, temperature, top-p) and rollout engine.")
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.k=32 eval.top_p=0.7")
    parser.add_argument("--checkpoint", default=None,
                        help="weights to evaluate (HF directory, Megatron checkpoint or a training step_* "
                             "directory; default: model.path). Ignored with an attached SGLang engine, "
                             "which serves its own weights.")
    parser.add_argument("--output", default=None, help="JSON results (default: <run_dir>/eval/eval.json)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_zcpo.recipe.evaluation import evaluate_policy

    config = load_run_config(args.config, args.overrides)
    output = Path(args.output or Path(config.logging.run_dir) / "eval" / "eval.json")
    metrics = evaluate_policy(config, args.checkpoint, output)
    print(json.dumps({"checkpoint": str(Path(args.checkpoint or config.model.path)), **metrics}, indent=2))
    print(f"results written to {output}")
    return 0
