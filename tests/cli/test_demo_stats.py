"""The demo's statistics (paired held-out gain, method comparison over seeds), seed plumbing and plot."""

import json
import math

import pytest

from megatron_zcpo.cli import demo
from megatron_zcpo.cli.demo_stats import compare_methods, mean_and_se, paired_gain, run_gain, verdict


def test_mean_and_se_known_case():
    mean, se = mean_and_se([1.0, 2.0, 3.0, 4.0])
    assert mean == 2.5
    assert se == pytest.approx(math.sqrt((1.5**2 * 2 + 0.5**2 * 2) / 3 / 4))  # sample std / sqrt(n)
    assert math.isnan(mean_and_se([3.0])[1])
    with pytest.raises(ValueError):
        mean_and_se([])


def test_paired_gain_known_case():
    before = {"a": 0.0, "b": 0.5, "c": 1.0}
    after = {"a": 0.5, "b": 0.5, "c": 1.0}
    result = paired_gain(before, after)
    # differences 0.5, 0, 0: mean 1/6, sample std sqrt(1/12), SE sqrt(1/12)/sqrt(3) = 1/6
    assert result["gain"] == pytest.approx(1 / 6)
    assert result["se"] == pytest.approx(1 / 6)
    assert result["z"] == pytest.approx(1.0)
    assert (result["before"], result["after"], result["problems"]) == (pytest.approx(0.5), pytest.approx(2 / 3), 3)
    with pytest.raises(ValueError, match="same problems"):
        paired_gain(before, {"a": 0.5, "b": 0.5, "d": 1.0})


def test_pairing_removes_problem_difficulty():
    # Problems of very different difficulty, each 0.1 better after: unpaired means would call this
    # noise; the paired SE is zero and the gain is shown.
    before = {str(i): i / 20 for i in range(10)}
    after = {uid: value + 0.1 for uid, value in before.items()}
    result = paired_gain(before, after)
    assert result["gain"] == pytest.approx(0.1) and result["se"] == pytest.approx(0.0, abs=1e-12)
    assert "learning shown" in verdict(result["gain"], result["se"])


def test_verdict_thresholds():
    assert "learning shown" in verdict(0.09, 0.03)
    assert "not conclusive" in verdict(0.05, 0.03)
    assert "did not rise" in verdict(-0.01, 0.03)


def test_compare_methods_pairs_by_seed():
    per_seed = {
        "dapo": [{"after": 0.50}, {"after": 0.60}, {"after": 0.70}],
        "zcpo": [{"after": 0.55}, {"after": 0.66}, {"after": 0.73}],
    }
    rows, differences = compare_methods(per_seed, ("after",), baseline="dapo")
    by_method = {row["method"]: row for row in rows}
    assert by_method["dapo"]["after"] == pytest.approx(0.6)
    assert by_method["dapo"]["after_se"] == pytest.approx(0.1 / math.sqrt(3))
    assert by_method["zcpo"]["seeds"] == 3
    (diff,) = differences
    # per-seed differences 0.05, 0.06, 0.03: mean 0.0467, sample std 0.01528, SE 0.00882
    assert diff["method"] == "zcpo" and diff["baseline"] == "dapo"
    assert diff["diff"] == pytest.approx(0.14 / 3)
    assert diff["se"] == pytest.approx(
        math.sqrt(((0.05 - 0.14 / 3) ** 2 + (0.06 - 0.14 / 3) ** 2 + (0.03 - 0.14 / 3) ** 2) / 2 / 3)
    )
    with pytest.raises(ValueError, match="same seeds"):
        compare_methods({"dapo": [{"after": 1.0}], "zcpo": []}, ("after",), baseline="dapo")


def test_seed_changes_reach_every_seed_and_validate(tmp_path):
    from megatron_zcpo.cli.demo_arms import parse_arm
    from megatron_zcpo.recipe.config import build_run_config

    config = demo.demo_config(tmp_path, tmp_path / "run", demo.seed_changes(5))
    run = build_run_config(config)
    assert (run.train.seed, run.rollout.seed, run.data.seed) == (5, 5, 5)
    assert run.eval.seed == 10_005
    other = parse_arm("dapo-k3").config(demo.demo_config(tmp_path, tmp_path / "run", demo.seed_changes(6)))
    assert other["rollout"]["seed"] == 6 and other["algorithm"]["kl_loss"] == "k3"
    scratchpad = build_run_config(demo.demo_config(tmp_path, tmp_path / "run", {}, task="scratchpad", diagnostics=True))
    assert scratchpad.rollout.max_new_tokens == 48 and scratchpad.diagnostics.enabled


