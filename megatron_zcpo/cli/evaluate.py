"""``zcpo eval``: avg@k / pass@k of a policy (HF directory or Megatron checkpoint) on held-out data."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_zcpo.recipe.config import load_run_config
from megatron_zcpo.utils.config_loader import ConfigError


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate a policy: avg@k and pass@k on held-out data",
        description="Evaluate CONFIG's model (or --checkpoint) with CONFIG's "
        "eval section (data, k, temperature, top-p) and rollout engine.",
    )
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. eval.k=32 eval.top_p=0.7")
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="weights to evaluate (HF directory, Megatron checkpoint or a training step_* "
        "directory; default: model.path). Ignored with an attached SGLang engine, "
        "which serves its own weights.",
    )
    parser.add_argument("--output", default=None, help="JSON results (default: <run_dir>/eval/eval.json)")
    parser.set_defaults(func=run)


def check_checkpoint_path(path: Path, config_checkpoint_dir: Path) -> None:
    """Raise ``ConfigError`` when ``--checkpoint`` names nothing loadable, saying which checkpoints exist."""
    from megatron_zcpo.checkpoint.io import list_checkpoints
    from megatron_zcpo.convert.checkpoint import megatron_checkpoint_dir

    if path.exists() and (megatron_checkpoint_dir(path) is not None or (path / "config.json").is_file()):
        return
    roots = [path.parent, path, config_checkpoint_dir]
    steps = next(((root, found) for root in roots if (found := list_checkpoints(root))), None)
    if path.exists():
        problem = f"{path} holds no model: neither a Hugging Face directory (config.json) nor a Megatron checkpoint"
    else:
        problem = f"{path} does not exist"
    known = (
        f"the checkpoints under {steps[0]} are {', '.join(p.name for p in steps[1])}"
        if steps
        else f"no training checkpoints under {config_checkpoint_dir} either"
    )
    raise ConfigError(f"--checkpoint: {problem}; {known}")


def run(args: argparse.Namespace) -> int:
    from megatron_zcpo.recipe.evaluation import evaluate_policy

    config = load_run_config(args.config, args.overrides)
    if args.checkpoint:
        check_checkpoint_path(Path(args.checkpoint), config.checkpoint_dir)
    output = Path(args.output or Path(config.logging.run_dir) / "eval" / "eval.json")
    metrics = evaluate_policy(config, args.checkpoint, output)
    print(json.dumps({"checkpoint": str(Path(args.checkpoint or config.model.path)), **metrics}, indent=2))
    print(f"results written to {output}")
    return 0
