"""Benchmark the rollout modes on a long-tailed length task: sync, overlap and async on CPU.

The scratchpad demo task (``zcpo demo --task scratchpad``: responses of 6 to 45 tokens, half worked
out step by step, half answered at once) through ``zcpo demo --compare`` with the arms ``zcpo``,
``zcpo-overlap`` and ``zcpo-async`` (the same seeds, warmed-up model, held-out set and budget), one
run at a time (``--jobs 1``) so no run shares the CPU with another. Per arm, over seeds:

- wall time per trained token: the seconds of the steps (``time/step``) over the response tokens they
  trained (``rollout/samples`` x ``rollout/response_length_mean``), leaving out the first two steps and
  the two after each evaluation: an asynchronous producer keeps generating while the run evaluates
  (at most k + 1 steps' worth), which would flatter the steps that follow;
- held-out avg@4 at equal trained tokens: every run's evaluations (every ``--eval-every`` steps)
  placed at the response tokens trained before them, read by linear interpolation at the largest
  token count every run of every arm reached;
- its start and end accuracy, staleness (mean, max), the share of responses continued across a push
  and the groups dropped as too stale.

    python benchmarks/bench_async.py --seeds 3 --steps 40 --out runs/bench_async
    python benchmarks/bench_async.py --analyze runs/bench_async   # the table again, from the runs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

ARMS = ("zcpo", "zcpo-overlap", "zcpo-async")


def trained_tokens_by_step(run_dir: Path) -> Dict[int, float]:
    """{step: response tokens trained up to and including it} (step 0: 0)."""
    from megatron_zcpo.recipe.metrics_log import read_metrics

    total, out = 0.0, {0: 0.0}
    for record in read_metrics(run_dir):
        if "rollout/reward_mean" in record:
            total += record["rollout/samples"] * record["rollout/response_length_mean"]
            out[int(record["step"])] = total
    return out


def run_numbers(run_dir: Path) -> dict:
    """One run's step seconds, trained tokens, evaluations (tokens, avg@k) and asynchrony metrics."""
    from megatron_zcpo.cli.demo_stats import per_problem_accuracy
    from megatron_zcpo.recipe.metrics_log import read_metrics

    steps = [r for r in read_metrics(run_dir) if "rollout/reward_mean" in r]
    tokens = trained_tokens_by_step(run_dir)
    evaluations, evaluated = [], set()
    for file in sorted(run_dir.glob("eval/step_*.json")):
        accuracy = list(per_problem_accuracy(json.loads(file.read_text())).values())
        evaluated.add(int(file.stem.split("_")[1]))
        evaluations.append((tokens[int(file.stem.split("_")[1])], sum(accuracy) / len(accuracy)))
    # the steps timed: not the two after an evaluation (step 0's included), whose data the producer banked
    timed = [r for r in steps if not {int(r["step"]) - 1, int(r["step"]) - 2} & evaluated]

    def mean(key: str) -> float:
        values = [r[key] for r in steps if key in r]
        return sum(values) / len(values) if values else math.nan

    return {
        "seconds": sum(r["time/step"] for r in timed),
        "timed_tokens": sum(r["rollout/samples"] * r["rollout/response_length_mean"] for r in timed),
        "tokens": tokens[max(tokens)],
        "evaluations": evaluations,
        "staleness_mean": mean("rollout/staleness_mean"),
        "staleness_max": max((r.get("rollout/staleness_max", 0.0) for r in steps), default=0.0),
        "partial_fraction": mean("rollout/partial_fraction"),
        "dropped_stale": steps[-1].get("async/dropped_stale_total", 0.0) if steps else 0.0,
    }


def accuracy_at(evaluations: List[tuple], tokens: float) -> float:
    """avg@k at ``tokens`` trained tokens, linear between the two evaluations around it."""
    for (t0, a0), (t1, a1) in zip(evaluations, evaluations[1:]):
        if t0 <= tokens <= t1:
            return a0 if t1 == t0 else a0 + (a1 - a0) * (tokens - t0) / (t1 - t0)
    raise ValueError(
        f"{tokens} trained tokens is outside the evaluated range {evaluations[0][0]}..{evaluations[-1][0]}"
    )


def table(out: Path) -> str:
    """The markdown table of the runs under ``out`` (``<out>/<arm>/seed_<n>``)."""
    from megatron_zcpo.cli.demo_stats import mean_and_se

    runs = {arm: [run_numbers(d) for d in sorted((out / arm).glob("seed_*")) if d.is_dir()] for arm in ARMS}
    budget = min(r["tokens"] for numbers in runs.values() for r in numbers)
    lines = [
        f"held-out avg@4 at {budget:,.0f} trained response tokens (the least any run reached); mean ± SE over seeds",
        "",
        "| mode | seeds | ms per trained token | vs sync | avg@4 before | avg@4 at equal tokens | avg@4 after | "
        "staleness mean / max | responses continued across a push | groups dropped as stale |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    sync_ms = None
    for arm, numbers in runs.items():
        ms, ms_se = mean_and_se([1e3 * r["seconds"] / r["timed_tokens"] for r in numbers])
        sync_ms = sync_ms or ms
        at, at_se = mean_and_se([accuracy_at(r["evaluations"], budget) for r in numbers])
        before = mean_and_se([r["evaluations"][0][1] for r in numbers])
        after = mean_and_se([r["evaluations"][-1][1] for r in numbers])
        staleness = (
            f"{sum(r['staleness_mean'] for r in numbers) / len(numbers):.2f} / "
            f"{max(r['staleness_max'] for r in numbers):.0f}"
            if arm != "zcpo"
            else "0 / 0"
        )
        partial = [r["partial_fraction"] for r in numbers if not math.isnan(r["partial_fraction"])]
        lines.append(
            f"| {arm} | {len(numbers)} | {ms:.2f} ± {ms_se:.2f} | {sync_ms / ms:.2f}x | {before[0]:.3f} ± {before[1]:.3f} "
            f"| {at:.3f} ± {at_se:.3f} | {after[0]:.3f} ± {after[1]:.3f} | {staleness} | "
            f"{sum(partial) / len(partial) if partial else 0.0:.3f} | {sum(r['dropped_stale'] for r in numbers):.0f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", default="runs/bench_async")
    parser.add_argument("--analyze", default=None, help="print the table of the runs in this directory and stop")
    args = parser.parse_args(argv)
    if args.analyze:
        print(table(Path(args.analyze)))
        return 0
    arms = ",".join(f"{arm}:eval.every={args.eval_every}" for arm in ARMS)
    command = [
        sys.executable,
        "-m",
        "megatron_zcpo.cli.main",
        "demo",
        "--task",
        "scratchpad",
        "--compare",
        "--no-diagnostics",
        "--arms",
        arms,
        "--seeds",
        str(args.seeds),
        "--jobs",
        "1",
        "--steps",
        str(args.steps),
        "--out",
        args.out,
        "--reuse",
    ]
    subprocess.run(command, check=True, env=dict(os.environ))
    out = Path(args.out)
    for arm in ARMS:  # the compare folders carry the overrides in their names
        (out / arm).mkdir(exist_ok=True)
        for seed_dir in (out / f"{arm}+eval.every={args.eval_every}").glob("seed_*"):
            link = out / arm / seed_dir.name
            if not link.exists():
                link.symlink_to(seed_dir.resolve())
    print(table(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
