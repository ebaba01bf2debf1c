"""The demo's statistics: paired held-out gains with standard errors, and the method comparison over seeds."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Mapping, Sequence, Tuple

# A gain counts as shown when it is at least this many standard errors above zero.
Z_SHOWN = 3.0


def mean_and_se(values: Sequence[float]) -> Tuple[float, float]:
    """(mean, standard error of the mean) of ``values`` ([n] numbers; SE = sample std / sqrt(n),
    NaN for n < 2). Raises ValueError on an empty sequence."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_and_se needs at least one value")
    mean = math.fsum(values) / n
    if n < 2:
        return mean, math.nan
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(variance / n)


def per_problem_accuracy(eval_result: Mapping) -> Dict[str, float]:
    """{problem uid: share of its samples that were correct} from one evaluation's JSON
    (``megatron_zcpo.rollout.evaluation.evaluate``'s result, which lists ``problems``)."""
    problems = eval_result.get("problems")
    if not problems:
        raise ValueError("the evaluation result has no per-problem list ('problems')")
    return {p["uid"]: p["num_correct"] / p["num_samples"] for p in problems}


def paired_gain(before: Mapping[str, float], after: Mapping[str, float]) -> Dict[str, float]:
    """The held-out gain of one run, paired per problem.

    before, after: {problem uid: accuracy} of the same problems at the first and last evaluation.
    Returns {"before", "after": mean accuracies; "gain": mean of the per-problem differences
    after - before; "se": its standard error (std of the differences / sqrt(problems));
    "z": gain / se; "problems": how many}. Pairing removes the problems' own difficulty from
    the noise, so the SE is that of the change, not of two independent means.
    """
    if set(before) != set(after):
        raise ValueError(
            f"before and after must cover the same problems ({len(before)} vs {len(after)}, "
            f"{len(set(before) ^ set(after))} differ)"
        )
    uids = sorted(before)
    gain, se = mean_and_se([after[u] - before[u] for u in uids])
    return {
        "before": math.fsum(before[u] for u in uids) / len(uids),
        "after": math.fsum(after[u] for u in uids) / len(uids),
        "gain": gain,
        "se": se,
        "z": gain / se if se > 0 else (math.inf if gain > 0 else (-math.inf if gain < 0 else math.nan)),
        "problems": len(uids),
    }


def verdict(gain: float, se: float, z: float = Z_SHOWN) -> str:
    """A plain sentence on whether ``gain`` (with standard error ``se``) shows learning."""
    if gain >= z * se and gain > 0:
        return f"held-out accuracy rose by {gain:+.3f} ({gain / se if se > 0 else math.inf:.1f} standard errors): learning shown"
    if gain > 0:
        return f"held-out accuracy rose by {gain:+.3f}, less than {z:g} standard errors ({se:.3f}): not conclusive"
    return f"held-out accuracy did not rise ({gain:+.3f}, standard error {se:.3f})"


def run_gain(run_dir: Path) -> Dict[str, float]:
    """:func:`paired_gain` between a run's first and last evaluation (``<run_dir>/eval/step_*.json``)."""
    files = sorted(Path(run_dir).glob("eval/step_*.json"))
    if len(files) < 2:
        raise ValueError(f"{run_dir} has {len(files)} evaluation(s); a gain needs the first and the last")
    first, last = (per_problem_accuracy(json.loads(f.read_text())) for f in (files[0], files[-1]))
    return paired_gain(first, last)


def compare_methods(
    per_seed: Mapping[str, Sequence[Mapping[str, float]]], keys: Sequence[str], baseline: str
) -> Tuple[List[dict], List[dict]]:
    """Summaries of a method comparison run with the same seeds.

    per_seed: {method: [one dict of metrics per seed]}, seeds in the same order for every method.
    keys: the metrics to summarise (e.g. "after", "gain", "reward", "kl").
    Returns (rows, differences): rows = one per method with "<key>" and "<key>_se" (mean and
    standard error over seeds) and "seeds"; differences = one per other method and key, the
    per-seed paired difference method - ``baseline`` as "diff" and "se" (pairing by seed removes
    what the seeds share: the same prompts, sampling seeds and held-out problems).
    """
    counts = {method: len(values) for method, values in per_seed.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"every method needs the same seeds, got {counts}")
    if baseline not in per_seed:
        raise ValueError(f"baseline {baseline!r} is not one of the methods {sorted(per_seed)}")
    rows = []
    for method, values in per_seed.items():
        row = {"method": method, "seeds": len(values)}
        for key in keys:
            row[key], row[f"{key}_se"] = mean_and_se([v[key] for v in values])
        rows.append(row)
    differences = []
    for method, values in per_seed.items():
        if method == baseline:
            continue
        for key in keys:
            diff, se = mean_and_se([a[key] - b[key] for a, b in zip(values, per_seed[baseline])])
            differences.append({"method": method, "baseline": baseline, "key": key, "diff": diff, "se": se})
    return rows, differences


