"""``zcpo report RUN_DIR [RUN_DIR ...]``: a terminal summary and a PNG / HTML page of curves for one or several runs.

``--align-by gpu-hours`` compares runs at the same cumulative GPU time (the paper's protocol,
megatron_zcpo/diagnostics/compare.py); runs of one method (``--label``, else the algorithm in their
config.yaml) are also summarised as mean and standard error over their seeds.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_zcpo.cli.report_curves import matching_keys, write_curves
from megatron_zcpo.diagnostics.compare import (
    common_budget,
    cumulative_gpu_hours,
    group_by_method,
    mean_and_standard_error,
    value_at,
)

ALIGN_CHOICES = ("step", "gpu-hours")

# The summary table: (key pattern, which value is best: "max", "min" or None for the final value only).
SUMMARY = (
    ("rollout/reward_mean", "max"),
    ("rollout/accuracy", "max"),
    ("eval/avg@*", "max"),
    ("eval/pass@*", "max"),
    ("experience/kl", None),
    ("rollout/response_length_mean", None),
    ("coef/coef_abs_mean", None),
    ("coef/reward_flip_fraction", None),
    ("coef/drift_peak_mean", None),
    ("update/grad_norm", None),
    ("diag/*", "mean"),
)


@dataclass
class RunData:
    """One run directory's metrics: ``records`` are one dict per step (train, eval and diag keys merged).

    label: the algorithm from config.yaml; method: what groups seeds (``--label``, else label, else
    name); gpu_hours: cumulative GPU-hours per record, set when aligning by GPU time.
    """

    name: str
    directory: Path
    label: str
    records: List[Dict[str, float]]
    method: str = ""
    gpu_hours: Optional[List[float]] = None

    def keys(self) -> List[str]:
        """The metric names with at least one finite value."""
        return sorted(
            {
                key
                for record in self.records
                for key, value in record.items()
                if key not in ("step", "time") and math.isfinite(value)
            }
        )

    def positions(self) -> List[float]:
        """Each record's x: cumulative GPU-hours when set, else its step."""
        return self.gpu_hours if self.gpu_hours is not None else [r["step"] for r in self.records]

    def series(self, key: str, budget: float = math.inf) -> Tuple[List[float], List[float]]:
        """(positions, values) of ``key`` up to ``budget``, skipping records without a finite value."""
        pairs = [
            (x, r[key])
            for x, r in zip(self.positions(), self.records)
            if x <= budget and math.isfinite(r.get(key, math.nan))
        ]
        return [p[0] for p in pairs], [p[1] for p in pairs]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``zcpo report`` on the ``zcpo`` parser's subparsers."""
    parser = subparsers.add_parser(
        "report",
        help="summarise runs: a terminal table and a PNG / HTML page of curves",
        description="Summarise one or several run directories (metrics.jsonl + config.yaml): final and best "
        "values in a terminal table, and curves of reward, accuracy, KL, length, coefficient "
        "statistics and the F1-F7 diagnostics in report.png and report.html; several runs are "
        "drawn side by side in the same panels.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (logging.run_dir)")
    parser.add_argument(
        "--out",
        default=None,
        help="where report.png / report.html go (default: the run directory, or the runs' common parent)",
    )
    parser.add_argument("--no-plots", action="store_true", help="only print the table")
    parser.add_argument(
        "--align-by",
        choices=ALIGN_CHOICES,
        default="step",
        help="x-axis and comparison point: steps, or cumulative GPU-hours (time/step x GPUs; "
        "every run is read at the GPU time all of them reached)",
    )
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs a run holds, for --align-by gpu-hours (default: its logged time/world_size, "
        "the training ranks; give the whole job's count to include rollout nodes)",
    )
    parser.add_argument(
        "--label",
        action="append",
        default=None,
        metavar="METHOD",
        help="method name of each RUN_DIR, in order (runs of one method are seeds: mean and "
        "standard error); default: the algorithm in the run's config.yaml",
    )
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """``zcpo report``: returns the exit code (1 when no run directory holds metrics)."""
    from megatron_zcpo.recipe.metrics_log import make_console

    console = make_console()
    if args.label is not None and len(args.label) != len(args.run_dirs):
        print(
            f"zcpo report: --label given {len(args.label)} times for {len(args.run_dirs)} run directories",
            file=sys.stderr,
        )
        return 2
    runs = load_runs(args.run_dirs, methods=args.label)
    if not runs:
        print("zcpo report: none of the run directories holds metrics", file=sys.stderr)
        return 1
    try:
        budget = align(runs, args.align_by, args.gpus)
    except ValueError as error:
        print(f"zcpo report: {error}", file=sys.stderr)
        return 2
    console.print(summary_table(runs, summary_rows(runs, budget), _budget_text(runs, budget)))
    seeds = seed_rows(runs)
    if seeds:
        console.print(
            seed_table(seeds, _budget_text(runs, common_budget([r.positions()[-1] for r in runs])), _methods(runs))
        )
    if not args.no_plots:
        out = Path(args.out) if args.out else default_output_dir([r.directory for r in runs])
        png, page = _write_pages(runs, out, budget)
        console.print(f"wrote {png} and {page}")
    return 0


