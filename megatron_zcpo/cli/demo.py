"""``zcpo demo``: the embedded default on a CPU, end to end, with before/after held-out accuracy.

Builds (once, cached per task) a tiny Qwen2 and its BPE tokenizer, partly warmed up on the task,
then runs ``zcpo train`` on it through the same Megatron trainer as a cluster run (TP=2 over
gloo, embedded rollout engine). The summary is the held-out gain paired per problem, with its
standard error and a verdict; ``--seed`` picks the RL run's randomness, ``--seeds N`` runs the demo
over N seeds and prints one table (every seed's gain, its standard error and its lowest point),
``--task`` the task (TASKS). ``--compare`` runs the arms of ``--arms`` (names from
:data:`megatron_zcpo.cli.demo_arms.ARMS`, each with optional ``:key=value`` overrides; default
DAPO without KL, DAPO + k3 KL and ZCPO) with the same seeds, budget, held-out set and warmed-up
model over ``--seeds`` seeds, ``--jobs`` runs at once (default: 2 runs at TP=1, which keeps 2 cores
busy at half the CPU time of TP=2; benchmarks/RESULTS.md), and reports each arm's mean and standard
error over seeds and the differences paired by seed against the first arm.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import yaml

from megatron_zcpo.cli.demo_arms import DEFAULT_ARMS, LORA_ARM, Arm, describe_arms, merge, parse_arm, parse_arms
from megatron_zcpo.recipe.demo_assets import DemoSpec

DEMO_CONFIG = Path(__file__).with_name("demo.yaml")
DEFAULT_SEED = 1
DEFAULT_TASK = "addition"
# The F1-F7 diagnostics the demo measures when they are on (--diagnostics): every family, every 10
# steps (the first, at the sampling snapshot = reference, is left out of the summaries); they add
# about a tenth to a run's time.
DIAGNOSTICS = {"enabled": True, "every": 10}


@dataclass(frozen=True)
class DemoTask:
    """A demo task: the warmed-up model's recipe (``spec``), its changes to demo.yaml, whether the
    F1-F7 diagnostics are on by default, and a line saying what it is."""

    spec: DemoSpec
    changes: dict
    diagnostics: bool
    about: str


TASKS: Dict[str, DemoTask] = {
    "addition": DemoTask(DemoSpec(), {}, False, "two-digit addition, the boxed answer alone (~7-token responses)"),
    # Chains of 3-5 one-digit terms joined by + and -: the warm-up works a random half of its
    # responses out step by step ("4-1=3\n3-7=-4\n\\boxed{-4}", 15-45 tokens) and answers the other
    # half at once (~6 tokens), so a response's length follows the style the policy picks, and RL
    # can move it (the worked style is the more accurate one).
    "scratchpad": DemoTask(
        DemoSpec(
            task_options=(
                ("min_terms", 3),
                ("max_terms", 5),
                ("min_digits", 1),
                ("max_digits", 1),
                ("operators", ("+", "-")),
                ("allow_parentheses", False),
                ("allow_negation", False),
            ),
            worked_fraction=0.5,
            max_response_tokens=48,
            size=20000,
            sft_max_steps=3000,
        ),
        # [ours] lr 1e-4: at the addition task's 5e-4, DAPO's held-out accuracy fell on this task (0.150 ->
        # 0.068 on seed 1; 2.5e-4: 0.226, 1e-4: 0.300); benchmarks/RESULTS.md, the scratchpad task.
        {"rollout": {"max_new_tokens": 48}, "train": {"optimizer": {"lr": 1.0e-4}}},
        True,
        "chains of 3-5 one-digit +/- terms, a worked scratchpad or the answer alone (6-45-token responses)",
    ),
    # Two-digit products: the tiny model cannot multiply in its head, but the calculator tool can. The
    # warm-up calls the tool in a tool_fraction share of its responses and answers at once in
    # the rest; RL rewards the trajectories that used it (multi-turn rollouts, tool turns masked out).
    "calculator": DemoTask(
        DemoSpec(
            task_options=(
                ("min_terms", 2),
                ("max_terms", 2),
                ("min_digits", 2),
                ("max_digits", 2),
                ("operators", ("*",)),
                ("allow_parentheses", False),
                ("allow_negation", False),
            ),
            tool_fraction=0.3,
            max_response_tokens=16,
            sft_max_steps=300,
            sft_eval_every=10**9,  # no single-turn greedy check: the held-out evaluation before RL measures it
        ),
        {
            "rollout": {"max_new_tokens": 16},
            "data": {"max_prompt_length": 48},
            "tools": {
                "enabled": True,
                "max_turns": 2,
                "max_total_tokens": 112,
                "call_format": "plain",
                "registry": {"calculator": {"kind": "calculator"}},
            },
        },
        False,
        "two-digit products with a calculator tool (multi-turn: call, the tool's turn, the boxed answer)",
    ),
}


def demo_config(
    assets: Path, run_dir: Path, changes: dict, steps: int = 0, task: str = DEFAULT_TASK, diagnostics: bool = False
) -> dict:
    """The demo's run config for ``task`` with ``assets`` (the cached model directory), as a plain dict:
    demo.yaml, the task's changes, the paths, ``steps`` (0: the config's), the F1-F7 diagnostics
    when ``diagnostics``, then ``changes``."""
    config = merge(yaml.safe_load(DEMO_CONFIG.read_text()), TASKS[task].changes)
    config["model"]["path"] = str(assets)
    config["data"]["train_files"] = [str(assets / "train.jsonl")]
    config["eval"]["data"]["train_files"] = [str(assets / "eval.jsonl")]
    config["logging"]["run_dir"] = str(run_dir)
    config["checkpoint"]["resume"] = "never"
    if steps:
        config["train"]["steps"] = steps
    if diagnostics:
        config = merge(config, {"diagnostics": DIAGNOSTICS})
    return merge(config, changes)


def seed_changes(seed: int) -> dict:
    """The config changes of demo seed ``seed``: the RL run's randomness (prompt order, rollout and
    evaluation sampling, trainer RNG); the warmed-up model and the held-out problems stay the same."""
    return {"train": {"seed": seed}, "rollout": {"seed": seed}, "data": {"seed": seed}, "eval": {"seed": 10_000 + seed}}


def run_summary(run_dir: Path) -> dict:
    """A run's held-out gain (:func:`megatron_zcpo.cli.demo_stats.run_gain`) with its training reward,
    KL to the reference and response length (means over the last quarter of the steps), its step
    count, and ``diagnostics``: each F1-F7 metric's mean over the run's diagnostic steps but the
    first (taken at the reference itself), NaNs skipped; {} when the run measured none."""
    from megatron_zcpo.cli.demo_stats import run_gain
    from megatron_zcpo.recipe.metrics_log import read_metrics

    records = read_metrics(run_dir)
    train = [r for r in records if "rollout/reward_mean" in r]
    tail = train[-max(1, len(train) // 4) :]

    def mean(rows: Sequence[dict], key: str) -> float:
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
        return sum(values) / len(values) if values else math.nan

    evaluations = [json.loads(f.read_text()) for f in sorted(Path(run_dir).glob("eval/step_*.json"))]
    tools = {}
    if evaluations and "tool_call_fraction" in evaluations[0]:  # multi-turn tasks: tool use before and after
        tools = {
            "tool_call_fraction_before": evaluations[0]["tool_call_fraction"],
            "tool_call_fraction_after": evaluations[-1]["tool_call_fraction"],
        }
    measured = [r for r in records if any(key.startswith("diag/") for key in r)][1:]
    names = sorted({key for r in measured for key in r if key.startswith("diag/")})
    return {
        **run_gain(run_dir),
        "reward": mean(tail, "rollout/reward_mean"),
        "kl": mean(tail, "experience/kl"),
        "length": mean(tail, "rollout/response_length_mean"),
        "steps": int(train[-1]["step"]) if train else 0,
        **tools,
        "diagnostics": {name[len("diag/") :]: mean(measured, name) for name in names},
    }


def print_run_summary(name: str, seed: int, summary: dict, console) -> None:
    """Before, after, the paired gain with its standard error, and a plain verdict."""
    from rich.table import Table

    from megatron_zcpo.cli.demo_stats import verdict

    table = Table(title=f"{name}, seed {seed}: held-out accuracy on {summary['problems']} problems never trained on")
    columns = ["before", "after", "gain", "SE (paired)", "gain / SE", "reward", "KL to ref", "length", "steps"]
    row = [
        f"{summary['before']:.3f}",
        f"{summary['after']:.3f}",
        f"{summary['gain']:+.3f}",
        f"{summary['se']:.3f}",
        f"{summary['z']:.1f}",
        f"{summary['reward']:.3f}",
        f"{summary['kl']:.2e}",
        f"{summary['length']:.1f}",
        str(summary["steps"]),
    ]
    if "tool_call_fraction_before" in summary:  # multi-turn tasks: the held-out share of responses calling a tool
        columns += ["tool calls before", "after"]
        row += [f"{summary['tool_call_fraction_before']:.3f}", f"{summary['tool_call_fraction_after']:.3f}"]
    for column in columns:
        table.add_column(column, justify="right")
    table.add_row(*row)
    console.print(table)
    console.print(verdict(summary["gain"], summary["se"]))


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
        axes.errorbar(
            steps,
            [m for m, _ in stats],
            yerr=[0.0 if math.isnan(e) else e for _, e in stats],
            marker="o",
            capsize=3,
            label=label,
        )
    axes.set_xlabel("training step")
    axes.set_ylabel(f"held-out avg@{k}")
    axes.set_title("held-out accuracy (error bars: one standard error)", fontsize=10)
    axes.legend(fontsize=8)
    figure.savefig(path, dpi=110)
    return path


def add_parser(subparsers) -> None:
    """Register ``zcpo demo`` and its flags."""
    parser = subparsers.add_parser(
        "demo",
        help="run the embedded default (tiny model, CPU) end to end",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--task",
        choices=sorted(TASKS),
        default=DEFAULT_TASK,
        help="; ".join(f"{name}: {task.about}" for name, task in TASKS.items()) + f" (default {DEFAULT_TASK})",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="run the arms of --arms with the same seeds, budget and held-out set, side by side",
    )
    parser.add_argument(
        "--arms",
        default=None,
        help=f"--compare: comma-separated arms, each a name (dapo, dapo-k3, zcpo, zcpo-beta0, "
        f"zcpo-std, ...) optionally followed by :key=value overrides, e.g. "
        f"zcpo:algorithm.beta=1; the first is the baseline (default {DEFAULT_ARMS})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help=f"seed of the RL run (default {DEFAULT_SEED}); with --seeds, the first seed",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="seeds --seed, --seed+1, ...: with --compare per arm (default 3); without, "
        "the demo over that many seeds with one table (default 1: a single run)",
    )
    parser.add_argument(
        "--jobs", type=int, default=None, help="training runs at once (default: 2 with --compare, else 1)"
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes per run, its tensor-parallel size (default: 1 with --compare, else 2: TP=2 over gloo)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="--compare: keep a run whose folder under --out holds the same finished run "
        "(same config) instead of training it again",
    )
    parser.add_argument(
        "--diagnostics",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the F1-F7 diagnostics every 10 steps (default: on for the scratchpad task, off for addition)",
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help=f"train LoRA adapters on the frozen warmed-up model instead of every weight (the {LORA_ARM} arm; "
        "with --compare give the arms instead)",
    )
    parser.add_argument("--out", default="runs/demo", help="output directory (default: runs/demo)")
    parser.add_argument("--steps", type=int, default=0, help="training steps (default: the demo config's)")
    parser.set_defaults(func=run)


def _settings(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the mode's defaults filled in: seeds, jobs and nproc (see add_parser)."""
    compare = args.compare
    return argparse.Namespace(
        **{
            **vars(args),
            "seeds": args.seeds or (3 if compare else 1),
            "jobs": args.jobs or (2 if compare else 1),
            "nproc": args.nproc or (1 if compare else 2),
        }
    )


