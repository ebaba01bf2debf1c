"""Off-policy corrections per token: the update weighs each token against the log-prob of the policy that
sampled it (a response's tokens may come from several weight versions), never the trainer's recomputed one."""

import pytest
import torch

from megatron_zcpo.testing import run_distributed
from megatron_zcpo.training.config import ImportanceSamplingConfig
from megatron_zcpo.training.update import importance_weights
from tests.cases import trainer_cases


@pytest.fixture(scope="module")
def two_version_step():
    """One spawned trainer's answers for responses sampled by two weight versions (see the case)."""
    return run_distributed(trainer_cases.behaviour_token_weights, 1, ("truncate", "icepop"))[0]


def test_the_update_weighs_tokens_against_their_own_behaviour_logprobs(two_version_step):
    """Per-token ratios 3 then 1/4 within each response (two versions): truncated IS keeps 3 and clamps
    1/4 to 0.5; IcePop keeps 3 and zeroes 1/4. The trainer's recomputed log-probs would give 1 everywhere."""
    for mode in ("truncate", "icepop"):
        assert len(two_version_step[mode]) >= 3
        _check(mode, two_version_step[mode])


def test_zcpo_calibrates_a_group_of_several_versions_under_the_current_policy(two_version_step):
    """The README's statement: a group whose samples (and tokens) came from several weight versions is
    calibrated as one group, on the rewards and the drift the experience pass measures under the current
    policy; the behaviour policy never enters the coefficients (equal to on-policy ones) and each group's
    coefficients still sum to 0."""
    off_policy, on_policy, groups = two_version_step["calibration"]
    torch.testing.assert_close(off_policy, on_policy, atol=0, rtol=0)
    for group in groups.unique():
        assert abs(float(off_policy[groups == group].double().sum())) < 1e-6
    assert off_policy.abs().sum() > 0


def _check(mode, samples):
    for weight, old, behaviour in samples:
        half = len(weight) // 2
        late = 0.5 if mode == "truncate" else 0.0
        expected = torch.tensor([3.0] * half + [late] * (len(weight) - half))
        torch.testing.assert_close(weight, expected, atol=1e-4, rtol=1e-4)
        config = ImportanceSamplingConfig(enabled=True, mode=mode)
        ones = torch.ones(1, len(old))
        recomputed = importance_weights(old[None], old[None], ones, config)[0]
        assert torch.all(recomputed == 1.0) and not torch.allclose(weight, recomputed)
        torch.testing.assert_close(
            weight, importance_weights(old[None], behaviour[None].to(old.dtype), ones, config)[0], atol=1e-5, rtol=0
        )


def test_icepop_and_sequence_masking():
    old = torch.zeros(3, 4)
    # per-token ratios: row 0 inside [0.5, 5] but 6 at the end; row 1 geometric mean 4 (all tokens 4);
    # row 2 geometric mean 1 with tokens 2 and 1/2.
    ratios = torch.tensor([[1.0, 2.0, 0.6, 6.0], [4.0, 4.0, 4.0, 4.0], [2.0, 0.5, 2.0, 0.5]])
    behaviour, mask = -torch.log(ratios), torch.ones(3, 4)
    icepop = importance_weights(old, behaviour, mask, ImportanceSamplingConfig(enabled=True, mode="icepop"))
    torch.testing.assert_close(icepop[0], torch.tensor([1.0, 2.0, 0.6, 0.0]))  # the ratio inside, 0 outside
    sequence = ImportanceSamplingConfig(enabled=True, sequence_mask=True, sequence_lower=0.5, sequence_upper=2.0)
    weights = importance_weights(old, behaviour, mask, sequence)
    assert torch.all(weights[1] == 0)  # geometric mean 4 > 2: the whole response
    torch.testing.assert_close(weights[2], ratios[2])  # geometric mean 1: kept token by token
    torch.testing.assert_close(weights[0], torch.tensor([1.0, 2.0, 0.6, 5.0]))
