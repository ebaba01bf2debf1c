"""``zcpo demo``: the embedded default on a CPU, end to end, with before/after held-out accuracy.

Builds (once, cached) a tiny Qwen2 and its BPE tokenizer warmed up on 1-digit arithmetic, then
runs ``zcpo train`` on it through the same Megatron trainer as a cluster run (TP=2 over gloo,
embedded rollout engine). ``--compare`` runs DAPO without KL, DAPO + k3 KL and ZCPO with the
same seeds and budget and writes a side-by-side table and plot.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Dict, List, Tuple

import yaml

DEMO_CONFIG = Path(__file__).with_name("demo.yaml")
# (run name, changes to the demo config): the paper's comparison on the tiny model.
COMPARED = (
    ("dapo", {"algorithm": {"name": "dapo"}}),
    ("dapo_k3", {"algorithm": {"name": "dapo", "kl_loss": "k3", "kl_coef": 0.04}}),
    ("zcpo", {}),
)


def _merge(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def demo_config(assets: Path, run_dir: Path, changes: dict, steps: int = 0) -> dict:
    """The demo's run config for ``assets`` (the cached model directory), as a plain dict."""
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    config["model"]["path"] = str(assets)
    config["data"]["train_files"] = [str(assets / "train.jsonl")]
    config["eval"]["data"]["train_files"] = [str(assets / "eval.jsonl")]
    config["logging"]["run_dir"] = str(run_dir)
    config["checkpoint"]["resume"] = "never"
    if steps:
        config["train"]["steps"] = steps
    return _merge(config, changes)


def eval_points(run_dir: Path, k: int) -> List[Tuple[int, float, int]]:
    """(step, avg@k, number of samples) of every evaluation of a run."""
    from megatron_zcpo.recipe.metrics_log import read_metrics

    return [(int(r["step"]), r[f"eval/avg@{k}"], int(r.get("eval/num_samples", 0)))
            for r in read_metrics(run_dir) if f"eval/avg@{k}" in r]


def summarize(runs: Dict[str, Path], k: int) -> List[dict]:
    """One row per run: held-out accuracy before/after, final reward, KL and length."""
    from megatron_zcpo.recipe.metrics_log import read_metrics

    rows = []
    for name, run_dir in runs.items():
        points = eval_points(run_dir, k)
        train = [r for r in read_metrics(run_dir) if "rollout/reward_mean" in r]
        last = train[-1] if train else {}
        rows.append({
            "run": name,
            "before": points[0][1] if points else math.nan,
            "after": points[-1][1] if points else math.nan,
            "samples": points[-1][2] if points else 0,
            "steps": int(last.get("step", 0)),
            "reward_last": last.get("rollout/reward_mean", math.nan),
            "kl_last": last.get("experience/kl", math.nan),
            "length_last": last.get("rollout/response_length_mean", math.nan),
        })
    return rows


def print_summary(rows: List[dict], k: int, console) -> None:
    from rich.table import Table

    table = Table(title=f"held-out accuracy (avg@{k}, problems never trained on)")
    for column in ("run", "before", "after", "change", "samples", "steps", "reward (last)", "KL (last)", "length"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["run"], f"{row['before']:.3f}", f"{row['after']:.3f}", f"{row['after'] - row['before']:+.3f}",
                      str(row["samples"]), str(row["steps"]), f"{row['reward_last']:.3f}", f"{row['kl_last']:.2e}",
                      f"{row['length_last']:.1f}")
    console.print(table)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="run the embedded default (tiny model, CPU) end to end",
                                   description=__doc__)
    parser.add_argument("--compare", action="store_true", help="DAPO, DAPO + k3 KL and ZCPO side by side")
    parser.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    parser.add_argument("--steps", type=int, default=0, help="training steps (default: the demo config's)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (the demo config uses TP=2)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_zcpo.recipe.metrics_log import make_console

    from megatron_zcpo.recipe.config import build_run_config
    from megatron_zcpo.recipe.demo_assets import build_demo_assets
    from megatron_zcpo.cli.report import write_report
    from megatron_zcpo.recipe.launch import relaunch_with_torchrun

    console = make_console()
    started = time.perf_counter()
    assets = build_demo_assets(log=console.print)
    out = Path(args.out)
    variants = COMPARED if args.compare else (("zcpo", {}),)
    runs: Dict[str, Path] = {}
    for name, changes in variants:
        run_dir = out / name
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run every time: the demo is a demonstration
        config = demo_config(assets, run_dir, changes, args.steps)
        build_run_config(copy.deepcopy(config))  # fail here, with the key named, not in the workers
        run_dir.mkdir(parents=True)
        config_path = run_dir.parent / f"{name}.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        console.print(f"[bold]{name}[/bold]: training with {config_path} ({args.nproc} processes)")
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        code = relaunch_with_torchrun(["train", str(config_path)], args.nproc)
        if code:
            console.print(f"[red]{name}: training failed (exit code {code})")
            return code
        runs[name] = run_dir
    k = int(yaml.safe_load(DEMO_CONFIG.read_text())["eval"]["k"])
    rows = summarize(runs, k)
    print_summary(rows, k, console)
    paths = write_report(list(runs.values()), out, names=list(runs))
    (out / "summary.json").write_text(json.dumps(rows, indent=2))
    console.print(f"plots: {', '.join(str(p) for p in paths)}; summary: {out / 'summary.json'}; "
                  f"took {time.perf_counter() - started:.0f} s")
    zcpo = next(row for row in rows if row["run"] == "zcpo")
    if not zcpo["after"] > zcpo["before"]:
        console.print("[yellow]held-out accuracy did not rise in this run")
    return 0
