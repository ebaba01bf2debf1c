"""The paper's comparison protocol: ``zcpo report --align-by gpu-hours`` and mean / standard error over seeds."""

import argparse
import json
import math

import pytest

from megatron_zcpo.cli import report
from megatron_zcpo.diagnostics.compare import (
    common_budget,
    cumulative_gpu_hours,
    group_by_method,
    mean_and_standard_error,
    value_at,
)


def test_cumulative_gpu_hours_from_step_time_and_world_size():
    records = [
        {"step": 0, "time/step": 360.0, "time/world_size": 8},  # 0.8 GPU-hours
        {"step": 1, "time/step": 180.0, "time/world_size": 8},  # 0.4
        {"step": 2, "time/step": 36.0, "time/world_size": 100},
    ]  # 1.0
    assert cumulative_gpu_hours(records) == pytest.approx([0.8, 1.2, 2.2])
    assert cumulative_gpu_hours(records, gpus=10) == pytest.approx([1.0, 1.5, 1.6])  # the whole job's GPUs
    with pytest.raises(ValueError, match="step 1 has no time/world_size"):
        cumulative_gpu_hours([records[0], {"step": 1, "time/step": 1.0}])
    with pytest.raises(ValueError, match="step 0 has no time/step"):
        cumulative_gpu_hours([{"step": 0, "time/world_size": 8}], gpus=8)


def test_value_at_selects_the_last_point_within_the_budget_never_the_best():
    assert value_at([1.0, 2.0, 3.0, 4.0], [0.9, 0.1, math.nan, 0.5], 3.5) == (0.1, 2.0)  # NaN at 3 skipped
    assert value_at([1.0, 2.0], [0.3, 0.4], 2.0) == (0.4, 2.0)
    assert all(math.isnan(v) for v in value_at([1.0, 2.0], [0.3, 0.4], 0.5))
    assert common_budget([10.0, 7.5, 9.0]) == 7.5


