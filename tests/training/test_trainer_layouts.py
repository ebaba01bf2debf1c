"""The trainer gives the same coefficients, losses and parameters at every TP/PP/DP layout."""

import pytest
import torch

from megatron_zcpo.testing import run_distributed
from tests.cases import trainer_cases

LAYOUTS = [
    pytest.param(2, 1, 2, id="TP2"),
    pytest.param(1, 2, 2, id="PP2"),
    pytest.param(1, 1, 2, id="DP2"),
    pytest.param(2, 2, 4, id="TP2xPP2"),
]
COMPARED = (
    "update/loss",
    "update/policy_loss",
    "update/grad_norm",
    "experience/kl",
    "experience/entropy",
    "coef/coef_abs_mean",
    "coef/drift_mean",
    "coef/active_group_fraction",
)


@pytest.fixture(scope="module")
def single(weights):
    return run_distributed(trainer_cases.one_update, 1, 1, 1, *weights)[0]


def test_single_process_step_is_meaningful(single, weights):
    metrics = single["metrics"]
    assert metrics["experience/kl"] > 1e-3  # policy and reference differ
    coefficients = single["coefficients"]
    samples = trainer_cases.rollout()
    tied = [i for i, s in enumerate(samples) if s.group_id == 102]
    assert torch.all(coefficients[tied] == 0)  # the all-tied group is gated out
    for group in {s.group_id for s in samples} - {102}:
        members = [i for i, s in enumerate(samples) if s.group_id == group]
        assert abs(float(coefficients[members].sum())) < 1e-5  # zero-sum per active group
    moved = max((single["params"][n] - w).abs().max().item() for n, w in weights[0].items())
    assert moved > 1e-4


@pytest.mark.parametrize("tp,pp,world", LAYOUTS)
def test_layout_matches_single_process(single, weights, tp, pp, world):
    results = run_distributed(trainer_cases.one_update, world, tp, pp, *weights)
    _assert_same_step(results, single)
    if world == 2 and tp == pp == 1:
        # DP=2 splits at least one group across the two ranks, and the coefficients above still
        # equal the single-process ones: calibration sees whole groups through the gather.
        mine = [set(r["groups_of_mine"]) for r in results]
        assert mine[0] & mine[1]


def _assert_same_step(results, single):
    for rank, result in enumerate(results):
        for name in COMPARED:
            assert result["metrics"][name] == pytest.approx(single["metrics"][name], rel=1e-5, abs=1e-6), (rank, name)
        if result["coefficients"] is not None:
            torch.testing.assert_close(result["coefficients"], single["coefficients"], atol=1e-6, rtol=0)
        for name, value in single["params"].items():
            torch.testing.assert_close(result["params"][name], value, atol=1e-5, rtol=0, msg=name)


def test_padded_micro_batches_match_packed(single, weights):
    """train.packing=padded (right-padded rows, megatron's DotProductAttention) == THD packing."""
    _assert_same_step(run_distributed(trainer_cases.one_update, 1, 1, 1, *weights, packing="padded"), single)


CONTEXT_LAYOUTS = [
    pytest.param(1, 1, 2, id="CP2"),
    pytest.param(2, 1, 4, id="CP2xTP2"),
    pytest.param(1, 2, 4, id="CP2xPP2"),
]


@pytest.mark.parametrize("tp,pp,world", CONTEXT_LAYOUTS)
def test_context_parallel_matches_single_process(single, weights, tp, pp, world):
    """Each sequence split into 2*CP chunks over the CP ranks: same coefficients, losses, parameters."""
    results = run_distributed(trainer_cases.one_update, world, tp, pp, *weights, cp=2)
    _assert_same_step(results, single)


def test_context_parallel_importance_sampling_veto(weights):
    """The sequence-level veto sees every CP rank's tokens of a response (an OR over the CP group)."""
    correction = {"veto": 0.05}  # vetoes some responses through a single token
    single = run_distributed(trainer_cases.one_update, 1, 1, 1, *weights, importance_sampling=correction)[0]
    results = run_distributed(trainer_cases.one_update, 2, 1, 1, *weights, cp=2, importance_sampling=correction)
    _assert_same_step(results, single)
    assert single["metrics"]["rollout/logprob_diff"] > 1.0  # the engine's log-probs really differ


