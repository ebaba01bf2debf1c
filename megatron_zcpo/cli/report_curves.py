"""The curves page of ``zcpo report``: one panel per metric family; runs of a method with several
seeds drawn as their mean with a one-standard-error band."""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from megatron_zcpo.diagnostics.compare import group_by_method, mean_and_standard_error

# Panels of curves: (title, key patterns); a panel is drawn when any run has any of its keys.
PANELS = (
    ("reward", ("rollout/reward_mean",)),
    ("accuracy (train, eval)", ("rollout/accuracy", "eval/avg@*", "eval/pass@*")),
    ("KL(pi || pi_ref) per token", ("experience/kl",)),
    ("response length", ("rollout/response_length_mean",)),
    ("coefficients: |C|, reward flips", ("coef/coef_abs_mean", "coef/reward_flip_fraction")),
    ("drift: mean, beta*max|K|", ("coef/drift_mean", "coef/drift_peak_mean")),
    ("gradient norm", ("update/grad_norm",)),
    ("KL share of the gradient", ("diag/grad_kl_share",)),
    ("cos(g_reward, g_KL)", ("diag/grad_cosine",)),
    ("F1 closed-gate fraction", ("diag/f1_closed_fraction",)),
    ("F1 KL share at closed gates", ("diag/f1_kl_share_closed",)),
    ("F2 reward cancellation", ("diag/f2_cancellation", "diag/f2_group_cancellation_mean")),
    (
        "F2 KL share: low / high cancellation",
        ("diag/f2_kl_share_low_cancellation", "diag/f2_kl_share_high_cancellation"),
    ),
    ("F3 tied groups", ("diag/f3_tied_group_fraction",)),
    ("F3 tied-group gradient share", ("diag/f3_tied_grad_share",)),
    ("F4 corr(length, drift)", ("diag/f4_corr_length_kl_sum", "diag/f4_corr_length_penalty")),
    ("F5 KL share: short / long groups", ("diag/f5_kl_share_short", "diag/f5_kl_share_long")),
    ("F6 KL share of the top tokens", ("diag/f6_kl_top*",)),
    ("F6 KL by position", ("diag/f6_kl_pos_*",)),
    ("F6 first-token KL share", ("diag/f6_first_token_share",)),
    ("F7 negative k1 drift fraction", ("diag/f7_k1_negative_fraction",)),
    ("F6 share of Var(K): first tokens", ("diag/f6_head*_var_share",)),
    ("F7 RMSE of K: k1 vs conditional KL", ("diag/f7_k1_drift_rmse",)),
    ("F7 dispersion of K / noise scale (Fig. 3g)", ("diag/f7_k1_dispersion_ratio", "diag/f7_kappa_dispersion_ratio")),
    ("F7 noise reference scale", ("diag/f7_noise_reference_scale",)),
    ("GVPO noise RMS (Fig. 4b)", ("diag/f7_gvpo_noise_rms",)),
    ("other diagnostics", ("diag/*",)),  # whatever the panels above did not draw
)


def matching_keys(runs: Sequence, pattern: str) -> List[str]:
    """The metric names of any of ``runs`` that match the glob ``pattern``, sorted."""
    return sorted({key for r in runs for key in r.keys() if fnmatch.fnmatchcase(key, pattern)})  # noqa: SIM118 -- RunData, not a dict


Curve = Tuple[str, List[float], List[float], Optional[List[float]]]  # label, x, y, standard error


def curves_of(runs: Sequence, key: str) -> List[Curve]:
    """One curve per run of ``key``; or, when some method has several runs (seeds) aligned by step,
    one per method: the mean over its runs at each step and the standard error of that mean."""
    groups = group_by_method([r.method for r in runs])
    if all(len(indices) < 2 for indices in groups.values()) or any(r.gpu_hours is not None for r in runs):
        return [(r.name if len(runs) > 1 else "", *r.series(key), None) for r in runs]
    curves = []
    for method, indices in groups.items():
        at_step: dict = {}
        for i in indices:
            for step, value in zip(*runs[i].series(key)):
                at_step.setdefault(step, []).append(value)
        steps = sorted(at_step)
        stats = [mean_and_standard_error(at_step[step]) for step in steps]
        curves.append(
            (
                f"{method} (n={len(indices)})",
                steps,
                [m for m, _, _ in stats],
                [e if math.isfinite(e) else 0.0 for _, e, _ in stats],
            )
        )
    return curves


def write_curves(runs: Sequence, path: Path) -> Path:
    """PANELS as a PNG grid; each run (or method, see :func:`curves_of`) in its own colour, each key
    of a panel in its own line style, standard-error bands where there are seeds."""
    from matplotlib.figure import Figure

    panels, drawn = [], set()
    for title, patterns in PANELS:
        keys = [k for pattern in patterns for k in matching_keys(runs, pattern) if k not in drawn]
        if keys:
            drawn.update(keys)
            panels.append((title, keys))
    columns = 4
    rows = max(1, math.ceil(len(panels) / columns))
    figure = Figure(figsize=(4.2 * columns, 3.0 * rows), layout="constrained")
    styles = ("-", "--", ":", "-.")
    for position, (title, keys) in enumerate(panels):
        axes = figure.add_subplot(rows, columns, position + 1)
        axes.set_title(title, fontsize=9)
        for k, key in enumerate(keys):
            for c, (name, steps, values, errors) in enumerate(curves_of(runs, key)):
                if not values:
                    continue
                label = " ".join(part for part in (name, key.split("/", 1)[1] if len(keys) > 1 else "") if part)
                axes.plot(
                    steps,
                    values,
                    color=f"C{c % 10}",
                    linestyle=styles[k % len(styles)],
                    marker="o" if key.startswith("eval/") or len(values) < 3 else None,
                    markersize=3,
                    linewidth=1.2,
                    label=label or None,
                )
                if errors is not None:
                    axes.fill_between(
                        steps,
                        [v - e for v, e in zip(values, errors)],
                        [v + e for v, e in zip(values, errors)],
                        color=f"C{c % 10}",
                        alpha=0.2,
                    )
        axes.set_xlabel("GPU-hours" if runs[0].gpu_hours is not None else "step", fontsize=8)
        axes.tick_params(labelsize=7)
        if axes.get_legend_handles_labels()[1]:
            axes.legend(fontsize=6)
    if not panels:
        figure.add_subplot(1, 1, 1).text(0.5, 0.5, "no metrics to plot", ha="center")
    figure.savefig(path, dpi=110)
    return path
