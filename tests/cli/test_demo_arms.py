"""`zcpo demo --compare --arms`: arm names, :key=value overrides, their validation and error messages."""

import argparse

import pytest

from megatron_zcpo.cli import demo
from megatron_zcpo.cli.demo_arms import ARMS, DEFAULT_ARMS, parse_arm, parse_arms, split_arm_list
from megatron_zcpo.recipe.config import build_run_config
from megatron_zcpo.utils.config_loader import ConfigError


def _algorithm(tmp_path, label: str):
    return build_run_config(
        parse_arm(label).config(demo.demo_config(tmp_path, tmp_path / "run", {}))
    ).algorithm.resolved()


def test_the_table_holds_the_paper_cells(tmp_path):
    assert [a.label for a in parse_arms(DEFAULT_ARMS)] == ["dapo", "dapo-k3", "zcpo"]
    cells = {label: _algorithm(tmp_path, label) for label in ARMS}
    assert (cells["dapo"].name, cells["dapo"].reward_norm, cells["dapo"].kl_loss) == ("dapo", "std", "none")
    assert (cells["dapo-k3"].kl_loss, cells["dapo-k3"].kl_coef) == ("k3", 0.04)
    assert (cells["zcpo"].reward_norm, cells["zcpo"].beta) == ("max_abs", 4.0)
    assert (cells["zcpo-beta0"].name, cells["zcpo-beta0"].reward_norm, cells["zcpo-beta0"].beta) == (
        "zcpo",
        "max_abs",
        0.0,
    )
    assert (cells["zcpo-std"].reward_norm, cells["zcpo-std"].beta) == ("std", 4.0)
    assert (
        cells["zcpo-k1"].drift,
        cells["zcpo-no-center"].center,
        cells["zcpo-no-length-norm"].length_normalize,
        cells["zcpo-no-gate"].gate,
    ) == ("k1", False, False, False)
    modes = {
        label: build_run_config(parse_arm(label).config(demo.demo_config(tmp_path, tmp_path / "run", {}))).rollout
        for label in ("zcpo", "zcpo-overlap", "zcpo-async")
    }
    assert [rollout.mode for rollout in modes.values()] == ["sync", "overlap", "async"]


def test_overrides_follow_the_name_and_win(tmp_path):
    arm = parse_arm("dapo:algorithm.reward_norm=max_abs:train.optimizer.lr=3.7e-4")
    assert (arm.name, arm.overrides) == ("dapo", ("algorithm.reward_norm=max_abs", "train.optimizer.lr=3.7e-4"))
    config = build_run_config(arm.config(demo.demo_config(tmp_path, tmp_path / "run", {})))
    assert (config.algorithm.name, config.algorithm.reward_norm, config.train.optimizer.lr) == (
        "dapo",
        "max_abs",
        3.7e-4,
    )
    assert _algorithm(tmp_path, "zcpo:algorithm.beta=1").beta == 1.0
    assert arm.directory == "dapo+algorithm.reward_norm=max_abs+train.optimizer.lr=3.7e-4"
    # A ':' inside a value (module:function) stays in the value; commas inside brackets stay in the arm.
    assert parse_arm("zcpo:reward.function=pkg.mod:fn").overrides == ("reward.function=pkg.mod:fn",)
    assert split_arm_list("dapo, zcpo:diagnostics.families=[f1,f4],zcpo-std") == [
        "dapo",
        "zcpo:diagnostics.families=[f1,f4]",
        "zcpo-std",
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("dapo,zcp", "unknown arm 'zcp'; known arms: dapo, dapo-k3"),
        ("dapo,,zcpo", "an empty arm"),
        ("zcpo,dapo,zcpo", "arms 'zcpo' and 'zcpo' share the name"),
        ("zcpo:algorithm.beta", "'algorithm.beta' after 'zcpo:' is not a key=value override"),
        ("zcpo:", "nothing after ':'"),
        ("zcpo:model.path=/elsewhere", "model.path is set by the demo for every run"),
        ("zcpo:logging.run_dir=x", "logging.run_dir is set by the demo"),
    ],
)
def test_bad_arm_lists_name_the_problem(text, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_arms(text)


@pytest.mark.parametrize(
    "arms, message",
    [
        ("dapo,zcpo:algorithm.bta=1", "arm 'zcpo:algorithm.bta=1': unknown config key 'algorithm.bta'"),
        ("dapo,zcpo:algorithm.beta=-1", "arm 'zcpo:algorithm.beta=-1': algorithm.beta: must be >= 0"),
        ("dapo:algorithm.beta=1", "arm 'dapo:algorithm.beta=1': algorithm.beta=1.0 does not apply"),
        ("dapo:train.optimizer.lr=abc", "arm 'dapo:train.optimizer.lr=abc': train.optimizer.lr: expected a number"),
    ],
)
def test_every_arm_is_validated_before_anything_is_built(arms, message, monkeypatch, tmp_path):
    def no_build(*args, **kwargs):
        raise AssertionError("the warm-up must not be built for a bad arm")

    monkeypatch.setattr("megatron_zcpo.recipe.demo_assets.build_demo_assets", no_build)
    args = argparse.Namespace(
        compare=True,
        arms=arms,
        seed=1,
        seeds=2,
        out=str(tmp_path),
        steps=0,
        nproc=2,
        task="addition",
        diagnostics=None,
        jobs=1,
        reuse=False,
        lora=False,
    )
    with pytest.raises(ConfigError, match=message):
        demo.run(args)
    with pytest.raises(ConfigError, match="with --compare"):
        demo.run(argparse.Namespace(**{**vars(args), "compare": False}))
