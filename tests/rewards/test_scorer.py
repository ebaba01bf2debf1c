"""Rewards: math-verify answers, the overlong penalty and mask, and the worker pool under misbehaving reward functions."""

import dataclasses
import threading
import time

import pytest
import torch

from megatron_zcpo.rewards.config import RewardConfig
from megatron_zcpo.rewards.math import dapo_math_reward
from megatron_zcpo.rewards.overlong import overlong_loss_mask, overlong_penalty
from megatron_zcpo.rewards.pool import RewardFunctionLoadError, resolve_function
from megatron_zcpo.rewards.scorer import RewardError, RewardFailureRateError, RewardScorer

SCRIPTED = "tests.rewards.scripted_rewards:scripted_reward"
FAR_APART = "\\boxed{3} was my first guess. " + "But wait, let me recheck every step of it. " * 3 + "So \\boxed{4}."


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "1/2", 1.0),  # fraction
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # decimal vs LaTeX fraction
        ("\\boxed{\\dfrac{2}{4}}", "1/2", 1.0),  # unreduced \dfrac
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # equivalent radicals
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),  # equivalent expressions
        ("$\\boxed{-4}$.", "-4", 1.0),  # boxed inside math mode
        ("\\boxed{1,000}", "1000", 1.0),  # thousands separator
        ("\\boxed{34 \\text{ cm}}", "34", 1.0),  # units
        (FAR_APART, "4", 1.0),  # the last boxed answer decides
        (FAR_APART, "3", -1.0),
        ("\\boxed{35}", "34", -1.0),  # wrong
        ("\\boxed{3.14}", "\\pi", -1.0),  # close is not equal
        ("The answer is 34.", "34", -1.0),  # neither a boxed answer nor an "Answer:" line
        ("Work...\nAnswer: $34$", "34", 1.0),  # DAPO-Math-17K's requested last line
        ("Answer: 12\nno wait\nanswer: \\frac{1}{2}", "0.5", 1.0),  # the last "Answer:" line decides
        ("Answer: 35", "34", -1.0),
        ("Answer:", "34", -1.0),  # empty answer
        ("\\boxed{}", "34", -1.0),  # empty box
        ("\\boxed{\\frac{1}{2}", "1/2", -1.0),  # unbalanced box
    ],
)
def test_dapo_math_reward(response, ground_truth, expected):
    assert dapo_math_reward(response, ground_truth, {}) == expected


def test_math_reward_runs_off_the_main_thread():
    # math-verify's own signal timeouts would raise ValueError here; they are disabled
    results = []
    thread = threading.Thread(target=lambda: results.append(dapo_math_reward("\\boxed{\\frac{6}{4}}", "1.5", {})))
    thread.start()
    thread.join()
    assert results == [1.0]


def test_overlong_penalty_matches_dapo():
    lengths = torch.tensor([0, 16, 17, 18, 20, 25])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert torch.equal(overlong_penalty(lengths, max_length=20, buffer_length=4), expected)
    assert torch.equal(overlong_penalty(lengths, 20, 4, penalty_factor=0.5), 0.5 * expected)
    # the paper's setting: 16,384 free tokens, then (16384 - T) / 4096 down to -1 at 20,480
    paper = overlong_penalty(torch.tensor([16384, 17408, 18432, 20480]), max_length=20480, buffer_length=4096)
    assert torch.equal(paper, torch.tensor([0.0, -0.25, -0.5, -1.0]))
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(lengths, max_length=4, buffer_length=8)


def test_overlong_loss_mask_drops_truncated_responses():
    truncated = torch.tensor([[True, False], [False, True]])
    assert torch.equal(overlong_loss_mask(truncated), ~truncated)
    with pytest.raises(TypeError, match="bool"):
        overlong_loss_mask(truncated.int())


@pytest.fixture(scope="module")
def scorer():
    config = RewardConfig(function=SCRIPTED, num_workers=2, timeout_s=1.0, overlong_penalty=False)
    with RewardScorer(config) as scorer:
        yield scorer


def _score(scorer, responses, ground_truths, **config_changes):
    """Score P groups with the given config changes; every response is 3 tokens, none truncated."""
    scorer.config = dataclasses.replace(scorer.config, **config_changes).validate()
    shape = (len(responses), len(responses[0]))
    metadata = [{"uid": f"q{p}"} for p in range(len(responses))]
    return scorer.score(responses, ground_truths, torch.full(shape, 3), torch.zeros(shape, dtype=torch.bool), metadata)


