"""The diagnostics' pure statistics, config and branch split on hand-made inputs with closed-form answers."""

import math

import pytest
import torch

from megatron_zcpo.algorithms import AlgorithmConfig, ResponseStats, build_algorithm
from megatron_zcpo.diagnostics import DiagnosticsConfig, KLDiagnostics, build_diagnostics
from megatron_zcpo.diagnostics.branches import BranchSplit, restrict
from megatron_zcpo.diagnostics.statistics import (
    branch_geometry,
    cancellation_rate,
    decile_medians,
    pearson,
    position_profile,
    top_shares,
)

# ------------------------------------------------------------------------------------------ F6


def _sorted_top_share(values, fraction):
    values = values.clamp(min=0).double()
    k = math.ceil(fraction * values.numel())
    return float(values.sort(descending=True).values[:k].sum() / values.sum())


def test_top_shares_on_hand_made_kl_vectors():
    one_spike = torch.zeros(200)
    one_spike[17] = 3.0
    assert top_shares(one_spike, [0.01, 0.1]).tolist() == [1.0, 1.0]
    flat = torch.full((100,), 0.25)
    assert top_shares(flat, [0.01, 0.1]).tolist() == pytest.approx([0.01, 0.1], abs=1e-15)
    ramp = torch.arange(1.0, 101.0)  # top 1 token: 100/5050; top 10: 91 + ... + 100 = 955
    assert top_shares(ramp, [0.01, 0.1]).tolist() == pytest.approx([100 / 5050, 955 / 5050], rel=1e-12)
    # ties at the k-th value count exactly k tokens; negatives (rounding) count as 0
    tied = torch.tensor([5.0, 2.0, 2.0, 2.0, -1e-9] + [0.0] * 5)
    assert top_shares(tied, [0.2, 0.3]).tolist() == pytest.approx([7 / 11, 9 / 11], rel=1e-12)
    assert math.isnan(top_shares(torch.zeros(10), [0.1])[0])


def test_top_shares_match_sorting_on_random_kl():
    generator = torch.Generator().manual_seed(0)
    values = torch.rand(1234, generator=generator).pow(6) * 1e-3  # heavy-tailed, tiny: like real KLs
    for fraction in (0.001, 0.01, 0.1, 0.5, 1.0):
        assert float(top_shares(values, [fraction])[0]) == pytest.approx(_sorted_top_share(values, fraction), rel=1e-9)


def test_top_shares_reduce_adds_ranks():
    """Two 'ranks' holding halves of a vector, summed by a reduce that adds the other half's partials."""
    values = torch.arange(1.0, 41.0)
    halves = values[::2], values[1::2]
    import threading

    # lock-step: each reduce returns the sum of what both halves hand in at the same call

    barrier, slots, results = threading.Barrier(2), [None, None], [None, None]

    def worker(rank):
        def reduce(tensor):
            slots[rank] = tensor
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total

        results[rank] = top_shares(halves[rank], [0.05, 0.25], reduce)

    threads = [threading.Thread(target=worker, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    expected = [_sorted_top_share(values, 0.05), _sorted_top_share(values, 0.25)]
    for result in results:
        assert result.tolist() == pytest.approx(expected, rel=1e-12)


def test_position_profile_buckets():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 20.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    profile = position_profile(values, mask, [1, 3])  # [0,1), [1,3), [3,inf)
    assert profile[0].tolist() == [11.0, 25.0, 9.0]
    assert profile[1].tolist() == [2.0, 3.0, 2.0]


# ------------------------------------------------------------------------------------------ F2, F4/F5, shares


def test_branch_geometry():
    geometry = branch_geometry(9.0, 16.0, 0.0)  # g_R = (3, 0), g_K = (0, 4)
    assert [float(v) for v in geometry] == pytest.approx([3.0, 4.0, 5.0, 0.0, 0.8])
    opposed = branch_geometry(1.0, 1.0, -1.0)  # g_K = -g_R: the total vanishes, the share is undefined
    assert float(opposed.cosine) == pytest.approx(-1.0) and math.isnan(opposed.kl_share)


def test_cancellation_rate():
    # u = (1, 0), (-1, 0), (0, 2): sum (0, 2), sum of norms 4 -> c_R = 1 - 2/4, exact with every token sampled
    assert float(cancellation_rate(torch.tensor(2.0), torch.tensor([1.0, 1.0, 2.0]), 3)) == pytest.approx(0.5)
    # a sample of 2 of the 3 tokens scales its mean by the count: 3 * 1.5 = 4.5
    assert float(cancellation_rate(torch.tensor(2.0), torch.tensor([1.0, 2.0]), 3)) == pytest.approx(1 - 2 / 4.5)
    assert float(cancellation_rate(torch.tensor(0.0), torch.tensor([0.5, 0.7]), 10)) == 1.0  # exact cancellation
    assert math.isnan(cancellation_rate(torch.tensor(0.0), torch.zeros(3), 3))


def test_pearson_on_constructed_lengths_and_drifts():
    lengths = torch.tensor([3.0, 10.0, 40.0, 7.0, 25.0])
    per_token_kl = 0.02
    summed = per_token_kl * lengths  # F4: equal per-token KL makes the summed drift grow with length
    assert float(pearson(lengths, summed)) == pytest.approx(1.0)
    assert math.isnan(pearson(lengths, summed / lengths))  # length normalisation leaves a constant
    assert float(pearson(lengths, -summed)) == pytest.approx(-1.0)
    symmetric = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.3, 0.1, 0.1, 0.3])
    assert float(pearson(*symmetric)) == pytest.approx(0.0, abs=1e-15)
    assert float(pearson(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 3.0, 2.0]))) == pytest.approx(0.5)
    assert math.isnan(pearson(torch.tensor([1.0]), torch.tensor([2.0])))


