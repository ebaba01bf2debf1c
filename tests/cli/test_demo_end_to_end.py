"""`zcpo demo` end to end on tiny, barely warmed-up models: two TP=2 steps, the paired summary and plots;
a two-arm comparison on the scratchpad task run at once, where ZCPO with beta 0 must be DAPO with max-abs."""

import argparse
import dataclasses
import json
import math

import yaml

from megatron_zcpo.cli import demo
from megatron_zcpo.recipe.demo_assets import build_demo_assets, warmup_response


def _small_demo_config(tmp_path, monkeypatch, **changes):
    """demo.yaml shrunk to a few samples and problems (written to tmp_path and used by the demo)."""
    config = yaml.safe_load(demo.DEMO_CONFIG.read_text())
    config["rollout"].update(prompts_per_step=4, samples_per_prompt=2, max_new_tokens=6)
    config["rollout"]["dynamic_sampling"] = {"drop_tied_groups": False}  # an untrained model ties every group
    config["eval"].update(num_prompts=8, k=2, every=1)
    config["train"]["micro_batch_tokens"] = 256
    config["logging"]["tensorboard"] = False
    config = demo.merge(config, changes)
    small = tmp_path / "demo.yaml"
    small.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(demo, "DEMO_CONFIG", small)


def _tiny_assets(tmp_path, monkeypatch, task: str):
    spec = dataclasses.replace(demo.TASKS[task].spec, size=300, vocab_size=300, sft_max_steps=2)  # no warm-up check
    assets = build_demo_assets(spec, tmp_path / "cache", log=lambda line: None)
    monkeypatch.setattr("megatron_zcpo.recipe.demo_assets.build_demo_assets", lambda spec, log: assets)
    return spec, assets


def test_demo_runs_and_reports_the_paired_gain(tmp_path, monkeypatch):
    _tiny_assets(tmp_path, monkeypatch, "addition")
    _small_demo_config(tmp_path, monkeypatch)
    args = argparse.Namespace(
        compare=False,
        arms=None,
        seed=2,
        seeds=None,
        out=str(tmp_path / "out"),
        steps=2,
        nproc=None,
        task="addition",
        diagnostics=None,
        jobs=None,
        reuse=False,
        lora=True,  # `zcpo demo --lora`: LoRA through the whole recipe (the comparison below trains every weight)
    )
    assert demo.run(args) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["seed"] == 2 and summary["steps"] == 2 and summary["problems"] == 8
    assert abs(summary["gain"] - (summary["after"] - summary["before"])) < 1e-12
    run = tmp_path / "out" / "zcpo-lora"
    run_config = yaml.safe_load((run / "config.yaml").read_text())
    assert run_config["rollout"]["seed"] == 2 and run_config["data"]["seed"] == 2
    assert run_config["model"]["lora"]["rank"] == 16
    assert len(list((run / "eval").glob("step_*.json"))) == 3  # steps 0, 1, 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step_one = next(r for r in records if "selfcheck/kl_max" in r)
    assert step_one["selfcheck/kl_max"] == 0.0 and step_one["experience/kl"] == 0.0  # B = 0: the policy is the base
    assert (run / "checkpoints" / "step_00000002" / "weights" / "lora.json").is_file()
    for plot in ("heldout_accuracy.png", "report.png"):
        assert (tmp_path / "out" / plot).stat().st_size > 0


