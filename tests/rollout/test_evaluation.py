"""Evaluation: unbiased pass@k and avg@k against hand-computed values, per-source results and the JSON file."""

import json

import pytest
import torch

from megatron_zcpo.rollout.engine import SamplingParams
from megatron_zcpo.rollout.evaluation import evaluate, pass_at_k
from tests.rollout.test_dynamic_sampling import ScriptedEngine, scripted_records, scripted_rewards

R, W = "right", "wrong"


def test_pass_at_k_hand_computed():
    n = torch.tensor([5, 5, 5, 5, 5, 5, 1000, 1000])
    c = torch.tensor([2, 2, 2, 2, 0, 5, 1, 1])
    # k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10; k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10; k=4: n - c < k, so 1
    for k, expected in [
        (1, [0.4, 0.4, 0.4, 0.4, 0.0, 1.0, 0.001, 0.001]),
        (2, [0.7, 0.7, 0.7, 0.7, 0.0, 1.0, 0.002, 0.002]),
        (3, [0.9, 0.9, 0.9, 0.9, 0.0, 1.0, 0.003, 0.003]),
    ]:
        torch.testing.assert_close(
            pass_at_k(n, c, k), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12
        )
    assert pass_at_k(torch.tensor([5]), torch.tensor([2]), 4).item() == 1.0
    # 1 - C(999, 500) / C(1000, 500) = 1 - 500/1000, through log-gamma without overflow
    assert abs(pass_at_k(torch.tensor([1000]), torch.tensor([1]), 500).item() - 0.5) < 1e-9


def test_pass_at_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="1 <= k <= samples"):
        pass_at_k(torch.tensor([3]), torch.tensor([1]), 4)
    with pytest.raises(ValueError, match="num_correct must be in"):
        pass_at_k(torch.tensor([3]), torch.tensor([4]), 1)


def test_evaluate_avg_and_pass_at_k(tmp_path):
    outcomes = [[R, R, R, R], [W, R, W, W], [W, W, W, "wrong..."]]
    records = scripted_records(outcomes)
    for record, source in zip(records, ["aime24", "aime24", "aime25"]):
        record.data_source = source
    engine = ScriptedEngine(outcomes)
    params = SamplingParams(temperature=1.0, top_p=0.7, max_new_tokens=8)
    output = tmp_path / "eval" / "result.json"
    result = evaluate(
        engine, records, scripted_rewards, params, k=4, pass_ks=[1, 2, 4], batch_size=2, output_path=str(output)
    )

    assert engine.calls == [2, 1]
    # correct counts 4, 1, 0 of 4: avg@4 = (1 + 1/4 + 0) / 3; pass@2 = (1 + (1 - C(3,2)/C(4,2)) + 0) / 3
    assert result["avg@4"] == pytest.approx(1.25 / 3, abs=1e-12)
    assert result["pass@1"] == pytest.approx(1.25 / 3, abs=1e-12)
    assert result["pass@2"] == pytest.approx(1.5 / 3, abs=1e-12)
    assert result["pass@4"] == pytest.approx(2 / 3, abs=1e-12)
    assert result["by_source"]["aime24"] == pytest.approx(
        {"num_problems": 2, "avg@4": 0.625, "pass@1": 0.625, "pass@2": 0.75, "pass@4": 1.0}
    )
    assert result["by_source"]["aime25"]["avg@4"] == 0.0
    assert [p["num_correct"] for p in result["problems"]] == [4, 1, 0]
    assert result["num_samples"] == 12 and result["failed_samples"] == 0
    assert result["truncated_fraction"] == pytest.approx(1 / 12)
    assert result["sampling"]["top_p"] == 0.7
    assert json.loads(output.read_text()) == json.loads(json.dumps(result))


def test_failed_reward_calls_count_as_wrong():
    def failing_first(records, completions):
        batch = scripted_rewards(records, completions)
        batch.failed[:, 0] = True  # on_failure="zero"/"min" would leave the score as it is here
        return batch

    outcomes = [[R, R]]
    result = evaluate(ScriptedEngine(outcomes), scripted_records(outcomes), failing_first, SamplingParams(), k=2)
    assert result["avg@2"] == 0.5 and result["failed_samples"] == 1
    assert set(result) >= {"pass@1", "pass@2"}


def test_evaluate_needs_tokenized_records_and_valid_k():
    records = scripted_records([[R]])
    with pytest.raises(ValueError, match="pass@j with 1 <= j <= k"):
        evaluate(ScriptedEngine([[R]]), records, scripted_rewards, SamplingParams(), k=1, pass_ks=[2])
    records[0].prompt_ids = []
    with pytest.raises(ValueError, match=r"without prompt_ids .*\['q0'\]"):
        evaluate(ScriptedEngine([[R]]), records, scripted_rewards, SamplingParams(), k=1)