def align(runs: Sequence[RunData], align_by: str, gpus: Optional[int] = None) -> float:
    """Set the runs' x-axis for ``align_by`` ("step" or "gpu-hours"); returns the comparison budget.

    By steps the budget is unbounded (each run's own last value, as logged); by GPU-hours it is the
    cumulative GPU time every run reached (each run is read at its last record within it).
    ValueError naming the run when a step lacks the time metrics.
    """
    if align_by not in ALIGN_CHOICES:
        raise ValueError(f"--align-by {align_by!r}: choose one of {ALIGN_CHOICES}")
    if align_by == "step":
        return math.inf
    for r in runs:
        try:
            r.gpu_hours = cumulative_gpu_hours(r.records, gpus)
        except ValueError as error:
            raise ValueError(f"{r.name}: {error}") from None
    return common_budget([r.gpu_hours[-1] for r in runs])


def _budget_text(runs: Sequence[RunData], budget: float) -> str:
    if not math.isfinite(budget):
        return ""
    unit = "GPU-hours" if runs[0].gpu_hours is not None else "steps"
    return f"at {budget:.4g} {unit} (reached by every run)"


def write_report(
    run_dirs: Sequence, out, names: Optional[Sequence[str]] = None, methods: Optional[Sequence[str]] = None
) -> List[Path]:
    """report.png and report.html of ``run_dirs`` (side by side) in ``out``; returns their paths.

    names: the runs' labels (default: the directory names); methods: what groups them as seeds
    (default: their algorithm). [] when no run holds metrics. Used by ``zcpo demo``.
    """
    runs = load_runs(run_dirs, names, methods)
    return _write_pages(runs, Path(out)) if runs else []


def _write_pages(runs: Sequence[RunData], out: Path, budget: float = math.inf) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    png = write_curves(runs, out / "report.png")
    return [png, write_html(runs, summary_rows(runs, budget), png, out / "report.html", seed_rows(runs))]


# ------------------------------------------------------------------------------------------ loading


def load_runs(
    run_dirs: Sequence, names: Optional[Sequence[str]] = None, methods: Optional[Sequence[str]] = None
) -> List[RunData]:
    """The runs of ``run_dirs`` that hold metrics (the others are named on stderr and skipped).

    names / methods: per directory, its display name and its method (default: see RunData).
    """
    runs = []
    for position, directory in enumerate(run_dirs):
        loaded = load_run(directory, names[position] if names else None)
        if loaded is None:
            print(f"zcpo report: {directory}: no metrics.jsonl with records, skipped", file=sys.stderr)
        else:
            loaded.method = (methods[position] if methods else "") or loaded.label or loaded.name
            runs.append(loaded)
    return runs