def demo_jobs(args: argparse.Namespace, assets: Path, arms: Sequence[Arm], seeds: Sequence[int]) -> List[tuple]:
    """(arm, seed, TrainingJob) for every arm and seed, seed-major (an interrupted comparison still
    has whole seeds), each job's config validated; ConfigError naming the arm and the key for a bad one."""
    from megatron_zcpo.cli.demo_jobs import TrainingJob
    from megatron_zcpo.recipe.config import build_run_config
    from megatron_zcpo.utils.config_loader import ConfigError

    out = Path(args.out)
    diagnostics = TASKS[args.task].diagnostics if args.diagnostics is None else args.diagnostics
    jobs = []
    for seed in seeds:
        for arm in arms:
            run_dir = out / arm.directory / f"seed_{seed}" if len(seeds) > 1 or args.compare else out / arm.directory
            base = demo_config(
                assets,
                run_dir,
                merge(seed_changes(seed), {"parallel": {"tensor": args.nproc}}),
                args.steps,
                args.task,
                diagnostics,
            )
            config = arm.config(base)
            try:
                build_run_config(copy.deepcopy(config))  # fail here, with the arm and key named, not in the workers
            except ConfigError as error:
                raise ConfigError(f"arm {arm.label!r}: {error}") from None
            name = f"{arm.label}, seed {seed}" if len(seeds) > 1 or args.compare else arm.label
            jobs.append((arm, seed, TrainingJob(name, run_dir, config)))
    return jobs