def test_context_parallel_refuses_what_needs_whole_responses(weights):
    from megatron_zcpo.testing import DistributedTestFailure

    for overrides, needle in (
        ({"packing": "padded"}, "train.packing"),
        ({"algorithm": "gvpo"}, "sum over tokens"),
        ({"agg": "seq-mean-token-mean"}, "seq-mean-token-mean"),
    ):
        with pytest.raises(DistributedTestFailure, match=needle):
            run_distributed(trainer_cases.build, 2, 1, 1, *weights, cp=2, **overrides)


@pytest.mark.parametrize("tp,pp,world", [pytest.param(1, 1, 1, id="single"), pytest.param(2, 2, 4, id="TP2xPP2")])
def test_gradient_probe_matches_update_gradient(weights, tp, pp, world):
    for probed, update_norm in run_distributed(trainer_cases.probe_norm, world, tp, pp, *weights):
        assert probed == pytest.approx(update_norm, rel=1e-5)
        assert probed > 0


def _qwen3_weights(rank, world):
    return trainer_cases.weights(21, trainer_cases.QWEN3), trainer_cases.weights(22, trainer_cases.QWEN3)


def test_gradient_probe_sums_qwen3_qk_norm_gradients_over_tensor_parallel_ranks():
    """Each TP rank holds half the heads, so half of every q/k-norm gradient: the probe must add them."""
    policy, reference = run_distributed(_qwen3_weights, 1)[0]
    [(single, _)] = run_distributed(trainer_cases.probe_norm, 1, 1, 1, policy, reference, trainer_cases.QWEN3)
    for probed, update_norm in run_distributed(
        trainer_cases.probe_norm, 2, 2, 1, policy, reference, trainer_cases.QWEN3
    ):
        assert probed == pytest.approx(update_norm, rel=1e-5) and probed == pytest.approx(single, rel=1e-5)


def test_step0_selfcheck(weights):
    for metrics, error in run_distributed(trainer_cases.selfcheck, 2, 2, 1, *weights):
        # Identical models; a last-ulp difference remains possible where the policy's parameters sit in
        # DDP's contiguous buffer and the GEMM kernel depends on alignment (seen on Xeon, not on EPYC).
        assert metrics["selfcheck/kl_max"] <= 1e-12 and metrics["selfcheck/logprob_gap_max"] <= 1e-6
        assert error is not None and "step-0 self-check failed" in error


def test_importance_weights_truncate_mask_and_veto():
    from megatron_zcpo.training.config import ImportanceSamplingConfig
    from megatron_zcpo.training.update import importance_weights

    old = torch.log(torch.full((2, 4), 0.5))
    # pi_old / pi_rollout per token: row 0 = 10, 1, 0.5/0.9, (masked); row 1 has 5e-5 < veto 1e-4.
    rollout = torch.log(torch.tensor([[0.05, 0.5, 0.9, 0.2], [0.5, 0.5, 1e4, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    truncated = importance_weights(old, rollout, mask, ImportanceSamplingConfig(enabled=True))
    torch.testing.assert_close(truncated[0], torch.tensor([5.0, 1.0, 0.5 / 0.9, 0.0]))  # 10 -> upper 5
    assert torch.all(truncated[1] == 0)  # the whole vetoed sequence
    masked = importance_weights(old, rollout, mask, ImportanceSamplingConfig(enabled=True, mode="mask"))
    torch.testing.assert_close(masked[0], torch.tensor([0.0, 1.0, 1.0, 0.0]))  # outside [0.5, 5] -> 0


def test_bf16_training_with_distributed_optimizer():
    dtypes, steps = run_distributed(trainer_cases.bf16_steps, 2, 2)[0]
    assert dtypes == {torch.bfloat16}
    first, second = steps
    assert first["selfcheck/kl_max"] == 0.0  # identical bf16 policy and reference
    assert first["update/grad_norm"] > 0 and second["experience/kl"] > 0  # the policy moved
