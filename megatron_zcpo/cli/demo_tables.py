"""The comparison's tables: per arm mean +- SE over seeds, differences paired against the first arm, diagnostics.

Printed on the console (:func:`print_comparison`) and written as Markdown (:func:`comparison_markdown`,
``comparison.md`` beside the comparison's ``summary.json``); rows and differences are
:func:`megatron_zcpo.cli.demo_stats.compare_methods`'s.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

# The diagnostics the comparison prints per arm (all of them are in summary.json): response length,
# F4's length-drift correlation, F5's KL share of the gradient in the shortest / longest groups,
# F1's clipped-token share and the KL gradient's share there, the KL share of the whole gradient.
DIAGNOSTIC_COLUMNS = (
    ("length", "length"),
    ("diag/f4_corr_length_kl_sum", "F4 corr(T, sum KL)"),
    ("diag/f5_kl_share_short", "F5 KL share, short"),
    ("diag/f5_kl_share_long", "F5 KL share, long"),
    ("diag/f1_closed_fraction", "F1 clipped tokens"),
    ("diag/f1_kl_share_closed", "F1 KL share there"),
    ("diag/grad_kl_share", "KL share of gradient"),
)


def seed_metrics(summary: dict) -> Dict[str, float]:
    """One seed's numbers for the comparison: the summary's scalars and ``diag/<name>`` per diagnostic."""
    scalars = {key: value for key, value in summary.items() if isinstance(value, (int, float))}
    return {**scalars, **{f"diag/{name}": value for name, value in summary.get("diagnostics", {}).items()}}


def cell(mean: float, se: float, digits: int = 3, signed: bool = False) -> str:
    """``"mean +- se"`` with ``digits`` decimals (``"mean"`` alone when se is NaN, "n/a" when mean is)."""
    if math.isnan(mean):
        return "n/a"
    text = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
    return text if math.isnan(se) else f"{text} +- {se:.{digits}f}"


def print_comparison(rows: List[dict], differences: List[dict], console) -> None:
    """The comparison: per arm mean +- SE over seeds, the paired differences against the first arm,
    and the diagnostics per arm when the runs measured them."""
    from rich.table import Table

    table = Table(title=f"arms over {rows[0]['seeds']} seeds (mean +- standard error over seeds)")
    for column in ("arm", "held-out after", "held-out gain", "reward", "KL to ref"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["method"],
            *(cell(row[k], row[k + "_se"]) for k in ("after", "gain", "reward")),
            f"{row['kl']:.2e} +- {row['kl_se']:.1e}",
        )
    console.print(table)
    diffs = Table(title="differences, paired by seed (arm - first arm)")
    for column in ("difference", "held-out after", "reward", "KL to ref", "length"):
        diffs.add_column(column, justify="right")
    for (method, baseline), cells in _by_pair(differences).items():
        diffs.add_row(
            f"{method} - {baseline}",
            *(cell(cells[k]["diff"], cells[k]["se"], signed=True) for k in ("after", "reward")),
            f"{cells['kl']['diff']:+.2e} +- {cells['kl']['se']:.1e}",
            cell(cells["length"]["diff"], cells["length"]["se"], digits=1, signed=True),
        )
    console.print(diffs)
    shown = [(key, title) for key, title in DIAGNOSTIC_COLUMNS if key in rows[0]]
    if len(shown) > 1:
        diagnostics = Table(
            title="diagnostics per arm (means over the diagnostic steps, then over seeds; "
            "all F1-F7 values in summary.json)"
        )
        for column in ("arm", *(title for _, title in shown)):
            diagnostics.add_column(column, justify="right")
        for row in rows:
            diagnostics.add_row(row["method"], *(cell(row[key], row[key + "_se"], digits=2) for key, _ in shown))
        console.print(diagnostics)


def _by_pair(differences: Sequence[dict]) -> Dict[Tuple[str, str], Dict[str, dict]]:
    pairs: Dict[Tuple[str, str], Dict[str, dict]] = {}
    for d in differences:
        pairs.setdefault((d["method"], d["baseline"]), {})[d["key"]] = d
    return pairs


def comparison_markdown(rows: List[dict], differences: List[dict]) -> str:
    """The comparison as Markdown tables: arms (mean +- SE over seeds), differences paired by seed
    against the first arm (mean +- SE of the per-seed differences), and every measured diagnostic."""
    before = [row.get("before") for row in rows if "before" in row]
    lines = [
        f"{rows[0]['seeds']} seeds; mean +- standard error over seeds"
        + (f"; held-out before training {before[0]:.3f}" if before else ""),
        "",
        "| arm | held-out after | gain | training reward | KL to ref | response length |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['method']} | "
            + " | ".join(
                cell(row[k], row[k + "_se"], digits) if k in row else "n/a"
                for k, digits in (("after", 3), ("gain", 3), ("reward", 3), ("kl", 3), ("length", 1))
            )
            + " |"
        )
    pairs = _by_pair(differences)
    if pairs:
        lines += [
            "",
            "| difference (paired by seed) | held-out after | training reward | KL to ref | response length |",
            "|---|---|---|---|---|",
        ]
        for (method, baseline), cells in pairs.items():
            lines.append(
                f"| {method} - {baseline} | "
                + " | ".join(
                    cell(cells[k]["diff"], cells[k]["se"], digits, signed=True) if k in cells else "n/a"
                    for k, digits in (("after", 3), ("reward", 3), ("kl", 3), ("length", 1))
                )
                + " |"
            )
    names = [key for key in rows[0] if key.startswith("diag/") and not key.endswith("_se")]
    if names:
        lines += [
            "",
            "| diagnostic (mean over its steps, then seeds) | " + " | ".join(r["method"] for r in rows) + " |",
            "|---|" + "---|" * len(rows),
        ]
        for name in names:
            lines.append(
                f"| {name[len('diag/') :]} | " + " | ".join(cell(r[name], r[name + "_se"], 3) for r in rows) + " |"
            )
    return "\n".join(lines)