def test_scores_and_overlong_shaping(scorer):
    scorer.config = dataclasses.replace(scorer.config, overlong_penalty=True, max_response_length=20, overlong_buffer=4)
    lengths = torch.tensor([[10, 18], [20, 5]])
    truncated = torch.tensor([[False, False], [True, False]])
    batch = scorer.score([["a", "b"], ["c", "c"]], ["a", "c"], lengths, truncated)
    assert torch.equal(batch.score, torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    assert torch.equal(batch.overlong_penalty, torch.tensor([[0.0, -0.5], [-1.0, 0.0]]))
    assert torch.equal(batch.reward, batch.score + batch.overlong_penalty)
    assert torch.equal(batch.loss_mask, torch.tensor([[True, True], [False, True]]))
    metrics = batch.metrics()
    assert metrics["reward/mean"] == pytest.approx((1.0 - 0.5 + 0.0 + 1.0) / 4)
    assert (metrics["reward/truncated_fraction"], metrics["reward/failed"]) == (0.25, 0.0)
    scorer.config = dataclasses.replace(scorer.config, overlong_filter=False)
    assert bool(scorer.score([["a", "b"], ["c", "c"]], ["a", "c"], lengths, truncated).loss_mask.all())
    scorer.config = dataclasses.replace(scorer.config, overlong_penalty=False, overlong_filter=True)


def test_crashing_reward_function_is_handled_by_config(scorer):
    responses, truths = [["a", "b"], ["crash", "c"]], ["a", "c"]
    with pytest.raises(RewardError, match=r"prompt 1 \(uid q1\), response 0.*\n(.|\n)*scripted crash for q1"):
        _score(scorer, responses, truths, on_failure="error")
    zero = _score(scorer, responses, truths, on_failure="zero")
    assert torch.equal(zero.score, torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert torch.equal(zero.failed, torch.tensor([[False, False], [True, False]]))
    minimum = _score(scorer, responses, truths, on_failure="min", min_reward=-1.0)
    assert torch.equal(minimum.score, torch.tensor([[1.0, 0.0], [-1.0, 1.0]]))
    skipped = _score(scorer, responses, truths, on_failure="skip-group")
    assert torch.equal(skipped.valid, torch.tensor([[True, True], [False, False]]))
    assert torch.equal(skipped.loss_mask, skipped.valid)
    assert torch.equal(skipped.reward[1], torch.zeros(2))


def test_a_rollout_whose_reward_calls_fail_too_often_is_stopped_below_the_threshold_counted(scorer):
    """reward.max_failed_fraction: 1 failure in 10 calls is counted (metrics); 2 in 10 stop the rollout
    with the count, the failing input and the reward's own error."""
    truths = ["a"] * 5
    scorer.start_tally()
    _score(scorer, [["crash", "a"]] + [["a", "b"]] * 4, truths, on_failure="min", max_failed_fraction=0.1)
    assert scorer.check_failure_rate("step 0's rollout") == {"reward/failed_calls": 1.0, "reward/failed_fraction": 0.1}
    scorer.start_tally()
    _score(scorer, [["crash", "crash"]] + [["a", "b"]] * 4, truths, on_failure="min", max_failed_fraction=0.1)
    with pytest.raises(
        RewardFailureRateError,
        match=r"failed on 2 of the 10 responses of step 3's rollout \(20%, "
        r"above reward.max_failed_fraction=0.1\)(.|\n)*prompt 0 \(uid q0\), "
        r"response 0 \(error\): response 'crash', ground truth 'a'"
        r"(.|\n)*ValueError: scripted crash for q0$",
    ):
        scorer.check_failure_rate("step 3's rollout")


def test_hanging_reward_function_is_killed_and_replaced_off_the_main_thread(scorer):
    restarts = scorer.pool.restarts
    outcome = []
    start = time.monotonic()
    # scored from a worker thread: the pool's timeout needs no signals
    thread = threading.Thread(
        target=lambda: outcome.append(_score(scorer, [["hang", "a", "a"]], ["a"], on_failure="zero"))
    )
    thread.start()
    thread.join(timeout=30)
    elapsed = time.monotonic() - start
    assert outcome, "scoring did not return"
    assert torch.equal(outcome[0].failed, torch.tensor([[True, False, False]]))
    assert torch.equal(outcome[0].score, torch.tensor([[0.0, 1.0, 1.0]]))
    assert scorer.pool.restarts == restarts + 1
    assert elapsed < 1.0 + 10.0, f"the 1 s timeout took {elapsed:.1f} s"
    # the pool keeps working with the replacement worker
    assert torch.equal(_score(scorer, [["a", "b"]], ["a"]).score, torch.tensor([[1.0, 0.0]]))


def test_reward_function_that_kills_its_worker(scorer):
    batch = _score(scorer, [["exit", "a"]], ["a"], on_failure="min", min_reward=-2.0)
    assert torch.equal(batch.score, torch.tensor([[-2.0, 1.0]]))
    assert bool(batch.failed[0, 0])


@pytest.mark.parametrize("on_failure", ["zero", "skip-group"])
def test_nan_reward_is_an_error_naming_the_sample(scorer, on_failure):
    with pytest.raises(RewardError, match=r"NaN for prompt 1 \(uid q1\), response 1; response begins 'nan'"):
        _score(scorer, [["a", "a"], ["a", "nan"]], ["a", "a"], on_failure=on_failure)


def test_non_number_reward_is_an_error(scorer):
    with pytest.raises(RewardError, match=r"str 'not a number' for prompt 0 \(uid q0\), response 0; expected a number"):
        _score(scorer, [["text"]], ["a"], on_failure="zero")


def test_resolve_function_paths():
    assert resolve_function(SCRIPTED) is resolve_function(SCRIPTED.replace(":", "."))
    with pytest.raises(RewardFunctionLoadError, match="cannot import module 'no_such_module'"):
        resolve_function("no_such_module:f")
    with pytest.raises(RewardFunctionLoadError, match="has no attribute 'missing'"):
        resolve_function("megatron_zcpo.rewards.math:missing")
    with pytest.raises(RewardFunctionLoadError, match="is a tuple, not a callable"):
        resolve_function("megatron_zcpo.rewards.config:ON_FAILURE_CHOICES")
    with pytest.raises(RewardFunctionLoadError, match="must look like"):
        resolve_function("nodots")


def test_reward_config_validate_names_bad_keys():
    RewardConfig().validate()
    with pytest.raises(ValueError) as error:
        RewardConfig(timeout_s=0, on_failure="ignore", num_workers=0, overlong_buffer=30000).validate()
    message = str(error.value)
    for key in ("reward.timeout_s", "reward.on_failure", "reward.num_workers", "reward.overlong_buffer"):
        assert key in message