def run(args: argparse.Namespace) -> int:
    """``zcpo demo``: one seeded ZCPO run with its paired summary, a sweep over ``--seeds``, or
    ``--compare`` over arms and seeds; exit code."""
    from megatron_zcpo.cli.demo_jobs import DONE_FILE, run_jobs
    from megatron_zcpo.cli.report import write_report
    from megatron_zcpo.recipe.demo_assets import build_demo_assets
    from megatron_zcpo.recipe.metrics_log import make_console
    from megatron_zcpo.utils.config_loader import ConfigError

    args = _settings(args)
    if not args.compare and args.arms is not None:
        raise ConfigError("--arms chooses the arms of a comparison: give it with --compare")
    if args.compare and args.lora:
        raise ConfigError(f"--lora with --compare: name the LoRA arm in --arms (e.g. --arms zcpo,{LORA_ARM})")
    arms = parse_arms(args.arms or DEFAULT_ARMS) if args.compare else [parse_arm(LORA_ARM if args.lora else "zcpo")]
    seeds = list(range(args.seed, args.seed + args.seeds))
    # Every config checked before the warm-up is built (an existing folder stands in for the assets).
    demo_jobs(args, DEMO_CONFIG.parent, arms, seeds)
    console = make_console()
    started = time.perf_counter()
    assets = build_demo_assets(TASKS[args.task].spec, log=console.print)
    out = Path(args.out)
    planned = demo_jobs(args, assets, arms, seeds)
    arm_and_seed = {job.name: (arm, seed) for arm, seed, job in planned}
    summaries: Dict[str, dict] = {}
    sweep = not args.compare and len(seeds) > 1

    def summarise(job) -> None:  # as each run finishes: its summary.json beside its metrics
        arm, seed = arm_and_seed[job.name]
        summaries[job.name] = {"arm": arm.label, "seed": seed, **run_summary(job.run_dir)}
        (job.run_dir / DONE_FILE).write_text(json.dumps(summaries[job.name], indent=2))
        if sweep:  # rewritten after every seed: an interrupted sweep keeps its rows
            from megatron_zcpo.cli.demo_stats import sweep_markdown

            rows, summary = sweep_rows(planned, summaries)
            console.print(
                f"seed {seed}: {rows[-1]['before']:.3f} -> {rows[-1]['after']:.3f} "
                f"({rows[-1]['z']:+.1f} SE) in {job.wall_s:.0f} s"
            )
            (out / "sweep.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=2))
            (out / "sweep.md").write_text(sweep_markdown(rows, summary) + "\n")

    if args.compare:
        console.print("arms:\n" + "\n".join(f"  {line}" for line in describe_arms(arms)))
    jobs = [job for _, _, job in planned]
    code = run_jobs(jobs, at_once=args.jobs, reuse=args.compare and args.reuse, on_done=summarise, log=console.print)
    if code:
        return code
    by_arm = {arm.label: [job for a, _, job in planned if a == arm] for arm in arms}
    plot = write_accuracy_plot(
        {label: [job.run_dir for job in arm_jobs] for label, arm_jobs in by_arm.items()},
        int(jobs[0].config["eval"]["k"]),
        out / "heldout_accuracy.png",
    )
    write_report(
        [job.run_dir for job in jobs],
        out,
        names=[job.name for job in jobs],
        methods=[arm.label for arm, _, _ in planned],
    )
    if args.compare:
        from megatron_zcpo.cli.demo_stats import compare_methods
        from megatron_zcpo.cli.demo_tables import comparison_markdown, print_comparison, seed_metrics

        per_seed = {
            label: [seed_metrics(summaries[job.name]) for job in arm_jobs] for label, arm_jobs in by_arm.items()
        }
        shared = set.intersection(*(set(values) for arm_seeds in per_seed.values() for values in arm_seeds))
        keys = [key for key in ("before", "after", "gain", "reward", "kl", "length") if key in shared] + sorted(
            key for key in shared if key.startswith("diag/")
        )
        rows, differences = compare_methods(per_seed, keys, baseline=arms[0].label)
        print_comparison(rows, differences, console)
        (out / "comparison.md").write_text(comparison_markdown(rows, differences) + "\n")
        (out / "summary.json").write_text(
            json.dumps(
                {
                    "task": args.task,
                    "seeds": seeds,
                    "arms": describe_arms(arms),
                    "jobs": args.jobs,
                    "nproc": args.nproc,
                    "wall_s": time.perf_counter() - started,
                    "per_seed": per_seed,
                    "methods": rows,
                    "differences": differences,
                },
                indent=2,
            )
        )
        written = out / "summary.json"
    elif sweep:
        from megatron_zcpo.cli.demo_stats import print_sweep

        print_sweep(*sweep_rows(planned, summaries), console)
        written = out / "sweep.md"
    else:
        summary = summaries[jobs[0].name]
        print_run_summary(arms[0].label, args.seed, summary, console)
        (out / "summary.json").write_text(json.dumps({"seed": args.seed, "task": args.task, **summary}, indent=2))
        written = out / "summary.json"
    console.print(
        f"plots: {plot}, {out / 'report.html'}; summary: {written}"
        + (f", {out / 'comparison.md'}" if args.compare else "")
        + "; "
        f"took {time.perf_counter() - started:.0f} s"
    )
    return 0


def sweep_rows(planned: Sequence[tuple], summaries: Dict[str, dict]) -> Tuple[List[dict], dict]:
    """:func:`megatron_zcpo.cli.demo_stats.seed_sweep_rows` of the finished runs of a sweep."""
    from megatron_zcpo.cli.demo_stats import seed_sweep_rows

    done = [(seed, job) for _, seed, job in planned if job.name in summaries]
    return seed_sweep_rows({seed: job.run_dir for seed, job in done}, {seed: job.wall_s for seed, job in done})
