"""``zcpo report``: run directories with train, eval and diagnostics lines, NaN and missing keys."""

import argparse
import json
import math

import pytest

from megatron_zcpo.cli import report


def _parser():
    parser = argparse.ArgumentParser(prog="zcpo")
    report.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def _write_run(directory, algorithm, rewards, *, diag=True, eval_steps=(0, 4), broken_tail=False):
    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text(f"algorithm:\n  {algorithm}\nlogging:\n  run_dir: {directory}\n")
    lines = []
    for step, reward in enumerate(rewards):
        lines.append(
            {
                "step": step,
                "time": 100.0 + step,
                "rollout/reward_mean": reward,
                "rollout/accuracy": (reward + 1) / 2,
                "experience/kl": 1e-3 * step,
                "rollout/response_length_mean": 10 + step,
                "update/grad_norm": math.nan,
            }
        )
        if diag and step % 2 == 0:  # diagnostics on their own line of the same step
            lines.append(
                {
                    "step": step,
                    "time": 100.5 + step,
                    "diag/grad_kl_share": 0.1 * step,
                    "diag/f6_kl_top1pct_share": 0.5,
                    "diag/f6_kl_pos_0_1": 0.02 * (step + 1),
                }
            )
        if step in eval_steps:
            lines.append({"step": step, "time": 100.7 + step, "eval/avg@4": 0.2 + 0.1 * step, "eval/num_problems": 8})
    text = "\n".join(json.dumps(line) for line in lines) + "\n"
    if broken_tail:
        text += '{"step": 99, "rollout/rew'  # a writer that died mid-line
    (directory / "metrics.jsonl").write_text(text)
    return directory


def test_report_of_several_runs(tmp_path, capsys):
    zcpo = _write_run(tmp_path / "runs" / "zcpo", "name: zcpo", [-0.5, 0.1, 0.6, 0.4, 0.5], broken_tail=True)
    dapo = _write_run(
        tmp_path / "runs" / "dapo_k3",
        "{name: dapo, kl_loss: k3, kl_coef: 0.04}",
        [-0.2, 0.0, 0.3],
        diag=False,
        eval_steps=(2,),
    )
    args = _parser().parse_args(["report", str(zcpo), str(dapo)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    for text in (
        "zcpo",
        "dapo_k3",
        "beta=4",
        "k3 KL 0.04",
        "rollout/reward_mean",
        "diag/grad_kl_share",
        "best 0.6 @2",
        "eval/avg@4",
    ):
        assert text in printed, text
    out = tmp_path / "runs"  # the runs' common parent
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report.html").read_text()
    assert "data:image/png;base64," in page and "dapo_k3" in page and "diag/f6_kl_top1pct_share" in page

    runs = [report.load_run(zcpo), report.load_run(dapo)]
    rows = {row.key: row for row in report.summary_rows(runs)}
    assert rows["rollout/reward_mean"].cells[0] == (0.5, 0.6, 2)  # final, best, step of the best
    assert rows["rollout/reward_mean"].cells[1] == (0.3, 0.3, 2)
    assert rows["eval/avg@4"].cells[0][:2] == pytest.approx((0.6, 0.6))
    assert rows["diag/grad_kl_share"].cells[0][:2] == pytest.approx((0.4, 0.2))  # steps 0, 2, 4: mean 0.2
    assert all(math.isnan(v) for v in rows["diag/grad_kl_share"].cells[1])  # the dapo run has no diagnostics
    assert "update/grad_norm" not in rows  # NaN everywhere: nothing to show
    # train, eval and diagnostics lines of one step are one record; the broken line is skipped
    assert [r["step"] for r in runs[0].records] == [0, 1, 2, 3, 4]
    assert {"rollout/reward_mean", "diag/grad_kl_share", "eval/avg@4"} <= set(runs[0].records[0])


def test_report_of_one_run_writes_into_it_and_tolerates_bad_dirs(tmp_path, capsys):
    run_dir = _write_run(tmp_path / "run", "name: grpo", [0.0, 1.0])
    args = _parser().parse_args(["report", str(run_dir), str(tmp_path / "missing")])
    assert args.func(args) == 0
    assert "missing" in capsys.readouterr().err
    assert (run_dir / "report.png").is_file() and (run_dir / "report.html").is_file()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n")
    args = _parser().parse_args(["report", str(tmp_path / "empty"), "--no-plots"])
    assert args.func(args) == 1


def test_write_report_names_the_runs_as_the_demo_does(tmp_path):
    runs = [_write_run(tmp_path / name, "name: zcpo", [0.1, 0.2]) for name in ("a", "b")]
    paths = report.write_report(runs, tmp_path / "out", names=["dapo", "zcpo"])
    assert [p.name for p in paths] == ["report.png", "report.html"]
    page = paths[1].read_text()
    assert "<th>dapo<br>" in page and "<th>zcpo<br>" in page
    assert report.write_report([tmp_path / "nothing"], tmp_path / "out2") == []
