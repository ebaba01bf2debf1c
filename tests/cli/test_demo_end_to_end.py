"""`zcpo demo` end to end on a tiny, barely warmed-up model: two TP=2 steps, the paired summary and plots."""

import argparse
import dataclasses
import json

import yaml

from megatron_zcpo.cli import demo
from megatron_zcpo.recipe.demo_assets import DemoSpec, build_demo_assets


def test_demo_runs_and_reports_the_paired_gain(tmp_path, monkeypatch):
    spec = dataclasses.replace(DemoSpec(), size=300, vocab_size=300, sft_max_steps=2)  # no warm-up check
    assets = build_demo_assets(spec, tmp_path / "cache", log=lambda line: None)
    config = yaml.safe_load(demo.DEMO_CONFIG.read_text())
    config["rollout"].update(prompts_per_step=4, samples_per_prompt=2, max_new_tokens=6)
    config["rollout"]["dynamic_sampling"] = {"drop_tied_groups": False}  # an untrained model ties every group
    config["eval"].update(num_prompts=8, k=2, every=1)
    config["train"]["micro_batch_tokens"] = 256
    config["logging"]["tensorboard"] = False
    small = tmp_path / "demo.yaml"
    small.write_text(yaml.safe_dump(config))
    monkeypatch.setattr(demo, "DEMO_CONFIG", small)
    monkeypatch.setattr("megatron_zcpo.recipe.demo_assets.build_demo_assets", lambda log: assets)
    args = argparse.Namespace(compare=False, seed=2, seeds=1, out=str(tmp_path / "out"), steps=2, nproc=2)
    assert demo.run(args) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["seed"] == 2 and summary["steps"] == 2 and summary["problems"] == 8
    assert abs(summary["gain"] - (summary["after"] - summary["before"])) < 1e-12
    run_config = yaml.safe_load((tmp_path / "out" / "zcpo" / "config.yaml").read_text())
    assert run_config["rollout"]["seed"] == 2 and run_config["data"]["seed"] == 2
    assert len(list((tmp_path / "out" / "zcpo" / "eval").glob("step_*.json"))) == 3  # steps 0, 1, 2
    for plot in ("heldout_accuracy.png", "report.png"):
        assert (tmp_path / "out" / plot).stat().st_size > 0