def _fake_run(run_dir, accuracies, rewards, diagnostics=()):
    """A run directory as `zcpo train` leaves it: metrics.jsonl and per-step evaluation files.

    diagnostics: (step, {name: value}): ``diag/<name>`` metrics of a step."""
    (run_dir / "eval").mkdir(parents=True)
    for step, per_problem in accuracies.items():
        problems = [{"uid": uid, "num_correct": int(a * 4), "num_samples": 4} for uid, a in per_problem.items()]
        (run_dir / "eval" / f"step_{step:06d}.json").write_text(json.dumps({"problems": problems}))
    lines = [
        {
            "step": s + 1,
            "rollout/reward_mean": r,
            "experience/kl": 0.01 * (s + 1),
            "rollout/response_length_mean": 10.0 + s,
        }
        for s, r in enumerate(rewards)
    ]
    for step, values in diagnostics:  # logged with the step's training metrics
        lines[step - 1].update({f"diag/{k}": v for k, v in values.items()})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_run_summary_and_plot(tmp_path):
    run_dir = tmp_path / "zcpo"
    _fake_run(
        run_dir,
        {0: {"a": 0.25, "b": 0.5}, 4: {"a": 0.5, "b": 0.75}, 8: {"a": 0.75, "b": 1.0}},
        rewards=[0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4],
        diagnostics=[(1, {"f4": 9.0, "f1": 9.0}), (5, {"f4": 0.5, "f1": float("nan")}), (8, {"f4": 0.25})],
    )
    summary = demo.run_summary(run_dir)
    assert summary["gain"] == pytest.approx(0.5)  # first vs last evaluation
    # tails: the last quarter of the steps (7, 8); diagnostics: every measurement but the first, NaNs skipped
    diagnostics = summary.pop("diagnostics")
    assert summary == {
        **run_gain(run_dir),
        "reward": pytest.approx(1.3),
        "kl": pytest.approx(0.075),
        "length": pytest.approx(16.5),
        "steps": 8,
    }
    assert diagnostics["f4"] == pytest.approx(0.375) and math.isnan(diagnostics["f1"])
    path = demo.write_accuracy_plot({"zcpo": [run_dir], "twice": [run_dir, run_dir]}, 4, tmp_path / "plot.png")
    assert path.stat().st_size > 0