def run_trajectory(run_dir: Path) -> Dict[str, object]:
    """A run's held-out accuracy at every evaluation, each paired per problem against the first.

    Returns {"steps": [the evaluated steps], "points": [:func:`paired_gain` of each evaluation
    against the first, same order], "lowest": the point after the first with the smallest gain
    (the first itself when the run has one evaluation)}. The claim "no evaluation falls below the
    start" is ``lowest["gain"] >= 0``; ``lowest["z"]`` says how far it is from noise.
    """
    files = sorted(Path(run_dir).glob("eval/step_*.json"))
    if not files:
        raise ValueError(f"{run_dir} has no evaluation (eval/step_*.json)")
    accuracies = [per_problem_accuracy(json.loads(f.read_text())) for f in files]
    points = [paired_gain(accuracies[0], accuracy) for accuracy in accuracies]
    later = points[1:] or points
    return {
        "steps": [int(f.stem.split("_")[1]) for f in files],
        "points": points,
        "lowest": min(later, key=lambda point: point["gain"]),
    }


def seed_sweep_rows(runs: Mapping[int, Path], wall_s: Mapping[int, float]) -> Tuple[List[dict], dict]:
    """The per-seed table of a sweep of one recipe over seeds, and its summary.

    runs: {seed: run directory}; wall_s: {seed: the run's wall time in seconds (NaN if unknown)}.
    Returns (rows, summary): one row per seed with "seed", "before", "after", "gain", "se", "z"
    (first vs last evaluation, :func:`paired_gain`), "lowest" and "lowest_z" (the smallest gain of
    any later evaluation against the first, :func:`run_trajectory`) and "wall_s"; the summary has
    "seeds", "min_z", the mean gain and its SE over seeds ("gain", "gain_se"), "shown" (seeds
    with z >= Z_SHOWN), "never_below_start" (seeds whose every evaluation is >= the first) and
    "ok" (every seed both).
    """
    if not runs:
        raise ValueError("a sweep needs at least one run")
    rows = []
    for seed in sorted(runs):
        trajectory = run_trajectory(runs[seed])
        last, lowest = trajectory["points"][-1], trajectory["lowest"]
        rows.append(
            {
                "seed": seed,
                **{k: last[k] for k in ("before", "after", "gain", "se", "z")},
                "lowest": lowest["gain"],
                "lowest_z": lowest["z"],
                "eval_steps": trajectory["steps"],
                "wall_s": float(wall_s.get(seed, math.nan)),
            }
        )
    gain, gain_se = mean_and_se([row["gain"] for row in rows])
    shown = sum(row["z"] >= Z_SHOWN for row in rows)
    never_below = sum(row["lowest"] >= 0 for row in rows)
    summary = {
        "seeds": len(rows),
        "min_z": min(row["z"] for row in rows),
        "gain": gain,
        "gain_se": gain_se,
        "shown": shown,
        "never_below_start": never_below,
        "ok": shown == never_below == len(rows),
    }
    return rows, summary


def sweep_markdown(rows: Sequence[Mapping], summary: Mapping) -> str:
    """:func:`seed_sweep_rows`'s table as Markdown (the layout of benchmarks/RESULTS.md)."""
    lines = [
        "| seed | held-out before | after | gain | SE (paired) | z = gain / SE | lowest later point - start (z) | wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['seed']} | {row['before']:.3f} | {row['after']:.3f} | {row['gain']:+.3f} | {row['se']:.3f} "
            f"| {row['z']:.1f} | {row['lowest']:+.3f} ({row['lowest_z']:+.1f}) | {row['wall_s']:.0f} s |"
        )
    lines.append(
        f"\n{summary['seeds']} seeds: min z {summary['min_z']:.1f}; mean gain {summary['gain']:+.3f} "
        f"(SE over seeds {summary['gain_se']:.3f}); {summary['shown']} gain >= {Z_SHOWN:g} SE; "
        f"{summary['never_below_start']} never below their start at any evaluation"
    )
    return "\n".join(lines)


def print_sweep(rows: Sequence[Mapping], summary: Mapping, console) -> None:
    """:func:`seed_sweep_rows`'s table on a rich ``console``, then one line of verdict."""
    from rich.table import Table

    table = Table(
        title=f"the demo over {summary['seeds']} seeds: held-out accuracy, first vs last evaluation "
        "(paired per problem)"
    )
    for column in ("seed", "before", "after", "gain", "SE", "z", "lowest later - start (z)", "wall"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            str(row["seed"]),
            f"{row['before']:.3f}",
            f"{row['after']:.3f}",
            f"{row['gain']:+.3f}",
            f"{row['se']:.3f}",
            f"{row['z']:.1f}",
            f"{row['lowest']:+.3f} ({row['lowest_z']:+.1f})",
            f"{row['wall_s']:.0f} s",
        )
    console.print(table)
    console.print(
        f"min z {summary['min_z']:.1f}; mean gain {summary['gain']:+.3f} (SE over seeds "
        f"{summary['gain_se']:.3f}); {summary['shown']} of {summary['seeds']} seeds gain >= {Z_SHOWN:g} "
        f"SE, {summary['never_below_start']} of {summary['seeds']} never fall below their start: "
        + ("learning shown on every seed" if summary["ok"] else "[red]not shown on every seed")
    )