def test_decile_medians():
    keys = torch.arange(20.0).flip(0)  # item i has key 19 - i
    values = torch.arange(20.0) * 10
    low, high = decile_medians(values, keys).tolist()  # 2 items per decile
    assert low == pytest.approx((190 + 180) / 2) and high == pytest.approx((0 + 10) / 2)
    values[19] = math.nan  # an undefined share is skipped
    assert decile_medians(values, keys)[0].item() == 180.0
    assert decile_medians(torch.tensor([4.0, 7.0]), torch.tensor([1.0, 2.0])).tolist() == [4.0, 7.0]


# ------------------------------------------------------------------------------------------ branch split


def _loss_inputs(coefficients, logprob, mask, ref_shift=0.3):
    from megatron_zcpo.training.update import LossInputs

    return LossInputs(
        sample_indices=list(range(logprob.shape[0])),
        logprob=logprob,
        old_logprob=logprob.detach().clone(),
        ref_logprob=logprob.detach() - ref_shift * mask,
        mask=mask,
        coefficients=coefficients.float(),
        normalizer=float(mask.sum()),
        current_kl=None,
        token_weight=None,
        group_ids=torch.zeros(logprob.shape[0], dtype=torch.long),
    )


@pytest.mark.parametrize(
    "config",
    [
        dict(name="zcpo", beta=2.0),
        dict(name="zcpo", beta=2.0, gate=False),
        dict(name="grpo", kl_loss="k3", kl_coef=0.04),
        dict(name="dapo", kl_in_reward_coef=0.1, kl_loss="k2", kl_coef=0.01, agg="seq-mean-token-mean"),
    ],
)
def test_branches_add_up_to_the_training_loss_without_clipping(config):
    group_ids = torch.tensor([0, 0, 0, 1, 1])
    stats = ResponseStats(
        group_ids,
        torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0], dtype=torch.float64),
        torch.tensor([3.0, 2.0, 4.0, 1.0, 2.0], dtype=torch.float64),
        kl_sum=torch.tensor([0.3, 0.1, 0.2, 0.05, 0.3], dtype=torch.float64),
        k1_sum=torch.tensor([0.2, -0.1, 0.4, 0.1, 0.3], dtype=torch.float64),
    )
    algorithm = build_algorithm(AlgorithmConfig(**config))
    split = BranchSplit(algorithm, stats)
    coefficients = algorithm.coefficients(stats)
    assert torch.allclose(split.reward_coefficients + split.kl_coefficients, coefficients.double())
    mask = (torch.arange(4)[None, :] < stats.lengths[:, None]).float()
    logprob = (-torch.rand(5, 4, generator=torch.Generator().manual_seed(1)) - 0.1).requires_grad_(True)
    inputs = _loss_inputs(coefficients, logprob, mask)
    (total_grad,) = torch.autograd.grad(
        algorithm.loss(
            logprob,
            inputs.old_logprob,
            mask,
            inputs.coefficients,
            normalizer=inputs.normalizer,
            ref_logprob=inputs.ref_logprob,
        ).loss,
        logprob,
    )
    (split_grad,) = torch.autograd.grad(split.reward_loss(inputs) + split.kl_loss(inputs), logprob)
    torch.testing.assert_close(split_grad, total_grad, rtol=1e-6, atol=1e-8)
    if config["name"] == "zcpo":  # the tied group's KL part: 0 when gated, else -beta * K = -+beta * 0.05
        drift_gap = float(stats.kl_sum[4] / stats.lengths[4] - stats.kl_sum[3] / stats.lengths[3])
        expected = 0.0 if config.get("gate", True) else config["beta"] * drift_gap
        assert float(split.kl_coefficients[3:].abs().sum()) == pytest.approx(expected)