def test_compare_runs_every_arm_with_the_same_seeds(tmp_path, monkeypatch):
    """The --compare orchestration: seeds x arms, per-seed pairing against the first arm, per-run and
    overall summaries, diagnostics, plot (training faked)."""
    from megatron_zcpo.cli.main import build_parser

    calls = []

    def fake_run_jobs(jobs, at_once, reuse, on_done, log):
        assert at_once == 2 and not reuse
        for job in jobs:
            seed, algorithm = job.config["rollout"]["seed"], job.config["algorithm"]
            assert job.config["parallel"]["tensor"] == 1  # --compare's default: TP=1 runs, 2 at a time
            calls.append((job.run_dir.parent.name, seed, algorithm["name"], algorithm["beta"]))
            bonus = {"dapo": 0.0, "zcpo+algorithm.beta=1": -0.25, "zcpo": 0.25}[job.run_dir.parent.name]
            _fake_run(
                job.run_dir,
                {0: {"a": 0.25, "b": 0.5}, 2: {"a": 0.5 + bonus, "b": 0.5 + seed / 8}},
                [0.1 * seed, 0.2],
                diagnostics=[(1, {"f4_corr_length_kl_sum": 0.0}), (2, {"f4_corr_length_kl_sum": seed + bonus})],
            )
            on_done(job)
        return 0

    monkeypatch.setattr("megatron_zcpo.cli.demo_jobs.run_jobs", fake_run_jobs)
    monkeypatch.setattr("megatron_zcpo.recipe.demo_assets.build_demo_assets", lambda spec, log: tmp_path)
    args = build_parser().parse_args(
        [
            "demo",
            "--compare",
            "--arms",
            "dapo,zcpo:algorithm.beta=1,zcpo",
            "--seed",
            "3",
            "--seeds",
            "2",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert demo.run(args) == 0
    assert calls == [
        (d, s, n, b)
        for s in (3, 4)
        for d, n, b in (("dapo", "dapo", 4.0), ("zcpo+algorithm.beta=1", "zcpo", 1), ("zcpo", "zcpo", 4.0))
    ]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["seeds"] == [3, 4] and summary["task"] == "addition"
    by_key = {(d["method"], d["key"]): d for d in summary["differences"]}
    assert by_key[("zcpo", "after")]["diff"] == pytest.approx(0.125)  # +0.25 on one of two problems
    assert by_key[("zcpo:algorithm.beta=1", "after")]["diff"] == pytest.approx(-0.125)
    assert by_key[("zcpo", "after")]["se"] == pytest.approx(0.0)  # the same difference on both seeds
    assert by_key[("zcpo", "diag/f4_corr_length_kl_sum")]["diff"] == pytest.approx(0.25)
    per_run = json.loads((tmp_path / "out" / "zcpo" / "seed_4" / "summary.json").read_text())
    assert (
        per_run["arm"] == "zcpo" and per_run["seed"] == 4 and per_run["diagnostics"] == {"f4_corr_length_kl_sum": 4.25}
    )
    assert (tmp_path / "out" / "heldout_accuracy.png").stat().st_size > 0
    table = (tmp_path / "out" / "comparison.md").read_text()
    assert "2 seeds; mean +- standard error over seeds; held-out before training 0.375" in table
    assert "| zcpo - dapo | +0.125 +- 0.000 |" in table and "| f4_corr_length_kl_sum | 3.500 +- 0.500 |" in table


def test_seed_sweep_rows_report_the_lowest_point_and_the_verdict(tmp_path):
    from megatron_zcpo.cli.demo_stats import run_trajectory, seed_sweep_rows, sweep_markdown

    problems = [str(i) for i in range(8)]
    steady = {
        0: dict.fromkeys(problems, 0.25),
        2: dict.fromkeys(problems, 0.5),
        4: {uid: (0.75 if i % 2 else 0.5) for i, uid in enumerate(problems)},
    }
    dipping = {
        0: dict.fromkeys(problems, 0.5),
        2: {uid: (0.25 if i < 2 else 0.5) for i, uid in enumerate(problems)},
        4: dict.fromkeys(problems, 0.75),
    }
    _fake_run(tmp_path / "steady", steady, [0.0])
    _fake_run(tmp_path / "dipping", dipping, [0.0])
    trajectory = run_trajectory(tmp_path / "dipping")
    assert trajectory["steps"] == [0, 2, 4]
    assert trajectory["lowest"]["gain"] == pytest.approx(-0.0625)  # step 2: -0.25 on 2 of 8 problems
    rows, summary = seed_sweep_rows({7: tmp_path / "dipping", 3: tmp_path / "steady"}, {3: 90.0})
    assert [row["seed"] for row in rows] == [3, 7]
    assert rows[0]["gain"] == pytest.approx(0.375) and rows[0]["lowest"] == pytest.approx(0.25)
    assert rows[0]["wall_s"] == 90.0 and math.isnan(rows[1]["wall_s"])
    assert rows[1]["gain"] == pytest.approx(0.25) and math.isinf(rows[1]["z"])  # the same +0.25 everywhere
    assert summary["seeds"] == 2 and summary["shown"] == 2 and summary["never_below_start"] == 1
    assert not summary["ok"] and summary["min_z"] == pytest.approx(rows[0]["z"])
    assert summary["gain"] == pytest.approx((0.375 + 0.25) / 2)
    table = sweep_markdown(rows, summary)
    assert "| 7 | 0.500 | 0.750 | +0.250 |" in table and "1 never below their start" in table
    with pytest.raises(ValueError, match="at least one run"):
        seed_sweep_rows({}, {})


def test_seeds_without_compare_sweep_the_demo(tmp_path, monkeypatch):
    """`zcpo demo --seeds N`: one run per seed, then the table (training faked)."""
    from megatron_zcpo.cli.main import build_parser

    seeds = []

    def fake_run_jobs(jobs, at_once, reuse, on_done, log):
        assert at_once == 1
        for job in jobs:
            seed = job.config["rollout"]["seed"]
            seeds.append((job.run_dir.name, seed, job.config["parallel"]["tensor"]))
            _fake_run(
                job.run_dir,
                {0: {"a": 0.25, "b": 0.5}, 20: {"a": 0.5, "b": 0.5}, 40: {"a": 0.5, "b": 0.5 + seed / 16}},
                [0.1],
            )
            job.wall_s = 1.0
            on_done(job)
        return 0

    monkeypatch.setattr("megatron_zcpo.cli.demo_jobs.run_jobs", fake_run_jobs)
    monkeypatch.setattr("megatron_zcpo.recipe.demo_assets.build_demo_assets", lambda spec, log: tmp_path)
    args = build_parser().parse_args(["demo", "--seed", "5", "--seeds", "3", "--out", str(tmp_path / "out")])
    assert demo.run(args) == 0
    assert seeds == [("seed_5", 5, 2), ("seed_6", 6, 2), ("seed_7", 7, 2)]  # the demo's TP=2, one at a time
    sweep = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [row["seed"] for row in sweep["rows"]] == [5, 6, 7]
    assert sweep["summary"]["never_below_start"] == 3 and all(row["wall_s"] >= 0 for row in sweep["rows"])
    assert (tmp_path / "out" / "sweep.md").read_text().startswith("| seed |")
    assert (tmp_path / "out" / "heldout_accuracy.png").stat().st_size > 0
