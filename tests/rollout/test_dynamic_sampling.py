"""Dynamic sampling on constructed groups: tie dropping, refilling, surplus, invalid groups, the cap, overlong handling."""

import pytest
import torch

from megatron_zcpo.data.dataset import PromptDataset
from megatron_zcpo.data.records import PromptRecord
from megatron_zcpo.rewards.config import RewardConfig
from megatron_zcpo.rewards.scorer import RewardBatch, RewardScorer
from megatron_zcpo.rollout.dynamic_sampling import (
    DynamicSamplingConfig,
    DynamicSamplingError,
    sample_groups,
    tied_groups,
)
from megatron_zcpo.rollout.engine import Completion, SamplingParams

EOS = 0


def scripted_records(outcomes):
    """One record per scripted group; outcomes[i] lists the G responses of prompt i as texts."""
    return [
        PromptRecord(uid=f"q{i}", messages=[{"role": "user", "content": f"q{i}"}], answer="7", prompt_ids=[i + 1])
        for i in range(len(outcomes))
    ]


class ScriptedEngine:
    """Answers prompt [i + 1] with the scripted response texts of group i (characters as token ids).

    A text ending in "..." is cut at the length limit; "<abort>" is an aborted request.
    """

    def __init__(self, outcomes):
        self.outcomes = outcomes
        self.calls = []

    def generate(self, prompts, params, n=1):
        self.calls.append(len(prompts))
        groups = []
        for prompt in prompts:
            texts = self.outcomes[prompt[0] - 1]
            assert len(texts) == n
            group = []
            for text in texts:
                reason = "abort" if text == "<abort>" else "length" if text.endswith("...") else "stop"
                ids = [ord(ch) for ch in text] + ([EOS] if reason == "stop" else [])
                group.append(Completion(list(prompt), ids, [-1.0] * len(ids), reason))
            groups.append(group)
        return groups


class CharTokenizer:
    def batch_decode(self, sequences, skip_special_tokens=True):
        return ["".join(chr(t) for t in ids if not (skip_special_tokens and t == EOS)) for ids in sequences]


def scripted_rewards(records, completions):
    """A model-free scorer: +1 for the text "right", -1 otherwise; aborted responses are invalid."""
    right = torch.tensor([[bytes(c.output_ids[:-1]) == b"right" for c in group] for group in completions])
    valid = torch.tensor([[c.finish_reason != "abort" for c in group] for group in completions])
    truncated = torch.tensor([[c.truncated for c in group] for group in completions])
    score = right.float() * 2 - 1
    return RewardBatch(score, score, torch.zeros_like(score), truncated, torch.zeros_like(valid), valid, valid.clone())


def _run(outcomes, num_groups, config, group_size=2):
    engine = ScriptedEngine(outcomes)
    stream = PromptDataset(scripted_records(outcomes), shuffle=False)
    params = SamplingParams(max_new_tokens=16)
    result = sample_groups(
        stream.next_batch,
        lambda records: engine.generate([r.prompt_ids for r in records], params, n=group_size),
        scripted_rewards,
        num_groups,
        config,
    )
    return result, engine


R, W = "right", "wrong"
MIXED, ALL_RIGHT, ALL_WRONG = [R, W], [R, R], [W, W]


def test_tied_groups():
    values = torch.tensor([[1.0, 1.0, 1.0], [1.0, -1.0, 1.0], [-1.0, -1.0, -1.0], [0.5, 0.5, 0.25]])
    assert tied_groups(values).tolist() == [True, False, True, False]
    assert tied_groups(torch.tensor([[3.0]])).tolist() == [True]  # one response: no contrast


def test_drops_tied_groups_and_refills_until_full():
    outcomes = [ALL_RIGHT, MIXED, ALL_WRONG, [W, R], ALL_RIGHT, ALL_WRONG, MIXED, MIXED]
    result, engine = _run(outcomes, num_groups=3, config=DynamicSamplingConfig())
    # round 1 asks 3 prompts (keeps q1), round 2 asks 2 (keeps q3), round 3 asks 1 (q5 ties), round 4 keeps q6
    assert engine.calls == [3, 2, 1, 1]
    assert [r.uid for r in result.records] == ["q1", "q3", "q6"]
    assert [[bytes(c.output_ids[:-1]).decode() for c in g] for g in result.completions] == [MIXED, [W, R], MIXED]
    assert torch.equal(result.rewards.score, torch.tensor([[1.0, -1.0], [-1.0, 1.0], [1.0, -1.0]]))
    assert result.metrics == {
        "dynamic_sampling/rounds": 4.0,
        "dynamic_sampling/prompts": 7.0,
        "dynamic_sampling/groups_kept": 3.0,
        "dynamic_sampling/groups_dropped_tied": 4.0,
        "dynamic_sampling/groups_dropped_invalid": 0.0,
        "dynamic_sampling/groups_surplus": 0.0,
        "dynamic_sampling/keep_rate": 3 / 7,
        "dynamic_sampling/cap_hit": 0.0,
    }


def test_oversampling_discards_the_surplus():
    result, engine = _run(
        [MIXED, MIXED, ALL_WRONG, MIXED], num_groups=2, config=DynamicSamplingConfig(oversample_factor=2.0)
    )
    assert engine.calls == [4]
    assert [r.uid for r in result.records] == ["q0", "q1"]
    assert result.rewards.num_groups == 2
    assert result.metrics["dynamic_sampling/groups_surplus"] == 1.0


