"""zcpo report's curves: runs of a method with several seeds become their mean with a standard-error band."""

import math
from dataclasses import dataclass, field

import pytest

from megatron_zcpo.cli.report_curves import curves_of, write_curves


@dataclass
class FakeRun:
    name: str
    method: str
    values: dict  # step -> value of "rollout/reward_mean"
    gpu_hours: object = None
    records: list = field(default_factory=list)

    def keys(self):
        return ["rollout/reward_mean"]

    def series(self, key, budget=math.inf):
        steps = sorted(self.values)
        return steps, [self.values[s] for s in steps]


def test_seeds_of_a_method_become_mean_and_standard_error():
    runs = [
        FakeRun("a1", "dapo", {1: 0.0, 2: 1.0}),
        FakeRun("a2", "dapo", {1: 2.0, 2: 1.0}),
        FakeRun("b1", "zcpo", {1: 5.0, 2: 6.0}),
        FakeRun("b2", "zcpo", {1: 7.0}),
    ]
    curves = {label: rest for label, *rest in curves_of(runs, "rollout/reward_mean")}
    steps, mean, error = curves["dapo (n=2)"]
    assert steps == [1, 2] and mean == [1.0, 1.0]
    assert error[0] == pytest.approx(math.sqrt(2.0) / math.sqrt(2)) and error[1] == 0.0
    steps, mean, error = curves["zcpo (n=2)"]
    assert mean == [6.0, 6.0] and error == [pytest.approx(1.0), 0.0]  # step 2: one run, no spread


def test_single_runs_keep_their_own_curves(tmp_path):
    runs = [FakeRun("a", "dapo", {1: 0.0, 2: 1.0}), FakeRun("b", "zcpo", {1: 2.0})]
    assert curves_of(runs, "rollout/reward_mean") == [("a", [1, 2], [0.0, 1.0], None), ("b", [1], [2.0], None)]
    assert write_curves(runs, tmp_path / "c.png").stat().st_size > 0
