"""``zcpo eval``: avg@k / pass@k of a policy (HF directory or Megatron checkpoint) on held-out data."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_zcpo.cli.config import load_run_config


def _hf_weights(path: Path):
    """(ModelConfig, iterator of (hf_name, tensor)) of an HF directory or a Megatron checkpoint.

    Megatron checkpoints (converted, a training run's ``weights/``, or a training checkpoint
    ``step_*`` directory) are read one tensor at a time and converted on the fly.
    """
    from megatron_zcpo.convert.checkpoint import megatron_checkpoint_dir, model_config_at, read_checkpoint_tensors
    from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint
    from megatron_zcpo.convert.mapping import megatron_to_hf_stream

    model, checkpoint = model_config_at(path), megatron_checkpoint_dir(path)
    if checkpoint is not None:
        from megatron_zcpo.megatron.initialize import setup_megatron

        setup_megatron()
        return model, megatron_to_hf_stream(read_checkpoint_tensors(checkpoint, model), model)
    safetensors = SafetensorsCheckpoint(path)
    return model, ((name, safetensors.tensor(name)) for name in safetensors.names())


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
    from megatron_zcpo.cli.train import eval_records, load_tokenizer, make_engine, run_evaluation, stop_token_ids
    from megatron_zcpo.rewards.scorer import RewardScorer

    config = load_run_config(args.config, args.overrides)
    tokenizer = load_tokenizer(config)
    source = Path(args.checkpoint or config.model.path)
    model_config, weights = _hf_weights(source)
    records = eval_records(config, tokenizer)
    if not records:
        raise SystemExit("zcpo eval: no evaluation data: set eval.data (or use a procedural data.task)")
    output = Path(args.output or Path(config.logging.run_dir) / "eval" / "eval.json")
    with make_engine(config, model_config, tokenizer) as engine, RewardScorer(config.reward) as scorer:
        if config.rollout.engine == "embedded":
            engine.update_weights(weights, version=0)
        metrics = run_evaluation(config, engine, records,
                                 lambda r, c: scorer.score_completions(r, c, tokenizer),
                                 stop_token_ids(config, tokenizer), output)
    print(json.dumps({"checkpoint": str(source), **metrics}, indent=2))
    print(f"results written to {output}")
    return 0