def load_run(directory, name: Optional[str] = None) -> Optional[RunData]:
    """The metrics of ``directory`` as run ``name`` (default: the directory's name), None without records.

    Lines of the same step are merged (train, eval and diagnostics keys of one step), a later value
    of a key winning (a resumed run logs its steps again). Bad lines (a crashed writer's last) and
    non-numeric values are skipped.
    """
    directory = Path(directory)
    path = directory / "metrics.jsonl"
    if not path.is_file():
        return None
    by_step: Dict[int, Dict[str, float]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, TypeError, KeyError):
            continue
        numbers = {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        by_step.setdefault(step, {}).update(numbers, step=step)
    if not by_step:
        return None
    return RunData(
        name=name or directory.resolve().name,
        directory=directory,
        label=_algorithm_label(directory),
        records=[by_step[s] for s in sorted(by_step)],
    )


def _algorithm_label(directory: Path) -> str:
    """A short description of the run's algorithm from its config.yaml ('' when unreadable)."""
    import yaml

    from megatron_zcpo.algorithms.config import AlgorithmConfig

    try:
        section = (yaml.safe_load((directory / "config.yaml").read_text()) or {}).get("algorithm") or {}
        config = AlgorithmConfig.from_dict(section).resolved()
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        return ""
    parts = [config.name]
    if config.name == "zcpo":
        parts.append(f"beta={config.beta:g}")
        parts += [
            f"{key}={getattr(config, key)}"
            for key, default in (
                ("center", True),
                ("length_normalize", True),
                ("drift", "conditional_kl"),
                ("gate", True),
                ("reward_norm", "max_abs"),
            )
            if getattr(config, key) != default
        ]
    elif config.name in ("dapo", "grpo"):
        if config.kl_loss != "none":
            parts.append(f"{config.kl_loss} KL {config.kl_coef:g}")
        if config.f1_control != "none":
            parts.append(config.f1_control)
        if config.kl_in_reward_coef > 0:
            parts.append(f"k1 in reward {config.kl_in_reward_coef:g}")
    return " ".join(parts)


def default_output_dir(directories: Sequence[Path]) -> Path:
    """The run directory itself for one run, else the runs' common parent directory."""
    if len(directories) == 1:
        return Path(directories[0])
    return Path(os.path.commonpath([str(Path(d).resolve()) for d in directories]))


# ------------------------------------------------------------------------------------------ table


@dataclass
class SummaryRow:
    """One metric of the summary: per run the final value and, by the row's rule, its best or mean."""

    key: str
    rule: Optional[str]
    cells: List[Tuple[float, float, float]]  # per run: (final, best-or-mean, step of the best); NaN when absent


def _summary_keys(runs: Sequence[RunData]) -> List[Tuple[str, Optional[str]]]:
    """(key, rule) of every metric the summary shows, in SUMMARY's order (each key once)."""
    keys, seen = [], set()
    for pattern, rule in SUMMARY:
        for key in matching_keys(runs, pattern):
            if key not in seen:
                seen.add(key)
                keys.append((key, rule))
    return keys


def summary_rows(runs: Sequence[RunData], budget: float = math.inf) -> List[SummaryRow]:
    """The rows of the summary table, in SUMMARY's order; values up to ``budget`` (see :func:`align`)."""
    rows = []
    for key, rule in _summary_keys(runs):
        cells = []
        for r in runs:
            steps, values = r.series(key, budget)
            if not values:
                cells.append((math.nan, math.nan, math.nan))
            elif rule in ("max", "min"):
                best = (max if rule == "max" else min)(range(len(values)), key=values.__getitem__)
                cells.append((values[-1], values[best], r.records[_record_index(r, steps[best])]["step"]))
            elif rule == "mean":
                cells.append((values[-1], sum(values) / len(values), math.nan))
            else:
                cells.append((values[-1], math.nan, math.nan))
        rows.append(SummaryRow(key, rule, cells))
    return rows


def _record_index(run: RunData, position: float) -> int:
    return run.positions().index(position)


@dataclass
class SeedRow:
    """One metric over seeds: per method (mean, standard error, number of runs), read at the common budget."""

    key: str
    cells: List[Tuple[float, float, int]]


def seed_rows(runs: Sequence[RunData]) -> List[SeedRow]:
    """Mean and standard error per method of each summary metric, when some method has several runs.

    Each run contributes its last value at or before the budget every run reached (steps, or
    GPU-hours after :func:`align`): a matched checkpoint, never each run's best. [] when every
    method has one run.
    """
    groups = group_by_method([r.method for r in runs])
    if all(len(indices) < 2 for indices in groups.values()):
        return []
    budget = common_budget([r.positions()[-1] for r in runs])
    rows = []
    for key, _ in _summary_keys(runs):
        values = [value_at(*runs[i].series(key), budget)[0] for i in range(len(runs))]
        rows.append(
            SeedRow(key, [mean_and_standard_error([values[i] for i in indices]) for indices in groups.values()])
        )
    return rows


def _methods(runs: Sequence[RunData]) -> List[str]:
    return list(group_by_method([r.method for r in runs]))


def _seed_text(cell: Tuple[float, float, int]) -> str:
    mean, error, n = cell
    return f"{_format(mean)} ± {_format(error)} (n={n})" if n > 1 else f"{_format(mean)} (n={n})"


def seed_table(rows: Sequence[SeedRow], budget_text: str, methods: Sequence[str] = ()):
    """A rich Table: one column per method (mean ± standard error over its runs), one row per metric."""
    from rich.table import Table

    table = Table(title=f"mean ± standard error over seeds {budget_text}".rstrip(), title_justify="left")
    table.add_column("metric", style="bold")
    for method in methods:
        table.add_column(method, justify="right")
    for row in rows:
        table.add_row(row.key, *(_seed_text(cell) for cell in row.cells))
    return table


def _format(value: float) -> str:
    if not math.isfinite(value):
        return "-"
    return f"{value:.4g}" if value == 0 or 1e-3 <= abs(value) < 1e5 else f"{value:.3e}"


def _cell_text(row: SummaryRow, cell: Tuple[float, float, float]) -> Tuple[str, str]:
    """(final, note): the note says the best (with its step) or the mean, when the row has one."""
    final, other, step = cell
    if not math.isfinite(other):
        return _format(final), ""
    if row.rule == "mean":
        return _format(final), f"mean {_format(other)}"
    return _format(final), f"best {_format(other)} @{int(step)}"


def summary_table(runs: Sequence[RunData], rows: Sequence[SummaryRow], budget_text: str = ""):
    """A rich Table: one column per run (name, algorithm, steps), one row per metric."""
    from rich.table import Table

    table = Table(title=f"zcpo report: final values (best or mean) {budget_text}".rstrip(), title_justify="left")
    table.add_column("metric", style="bold")
    for r in runs:
        table.add_column(
            f"{r.name}\n{r.label}\n{len(r.records)} steps, last {int(r.records[-1]['step'])}", justify="right"
        )
    for row in rows:
        cells = []
        for cell in row.cells:
            final, note = _cell_text(row, cell)
            cells.append(f"{final} [dim]({note})[/dim]" if note else final)
        table.add_row(row.key, *cells)
    return table


# ------------------------------------------------------------------------------------------ curves and page


def write_html(
    runs: Sequence[RunData], rows: Sequence[SummaryRow], png: Path, path: Path, seeds: Sequence[SeedRow] = ()
) -> Path:
    """A self-contained page: the runs, the summary table, the seed table when any, the curves (PNG inlined)."""
    image = base64.b64encode(Path(png).read_bytes()).decode("ascii")
    head = "".join(
        f"<th>{html.escape(r.name)}<br><small>{html.escape(r.label)}<br>{len(r.records)} steps</small></th>"
        for r in runs
    )
    body = []
    for row in rows:
        cells = "".join(
            f"<td>{html.escape(final)}" + (f" <small>({html.escape(note)})</small>" if note else "") + "</td>"
            for final, note in (_cell_text(row, c) for c in row.cells)
        )
        body.append(f"<tr><th>{html.escape(row.key)}</th>{cells}</tr>")
    directories = "".join(
        f"<li>{html.escape(r.name)} ({html.escape(r.method)}): {html.escape(str(r.directory))}</li>" for r in runs
    )
    seed_html = ""
    if seeds:
        methods = "".join(f"<th>{html.escape(m)}</th>" for m in _methods(runs))
        seed_body = "".join(
            f"<tr><th>{html.escape(row.key)}</th>"
            + "".join(f"<td>{html.escape(_seed_text(c))}</td>" for c in row.cells)
            + "</tr>"
            for row in seeds
        )
        seed_html = (
            f"<h2>Mean ± standard error over seeds</h2><table><thead><tr><th>metric</th>{methods}</tr>"
            f"</thead><tbody>{seed_body}</tbody></table>"
        )
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>zcpo report: {html.escape(", ".join(r.name for r in runs))}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}} tbody th{{text-align:left}}
small{{color:#666}} img{{max-width:100%}}</style></head>
<body><h1>zcpo report</h1><ul>{directories}</ul>
<h2>Final values <small>(best with its step, or mean over the diagnosed steps)</small></h2>
<table><thead><tr><th>metric</th>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>
{seed_html}<h2>Curves</h2><img src="data:image/png;base64,{image}" alt="curves"></body></html>
"""
    path.write_text(page)
    return path