def test_restrict_keeps_only_the_selected_tokens_gradient():
    algorithm = build_algorithm(AlgorithmConfig(name="grpo"))
    mask = torch.ones(2, 3)
    logprob = torch.tensor([[-0.5, -1.0, -2.0], [-0.1, -0.7, -0.3]], requires_grad=True)
    inputs = _loss_inputs(torch.tensor([0.7, -0.7]), logprob, mask)

    def loss(given):
        return algorithm.loss(
            given.logprob,
            given.old_logprob,
            given.mask,
            given.coefficients,
            normalizer=given.normalizer,
            ref_logprob=given.ref_logprob,
        ).loss

    (full,) = torch.autograd.grad(loss(inputs), logprob)
    selection = torch.tensor([[True, False, False], [False, False, True]])
    restricted = restrict(inputs, selection)
    assert float(loss(restricted).detach()) == pytest.approx(float(loss(inputs).detach()))
    (part,) = torch.autograd.grad(loss(restricted), logprob)
    torch.testing.assert_close(part, torch.where(selection, full, torch.zeros_like(full)))


# ------------------------------------------------------------------------------------------ config


def test_config_validation_names_the_key():
    DiagnosticsConfig().validate()
    for overrides, key in [
        ({"families": ["f8"]}, "families"),
        ({"families": ["f1", "f1"]}, "families"),
        ({"every": 0}, "every"),
        ({"groups": 1}, "groups"),
        ({"seed": -1}, "seed"),
        ({"cancellation_tokens": 2.5}, "cancellation_tokens"),
        ({"top_fractions": [0.0]}, "top_fractions"),
        ({"top_fractions": []}, "top_fractions"),
        ({"position_buckets": [10, 5]}, "position_buckets"),
        ({"position_buckets": [0, 5]}, "position_buckets"),
        ({"enabled": "yes"}, "enabled"),
    ]:
        with pytest.raises(ValueError, match=f"diagnostics.{key}"):
            DiagnosticsConfig(**overrides).validate()


def test_build_diagnostics_from_the_config_section():
    from megatron_zcpo.utils.config_loader import ConfigError

    assert build_diagnostics({"every": 5}) is None  # disabled by default
    hook = build_diagnostics(
        {"enabled": True, "every": 5, "families": ["f6", "f7"], "seed": 7}, AlgorithmConfig(name="gvpo")
    )  # no branch family: fine for gvpo
    assert isinstance(hook, KLDiagnostics)
    assert [hook.due(step) for step in range(11)] == [s % 5 == 0 for s in range(11)]
    with pytest.raises(ConfigError, match="diagnostics.evry"):
        build_diagnostics({"evry": 5})
    with pytest.raises(ValueError, match="diagnostics.families.*'rpg'"):
        build_diagnostics({"enabled": True}, AlgorithmConfig(name="rpg"))