def test_mean_and_standard_error():
    mean, error, n = mean_and_standard_error([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3) and error == pytest.approx(1.0 / math.sqrt(3.0))  # sd 1, / sqrt(3)
    assert mean_and_standard_error([4.0, math.nan])[:1] == (4.0,) and math.isnan(mean_and_standard_error([4.0])[1])
    assert math.isnan(mean_and_standard_error([])[0])
    assert group_by_method(["b", "a", "b", "c"]) == {"b": [0, 2], "a": [1], "c": [3]}


def _write_run(directory, seconds_per_step, gpus, accuracies, algorithm="name: zcpo"):
    """A run whose step s takes ``seconds_per_step`` on ``gpus`` devices and evaluates to accuracies[s]."""
    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text(f"algorithm:\n  {algorithm}\n")
    lines = []
    for step, accuracy in enumerate(accuracies):
        lines.append(
            {"step": step, "rollout/reward_mean": accuracy, "time/step": seconds_per_step, "time/world_size": gpus}
        )
        lines.append({"step": step, "eval/avg@32": accuracy})
    (directory / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return str(directory)


@pytest.fixture
def runs(tmp_path):
    """Three seeds of a fast method (1 GPU-hour / step) and two of a slow one (2 GPU-hours / step), 10 steps each."""
    fast = [
        _write_run(tmp_path / f"fast{seed}", 36.0, 100, [0.01 * s + 0.1 * seed for s in range(10)]) for seed in range(3)
    ]
    slow = [
        _write_run(tmp_path / f"slow{seed}", 72.0, 100, [0.05 * s + 0.2 * seed for s in range(10)], "{name: dapo}")
        for seed in range(2)
    ]
    return fast, slow


def _report(args):
    parser = argparse.ArgumentParser(prog="zcpo")
    report.add_parser(parser.add_subparsers(dest="command", required=True))
    parsed = parser.parse_args(["report", "--no-plots", *args])
    return parsed.func(parsed)


def test_gpu_hours_alignment_reads_every_run_at_the_same_gpu_time(runs):
    fast, slow = runs
    loaded = report.load_runs(fast + slow, methods=["fast"] * 3 + ["slow"] * 2)
    budget = report.align(loaded, "gpu-hours")
    assert budget == pytest.approx(10.0)  # the slow runs reach 20, the fast ones 10
    rows = {row.key: row for row in report.summary_rows(loaded, budget)}
    # at 10 GPU-hours: the fast runs' last step (9), the slow runs' step 4 (cumulative 10)
    assert [cell[0] for cell in rows["eval/avg@32"].cells] == pytest.approx(
        [0.09, 0.19, 0.29, 0.05 * 4, 0.05 * 4 + 0.2]
    )
    seeds = {row.key: row for row in report.seed_rows(loaded)}
    fast_cell, slow_cell = seeds["eval/avg@32"].cells
    assert (
        fast_cell[0] == pytest.approx(0.19) and fast_cell[1] == pytest.approx(0.1 / math.sqrt(3)) and fast_cell[2] == 3
    )
    assert slow_cell[0] == pytest.approx(0.3) and slow_cell[1] == pytest.approx(0.1) and slow_cell[2] == 2
    # by steps the same runs compare at step 9: a different (and for the paper, the wrong) comparison
    by_step = report.load_runs(fast + slow, methods=["fast"] * 3 + ["slow"] * 2)
    assert report.align(by_step, "step") == math.inf
    slow_by_step = {row.key: row for row in report.seed_rows(by_step)}["eval/avg@32"].cells[1]
    assert slow_by_step[0] == pytest.approx(0.45 + 0.1)


def test_methods_default_to_the_run_configs_algorithm(runs):
    fast, slow = runs
    loaded = report.load_runs(fast + slow)
    assert [r.method for r in loaded] == ["zcpo beta=4"] * 3 + ["dapo"] * 2
    assert [cell[2] for cell in report.seed_rows(loaded)[0].cells] == [3, 2]
    assert report.seed_rows(report.load_runs([fast[0], slow[0]])) == []  # one run per method: no seed table


def test_command_line(runs, capsys):
    fast, slow = runs
    labels = [arg for label in ["fast"] * 3 + ["slow"] * 2 for arg in ("--label", label)]
    assert _report(["--align-by", "gpu-hours", *labels, *fast, *slow]) == 0
    printed = capsys.readouterr().out
    for text in ("at 10 GPU-hours", "mean ± standard error over seeds", "0.19 ± 0.05774 (n=3)", "0.3 ± 0.1 (n=2)"):
        assert text in printed, text
    assert _report(["--label", "only-one", *fast]) == 2
    assert "--label given 1 times for 3 run directories" in capsys.readouterr().err


def test_the_papers_drift_diagnostics_are_reported(tmp_path, capsys):
    directory = tmp_path / "run"
    _write_run(directory, 10.0, 8, [0.1, 0.2])
    with open(directory / "metrics.jsonl", "a") as handle:
        handle.write(
            json.dumps(
                {
                    "step": 1,
                    "diag/f7_k1_drift_rmse": 0.0123,
                    "diag/f6_head10_var_share": 0.04,
                    "diag/f7_k1_dispersion_ratio": 1.01,
                    "diag/f7_gvpo_noise_rms": 0.0456,
                }
            )
            + "\n"
        )
    assert _report([str(directory)]) == 0
    printed = capsys.readouterr().out
    for text in (
        "diag/f7_k1_drift_rmse",
        "0.0123",
        "diag/f6_head10_var_share",
        "diag/f7_k1_dispersion_ratio",
        "diag/f7_gvpo_noise_rms",
    ):
        assert text in printed, text


def test_gpu_hours_need_the_time_metrics(tmp_path, capsys):
    directory = tmp_path / "old"
    directory.mkdir()
    (directory / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "rollout/reward_mean": 0.1, "time/step": 5.0}) + "\n"
    )
    assert _report(["--align-by", "gpu-hours", str(directory)]) == 2
    assert "old: step 0 has no time/world_size" in capsys.readouterr().err
    assert _report(["--align-by", "gpu-hours", "--gpus", "8", str(directory)]) == 0