def test_invalid_groups_are_dropped_even_without_tie_filtering():
    outcomes = [ALL_RIGHT, [R, "<abort>"], MIXED]
    result, _ = _run(outcomes, num_groups=2, config=DynamicSamplingConfig(drop_tied_groups=False))
    assert [r.uid for r in result.records] == ["q0", "q2"]
    assert result.metrics["dynamic_sampling/groups_dropped_invalid"] == 1.0
    assert result.metrics["dynamic_sampling/groups_dropped_tied"] == 0.0


def test_cap_hit_raises_with_a_clear_message():
    with pytest.raises(DynamicSamplingError) as error:
        _run([ALL_RIGHT, ALL_WRONG] * 4, num_groups=2, config=DynamicSamplingConfig(max_rounds=3))
    message = str(error.value)
    assert "kept 0 of 2 groups after 3 round(s) and 6 prompts (6 groups dropped with tied scores" in message
    assert "rollout.dynamic_sampling.max_rounds=3" in message and "rollout.dynamic_sampling.on_cap=partial" in message


def test_cap_hit_can_return_the_partial_batch():
    config = DynamicSamplingConfig(max_prompts=3, on_cap="partial")
    result, engine = _run([ALL_RIGHT, MIXED, ALL_WRONG, MIXED], num_groups=3, config=config)
    assert engine.calls == [3]  # the prompt cap stops the refill
    assert [r.uid for r in result.records] == ["q1"] and result.rewards.num_groups == 1
    assert result.metrics["dynamic_sampling/cap_hit"] == 1.0
    empty, _ = _run([ALL_WRONG] * 2, num_groups=1, config=DynamicSamplingConfig(max_rounds=2, on_cap="partial"))
    assert empty.records == [] and empty.rewards.reward.shape == (0, 2)


def test_filter_on_reward_counts_the_overlong_penalty():
    def penalised(records, completions):
        batch = scripted_rewards(records, completions)
        long = torch.tensor([[len(c.output_ids) > 6 for c in group] for group in completions])
        batch.overlong_penalty = -long.float()
        batch.reward = batch.score + batch.overlong_penalty
        return batch

    outcomes = [[W, W + "xxxx"]]  # both wrong, one long: tied scores, different rewards
    for filter_on, kept in (("score", []), ("reward", ["q0"])):
        config = DynamicSamplingConfig(filter_on=filter_on, max_rounds=1, on_cap="partial")
        stream = PromptDataset(scripted_records(outcomes), shuffle=False)
        engine = ScriptedEngine(outcomes)
        result = sample_groups(
            stream.next_batch,
            lambda recs, engine=engine: engine.generate([r.prompt_ids for r in recs], None, n=2),
            penalised,
            1,
            config,
        )
        assert [r.uid for r in result.records] == kept


def test_config_validate_names_bad_keys():
    with pytest.raises(ValueError) as error:
        DynamicSamplingConfig(filter_on="acc", oversample_factor=0.5, max_rounds=0, on_cap="ignore").validate()
    for key in ("filter_on", "oversample_factor", "max_rounds", "on_cap"):
        assert f"rollout.dynamic_sampling.{key}" in str(error.value)


def test_overlong_handling_and_real_rewards_on_constructed_groups():
    """The real math reward in the worker pool, the overlong penalty (L_max 16, buffer 4: free up to 12
    tokens) and overlong filtering inside dynamic sampling: tie filtering on the score ignores the penalty."""
    long_wrong = "\\boxed{6}xxx"  # 12 characters + EOS = 13 tokens: a quarter into the buffer
    outcomes = [
        ["\\boxed{7}", "\\boxed{8}"],  # mixed: kept
        [long_wrong, "\\boxed{6}"],  # all wrong with different penalties: tied score, dropped
        ["\\boxed{7}", "\\boxed{5}xxxxx..."],  # mixed; the second is cut at the limit (17 tokens)
    ]
    config = RewardConfig(num_workers=1, max_response_length=16, overlong_buffer=4)
    with RewardScorer(config) as scorer:
        engine = ScriptedEngine(outcomes)
        records = scripted_records(outcomes)
        result = sample_groups(
            PromptDataset(records, shuffle=False).next_batch,
            lambda recs: engine.generate([r.prompt_ids for r in recs], SamplingParams(), n=2),
            lambda recs, completions: scorer.score_completions(recs, completions, CharTokenizer()),
            num_groups=2,
            config=DynamicSamplingConfig(),
        )
    assert [r.uid for r in result.records] == ["q0", "q2"]
    rewards = result.rewards
    assert torch.equal(rewards.score, torch.tensor([[1.0, -1.0], [1.0, -1.0]]))
    assert torch.equal(rewards.overlong_penalty, torch.tensor([[0.0, 0.0], [0.0, -1.0]]))
    assert torch.equal(rewards.reward, torch.tensor([[1.0, -1.0], [1.0, -2.0]]))
    assert torch.equal(rewards.truncated, torch.tensor([[False, False], [False, True]]))
    assert torch.equal(rewards.loss_mask, torch.tensor([[True, True], [True, False]]))
    assert result.metrics["dynamic_sampling/groups_dropped_tied"] == 1.0
