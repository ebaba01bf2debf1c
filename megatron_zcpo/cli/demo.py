"""``zcpo demo``: the embedded default on a CPU, end to end, with before/after held-out accuracy.

Builds (once, cached) a tiny Qwen2 and its BPE tokenizer, partly warmed up on two-digit addition,
then runs ``zcpo train`` on it through the same Megatron trainer as a cluster run (TP=2 over
gloo, embedded rollout engine). The summary is the held-out gain paired per problem, with its
standard error and a verdict; ``--seed`` picks the RL run's randomness, ``--seeds N`` runs the demo
over N seeds and prints one table (every seed's gain, its standard error and its lowest point). ``--compare`` runs DAPO
without KL, DAPO + k3 KL and ZCPO with the same seeds and budget over ``--seeds`` seeds and
reports each method's mean and standard error over seeds and the paired differences.
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
DEFAULT_SEED = 1
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


def seed_changes(seed: int) -> dict:
    """The config changes of demo seed ``seed``: the RL run's randomness (prompt order, rollout and
    evaluation sampling, trainer RNG); the warmed-up model and the held-out problems stay the same."""
    return {"train": {"seed": seed}, "rollout": {"seed": seed}, "data": {"seed": seed},
            "eval": {"seed": 10_000 + seed}}


def run_summary(run_dir: Path) -> dict:
    """A run's held-out gain (:func:`megatron_zcpo.cli.demo_stats.run_gain`) with its training reward
    and KL to the reference (means over the last quarter of the steps) and its step count."""
    from megatron_zcpo.cli.demo_stats import run_gain
    from megatron_zcpo.recipe.metrics_log import read_metrics

    train = [r for r in read_metrics(run_dir) if "rollout/reward_mean" in r]
    tail = train[-max(1, len(train) // 4):]

    def tail_mean(key: str) -> float:
        values = [r[key] for r in tail if key in r]
        return sum(values) / len(values) if values else math.nan

    return {**run_gain(run_dir), "reward": tail_mean("rollout/reward_mean"), "kl": tail_mean("experience/kl"),
            "steps": int(train[-1]["step"]) if train else 0}


def print_run_summary(name: str, seed: int, summary: dict, console) -> None:
    """Before, after, the paired gain with its standard error, and a plain verdict."""
    from rich.table import Table

    from megatron_zcpo.cli.demo_stats import verdict

    table = Table(title=f"{name}, seed {seed}: held-out accuracy on {summary['problems']} problems never trained on")
    for column in ("before", "after", "gain", "SE (paired)", "gain / SE", "reward", "KL to ref", "steps"):
        table.add_column(column, justify="right")
    table.add_row(f"{summary['before']:.3f}", f"{summary['after']:.3f}", f"{summary['gain']:+.3f}",
                  f"{summary['se']:.3f}", f"{summary['z']:.1f}", f"{summary['reward']:.3f}",
                  f"{summary['kl']:.2e}", str(summary["steps"]))
    console.print(table)
    console.print(verdict(summary["gain"], summary["se"]))


def print_comparison(rows: List[dict], differences: List[dict], console) -> None:
    """The method comparison: per method mean +- SE over seeds, then the paired differences."""
    from rich.table import Table

    table = Table(title=f"methods over {rows[0]['seeds']} seeds (mean +- standard error over seeds)")
    for column in ("method", "held-out after", "held-out gain", "reward", "KL to ref"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["method"], *(f"{row[k]:.3f} +- {row[k + '_se']:.3f}" for k in ("after", "gain", "reward")),
                      f"{row['kl']:.2e} +- {row['kl_se']:.1e}")
    console.print(table)
    diffs = Table(title="differences, paired by seed (method - baseline)")
    for column in ("difference", "held-out after", "reward", "KL to ref"):
        diffs.add_column(column, justify="right")
    by_pair: Dict[Tuple[str, str], Dict[str, dict]] = {}
    for d in differences:
        by_pair.setdefault((d["method"], d["baseline"]), {})[d["key"]] = d
    for (method, baseline), cells in by_pair.items():
        diffs.add_row(f"{method} - {baseline}",
                      *(f"{cells[k]['diff']:+.3f} +- {cells[k]['se']:.3f}" for k in ("after", "reward")),
                      f"{cells['kl']['diff']:+.2e} +- {cells['kl']['se']:.1e}")
    console.print(diffs)


def write_accuracy_plot(runs: Dict[str, List[Path]], k: int, path: Path) -> Path:
    """Held-out avg@k against the step with error bars: one line per method; with one run its
    standard error over problems, with several (seeds) the mean and standard error over seeds."""
    from matplotlib.figure import Figure

    from megatron_zcpo.cli.demo_stats import mean_and_se, per_problem_accuracy

    figure = Figure(figsize=(6, 4), layout="constrained")
    axes = figure.add_subplot(1, 1, 1)
    for name, run_dirs in runs.items():
        curves = []
        for run_dir in run_dirs:
            points = {}
            for file in sorted(Path(run_dir).glob("eval/step_*.json")):
                accuracy = list(per_problem_accuracy(json.loads(file.read_text())).values())
                points[int(file.stem.split("_")[1])] = accuracy
            curves.append(points)
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        if len(curves) == 1:
            stats = [mean_and_se(curves[0][s]) for s in steps]
            label = name
        else:
            stats = [mean_and_se([sum(c[s]) / len(c[s]) for c in curves]) for s in steps]
            label = f"{name} ({len(curves)} seeds)"
        axes.errorbar(steps, [m for m, _ in stats], yerr=[0.0 if math.isnan(e) else e for _, e in stats],
                      marker="o", capsize=3, label=label)
    axes.set_xlabel("training step")
    axes.set_ylabel(f"held-out avg@{k}")
    axes.set_title("held-out accuracy (error bars: one standard error)", fontsize=10)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=110)
    return path


def add_parser(subparsers) -> None:
    """Register ``zcpo demo`` and its flags."""
    parser = subparsers.add_parser("demo", help="run the embedded default (tiny model, CPU) end to end",
                                   description=__doc__)
    parser.add_argument("--compare", action="store_true", help="DAPO, DAPO + k3 KL and ZCPO side by side")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"seed of the RL run (default {DEFAULT_SEED}); with --compare, the first seed")
    parser.add_argument("--seeds", type=int, default=None,
                        help="seeds --seed, --seed+1, ...: with --compare per method (default 3); without, "
                             "the demo over that many seeds with one table (default 1: a single run)")
    parser.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    parser.add_argument("--steps", type=int, default=0, help="training steps (default: the demo config's)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (the demo config uses TP=2)")
    parser.set_defaults(func=run)


def train_one(assets: Path, run_dir: Path, changes: dict, args: argparse.Namespace, console) -> int:
    """One ``zcpo train`` run of the demo config with ``changes`` into ``run_dir`` (fresh)."""
    from megatron_zcpo.recipe.config import build_run_config
    from megatron_zcpo.recipe.launch import relaunch_with_torchrun

    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run every time: the demo is a demonstration
    config = demo_config(assets, run_dir, changes, args.steps)
    build_run_config(copy.deepcopy(config))  # fail here, with the key named, not in the workers
    run_dir.mkdir(parents=True)
    config_path = run_dir.with_suffix(".yaml")
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    console.print(f"[bold]{run_dir.name}[/bold]: training with {config_path} ({args.nproc} processes)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = relaunch_with_torchrun(["train", str(config_path)], args.nproc)
    if code:
        console.print(f"[red]{run_dir}: training failed (exit code {code})")
    return code


def run_sweep(assets: Path, args: argparse.Namespace, console) -> int:
    """``zcpo demo --seeds N``: the demo over seeds ``--seed`` .. ``--seed + N - 1`` into
    ``<out>/zcpo/seed_<s>``, then :func:`megatron_zcpo.cli.demo_stats.print_sweep`'s table; exit code.
    ``<out>/sweep.json`` and ``sweep.md`` are rewritten after every seed (an interrupted sweep keeps its rows)."""
    from megatron_zcpo.cli.demo_stats import print_sweep, seed_sweep_rows, sweep_markdown

    out = Path(args.out)
    runs: Dict[int, Path] = {}
    wall_s: Dict[int, float] = {}
    for seed in range(args.seed, args.seed + args.seeds):
        started = time.perf_counter()
        code = train_one(assets, out / "zcpo" / f"seed_{seed}", seed_changes(seed), args, console)
        if code:
            return code
        runs[seed], wall_s[seed] = out / "zcpo" / f"seed_{seed}", time.perf_counter() - started
        rows, summary = seed_sweep_rows(runs, wall_s)
        console.print(f"seed {seed}: {rows[-1]['before']:.3f} -> {rows[-1]['after']:.3f} ({rows[-1]['z']:+.1f} SE) "
                      f"in {wall_s[seed]:.0f} s")
        (out / "sweep.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
        (out / "sweep.md").write_text(sweep_markdown(rows, summary) + "\n")
    print_sweep(rows, summary, console)
    k = int(yaml.safe_load(DEMO_CONFIG.read_text())["eval"]["k"])
    plot = write_accuracy_plot({"zcpo": list(runs.values())}, k, out / "heldout_accuracy.png")
    console.print(f"plot: {plot}; table: {out / 'sweep.md'}, {out / 'sweep.json'}")
    return 0


def run(args: argparse.Namespace) -> int:
    """``zcpo demo``: one seeded ZCPO run with its paired summary, or ``--compare`` over seeds; exit code."""
    from megatron_zcpo.recipe.demo_assets import build_demo_assets
    from megatron_zcpo.recipe.metrics_log import make_console
    from megatron_zcpo.cli.report import write_report

    console = make_console()
    started = time.perf_counter()
    assets = build_demo_assets(log=console.print)
    out = Path(args.out)
    k = int(yaml.safe_load(DEMO_CONFIG.read_text())["eval"]["k"])
    if not args.compare and (args.seeds or 1) > 1:
        code = run_sweep(assets, args, console)
        console.print(f"took {time.perf_counter() - started:.0f} s")
        return code
    if not args.compare:
        run_dir = out / "zcpo"
        code = train_one(assets, run_dir, seed_changes(args.seed), args, console)
        if code:
            return code
        summary = run_summary(run_dir)
        print_run_summary("zcpo", args.seed, summary, console)
        plot = write_accuracy_plot({"zcpo": [run_dir]}, k, out / "heldout_accuracy.png")
        write_report([run_dir], out, names=["zcpo"])
        (out / "summary.json").write_text(json.dumps({"seed": args.seed, **summary}, indent=2))
    else:
        from megatron_zcpo.cli.demo_stats import compare_methods

        seeds = list(range(args.seed, args.seed + (args.seeds or 3)))
        runs: Dict[str, List[Path]] = {name: [] for name, _ in COMPARED}
        for seed in seeds:  # seed-major: an interrupted comparison still has whole seeds
            for name, changes in COMPARED:
                run_dir = out / name / f"seed_{seed}"
                code = train_one(assets, run_dir, _merge(seed_changes(seed), changes), args, console)
                if code:
                    return code
                runs[name].append(run_dir)
        per_seed = {name: [run_summary(d) for d in dirs] for name, dirs in runs.items()}
        rows, differences = compare_methods(per_seed, ("after", "gain", "reward", "kl"), baseline="dapo")
        print_comparison(rows, differences, console)
        plot = write_accuracy_plot(runs, k, out / "heldout_accuracy.png")
        write_report([d for dirs in runs.values() for d in dirs], out,
                     names=[f"{name} seed {seed}" for name, dirs in runs.items() for seed in seeds[:len(dirs)]])
        (out / "summary.json").write_text(json.dumps({"seeds": seeds, "per_seed": per_seed, "methods": rows,
                                                      "differences": differences}, indent=2))
    console.print(f"plots: {plot}, {out / 'report.html'}; summary: {out / 'summary.json'}; took {time.perf_counter() - started:.0f} s")
    return 0