def test_scratchpad_assets_and_beta0_zcpo_equals_dapo_with_max_abs(tmp_path, monkeypatch):
    """The scratchpad task's assets at a tiny size, then ``zcpo-beta0`` and
    ``dapo:algorithm.reward_norm=max_abs`` side by side (2 runs at once): every metric they share is
    the same, step by step, and so are the held-out evaluations."""
    spec, assets = _tiny_assets(tmp_path, monkeypatch, "scratchpad")
    held_out = [json.loads(line) for line in (assets / "eval.jsonl").read_text().splitlines()]
    assert held_out and all("\\boxed{}" in r["prompt"] for r in held_out)
    assert json.loads((assets / "demo_spec.json").read_text())["worked_fraction"] == 0.5
    from megatron_zcpo.recipe.demo_assets import demo_records

    responses = [warmup_response(spec, record) for record in demo_records(spec, "train")]
    worked = [r for r in responses if not r.startswith("\\boxed")]
    assert 0.3 < len(worked) / len(responses) < 0.7 and all("=" in r for r in worked)
    # An untrained model answers at random: a reward by response length splits its groups instead.
    _small_demo_config(tmp_path, monkeypatch, reward={"function": "tests.cli.varied_reward:length_parity_reward"})
    args = argparse.Namespace(
        compare=True,
        arms="zcpo-beta0,dapo:algorithm.reward_norm=max_abs",
        seed=3,
        seeds=1,
        out=str(tmp_path / "out"),
        steps=2,
        nproc=2,
        task="scratchpad",
        diagnostics=False,
        jobs=2,
        reuse=False,
        lora=False,
    )
    assert demo.run(args) == 0
    runs = [tmp_path / "out" / name / "seed_3" for name in ("zcpo-beta0", "dapo+algorithm.reward_norm=max_abs")]
    configs = [yaml.safe_load((run / "config.yaml").read_text()) for run in runs]
    assert [c["algorithm"]["name"] for c in configs] == ["zcpo", "dapo"]
    assert configs[0]["rollout"]["max_new_tokens"] == 48  # the task's generation cap
    metrics = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] for run in runs]
    assert len(metrics[0]) == len(metrics[1]) == 5  # eval at steps 0, 1, 2 and two trained steps
    compared = 0
    for zcpo, dapo in zip(*metrics):
        for key in sorted(set(zcpo) & set(dapo)):
            if key.startswith("time") or key.endswith("tokens_per_s") or key == "run_id":  # each run its own id
                continue
            same = zcpo[key] == dapo[key] or (math.isnan(zcpo[key]) and math.isnan(dapo[key]))
            assert same, f"step {zcpo['step']}: {key} differs: zcpo-beta0 {zcpo[key]!r}, dapo max_abs {dapo[key]!r}"
            compared += 1
    trained = [record for record in metrics[0] if "update/loss" in record]
    assert len(trained) == 2 and any(record["coef/coef_abs_mean"] > 0 for record in trained)  # groups split
    assert compared > 60
    for step in ("000000", "000002"):
        evaluations = [json.loads((run / "eval" / f"step_{step}.json").read_text())["problems"] for run in runs]
        assert evaluations[0] == evaluations[1]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["task"] == "scratchpad" and summary["jobs"] == 2
    assert {d["key"]: d["diff"] for d in summary["differences"]}["after"] == 0.0


def test_calculator_task_trains_on_trajectories_that_call_the_tool(tmp_path, monkeypatch):
    """``--task calculator`` at a tiny size: a briefly warmed-up model calls the calculator in some
    rollouts (multi-turn, the tool's turns masked out), the trainer steps on them, and summary.json
    says how often the policy called the tool before and after."""
    spec = dataclasses.replace(demo.TASKS["calculator"].spec, size=300, vocab_size=300, sft_max_steps=100)
    assets = build_demo_assets(spec, tmp_path / "cache", log=lambda line: None)
    monkeypatch.setattr("megatron_zcpo.recipe.demo_assets.build_demo_assets", lambda spec, log: assets)
    _small_demo_config(tmp_path, monkeypatch)
    args = argparse.Namespace(
        compare=False,
        arms=None,
        seed=1,
        seeds=None,
        out=str(tmp_path / "out"),
        steps=2,
        nproc=None,
        task="calculator",
        diagnostics=None,
        jobs=None,
        reuse=False,
        lora=False,
    )
    assert demo.run(args) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert 0 <= summary["tool_call_fraction_before"] <= 1 and 0 <= summary["tool_call_fraction_after"] <= 1
    metrics = [json.loads(line) for line in (tmp_path / "out" / "zcpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/tool_call_fraction" in m]
    assert len(steps) == 2 and any(m["rollout/tool_call_fraction"] > 0 for m in steps)
    assert all(m["rollout/tool_tokens_mean"] > 0 for m in steps if m["rollout/tool_call_fraction"] > 0)
    assert all(math.isfinite(m["experience/kl_turn1"]) for m in steps)
