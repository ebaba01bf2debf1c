"""Bad engine outputs (ids outside the vocabulary, NaN/positive log-probs, mismatched ids) are rejected, named and bounded."""

import math

import pytest

from megatron_zcpo.rollout.dynamic_sampling import DynamicSamplingConfig, sample_groups
from megatron_zcpo.rollout.engine import RolloutError, SamplingParams
from megatron_zcpo.rollout.output_checks import engine_output_problem
from megatron_zcpo.rollout.sglang.client import SGLangEngine
from megatron_zcpo.testing.mock_server import MockSGLangServer
from tests.rollout.sglang.test_sglang_client import ScriptedEngine, _config

VOCAB = 97  # ScriptedEngine's tokens are < 97


@pytest.mark.parametrize(
    "corruption,problem",
    [
        ("bad_token", "token id 1000000000 at position 1 is outside the vocabulary [0, 97)"),
        ("nan_logprob", "log-prob nan of token 4 at position 1 is not a finite value <= 0"),
        ("positive_logprob", "log-prob 0.5 of token 4 at position 1 is not a finite value <= 0"),
        ("mismatched_ids", "output_ids has token 4 at position 1 but output_token_logprobs has 5"),
    ],
)
def test_bad_answer_is_rejected_naming_server_request_and_position(corruption, problem):
    with (
        MockSGLangServer(ScriptedEngine(), faults={"/generate": [corruption]}) as server,
        SGLangEngine(_config(server.url, vocab_size=VOCAB, max_rejected_fraction=0.5)) as engine,
    ):
        [[bad, good]] = engine.generate([[2]], SamplingParams(max_new_tokens=3), n=2)
        assert (bad.finish_reason, bad.output_ids, bad.output_logprobs) == ("abort", [], [])
        assert bad.info["rejected"] == f"server {server.url}, request {bad.info['rid']}: {problem}"
        assert good.output_ids == [3, 4, 5] and "rejected" not in good.info
        assert engine.rejected_samples == 1


def test_rejected_sample_drops_its_group_from_the_batch():
    """The rejected response's group is invalid: dynamic sampling draws another instead of training on part of it."""
    import torch

    from megatron_zcpo.data.records import PromptRecord
    from megatron_zcpo.rewards.scorer import RewardBatch

    def score(_, groups):  # every response scores 1; an aborted (rejected) one is not valid
        valid = torch.tensor([[c.finish_reason != "abort" for c in group] for group in groups])
        ones = valid.float()
        return RewardBatch(ones, ones, torch.zeros_like(ones), ~valid & False, ~valid & False, valid, valid.clone())

    records = iter(PromptRecord(uid=str(i), messages=[], answer="", prompt_ids=[i + 1]) for i in range(100))
    with (
        MockSGLangServer(ScriptedEngine(), faults={"/generate": ["nan_logprob"]}) as server,
        SGLangEngine(_config(server.url, vocab_size=VOCAB, max_rejected_fraction=0.5, max_concurrency=1)) as engine,
    ):
        result = sample_groups(
            next_prompts=lambda count: [next(records) for _ in range(count)],
            generate=lambda rs: engine.generate([r.prompt_ids for r in rs], SamplingParams(max_new_tokens=2), n=2),
            score=score,
            num_groups=2,
            config=DynamicSamplingConfig(drop_tied_groups=False),
        )
    assert result.metrics["dynamic_sampling/groups_dropped_invalid"] == 1
    assert [r.uid for r in result.records] == ["1", "2"]  # prompt 0's group held the rejected sample
    assert all(c.finish_reason != "abort" for group in result.completions for c in group)


def test_too_many_rejections_stop_the_rollout():
    faults = {"/generate": ["bad_token", "bad_token"]}
    with (
        MockSGLangServer(ScriptedEngine(), faults=faults) as server,
        SGLangEngine(_config(server.url, vocab_size=VOCAB, max_rejected_fraction=0.25)) as engine,
    ):
        with pytest.raises(
            RolloutError,
            match=r"2 of 4 samples rejected, more than rollout\.sglang\.client\."
            r"max_rejected_fraction = 0\.25: server http://.*outside the vocab",
        ):
            engine.generate([[1], [2]], SamplingParams(max_new_tokens=3), n=2)


def test_output_problem_checks():
    assert engine_output_problem([1, 2], [-0.1, -0.0], [1, 2], vocab_size=3) is None
    assert engine_output_problem([1, 2], [-0.1], [1], vocab_size=None) == "1 log-probs for 2 tokens"
    assert (
        engine_output_problem([-1], [-0.1], [-1], vocab_size=5)
        == "token id -1 at position 0 is outside the vocabulary [0, 5)"
    )
    assert "log-prob inf" in engine_output_problem([1], [math.inf], [1], vocab_size=None)
