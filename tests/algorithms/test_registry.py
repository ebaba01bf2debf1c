"""Registry: config validation, per-rollout coefficients, split-exact losses, the weak-reward reversal (App. G)."""

import math

import pytest
import torch

from megatron_zcpo.algorithms.advantages import group_advantages
from megatron_zcpo.algorithms.config import ALGORITHM_NAMES, AlgorithmConfig
from megatron_zcpo.algorithms.kl import kl_penalty
from megatron_zcpo.algorithms.registry import ALGORITHMS, ResponseStats, build_algorithm
from megatron_zcpo.algorithms.surrogates import policy_loss
from megatron_zcpo.algorithms.zcpo import zcpo_coefficients

F64 = torch.float64


def test_every_name_builds_with_its_presets():
    assert set(ALGORITHMS) == set(ALGORITHM_NAMES)
    grpo = build_algorithm({"name": "grpo"})
    assert (grpo.config.reward_norm, grpo.config.kl_loss, grpo.needs_reference) == ("std", "k3", True)
    dapo = build_algorithm({"name": "dapo"})
    assert (dapo.config.kl_loss, dapo.needs_reference, dapo.required_stats) == ("none", False, ())
    zcpo = build_algorithm(AlgorithmConfig())
    assert (zcpo.config.reward_norm, zcpo.required_stats, zcpo.needs_current_kl) == ("max_abs", ("kl_sum",), False)
    assert build_algorithm({"name": "zcpo", "drift": "k1"}).required_stats == ("k1_sum",)
    rpg = build_algorithm({"name": "rpg"})
    assert (rpg.config.clip_c, rpg.needs_reference) == (3.0, False)
    assert build_algorithm({"name": "rpg", "rpg_reference": "ref"}).needs_reference
    gvpo = build_algorithm({"name": "gvpo"})
    assert gvpo.needs_whole_groups and not gvpo.supports_token_weight and gvpo.normalizer_unit == "sequences"
    assert build_algorithm({"name": "zcpo", "agg": "seq-mean-token-mean"}).normalizer_unit == "sequences"
    assert build_algorithm({"name": "zcpo", "eps": "1e-6", "beta": "0.5"}).config.beta == 0.5  # YAML strings


@pytest.mark.parametrize(
    "section, key",
    [
        ({"name": "ppo"}, "algorithm.name"),
        ({"name": "zcpo", "betta": 1.0}, "algorithm.betta"),
        ({"name": "zcpo", "kl_loss": "k3"}, "algorithm.kl_loss"),
        ({"name": "zcpo", "kl_in_reward_coef": 0.1}, "algorithm.kl_in_reward_coef"),
        ({"name": "grpo", "beta": 0.04}, "algorithm.beta"),
        ({"name": "dapo", "center": False}, "algorithm.center"),
        ({"name": "gvpo", "clip_high": 0.3}, "algorithm.clip_high"),
        ({"name": "rpg", "gvpo_beta": 0.2}, "algorithm.gvpo_beta"),
        ({"name": "dapo", "f1_control": "mask_clipped"}, "algorithm.f1_control"),
        ({"name": "grpo", "kl_loss": "full", "f1_control": "match_masked_norm"}, "algorithm.f1_control"),
        ({"name": "dapo", "kl_coef": 0.04}, "algorithm.kl_coef"),
        ({"name": "zcpo", "reward_norm": "rank"}, "algorithm.reward_norm"),
        ({"name": "zcpo", "drift": "k3"}, "algorithm.drift"),
        ({"name": "zcpo", "agg": "sum"}, "algorithm.agg"),
        ({"name": "zcpo", "beta": -1.0}, "algorithm.beta"),
        ({"name": "zcpo", "beta": float("nan")}, "algorithm.beta"),
        ({"name": "zcpo", "eps": 0.0}, "algorithm.eps"),
        ({"name": "zcpo", "clip_low": 1.0}, "algorithm.clip_low"),
        ({"name": "zcpo", "clip_c": 1.0}, "algorithm.clip_c"),
        ({"name": "zcpo", "gate": "yes"}, "algorithm.gate"),
        ({"name": "zcpo", "beta": "four"}, "algorithm.beta"),
        ({"name": "zcpo", "beta": True}, "algorithm.beta"),
    ],
)
def test_validation_names_the_key(section, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_algorithm(section)


def _rollout(seed):
    """16 responses in 4 shuffled groups of unequal size, one empty response, float64 stats."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([3] * 6 + [11] * 5 + [4] * 3 + [20] * 2)[torch.randperm(16, generator=gen)]
    rewards = torch.randint(0, 2, (16,), generator=gen).to(F64) * 2 - 1
    lengths = torch.randint(1, 6, (16,), generator=gen)
    return ResponseStats(
        group_ids=ids,
        rewards=rewards,
        lengths=lengths,
        kl_sum=torch.rand(16, generator=gen, dtype=F64) * lengths,
        k1_sum=torch.randn(16, generator=gen, dtype=F64),
    )


@pytest.mark.parametrize("name", ["zcpo", "dapo", "rpg", "gvpo"])
def test_empty_responses_are_left_out_of_their_group(name):
    stats = _rollout(0)
    empty = 5
    stats.lengths[empty] = 0
    stats.kl_sum[empty] = float("nan")  # no tokens: whatever the drift says must not matter
    algorithm = build_algorithm({"name": name})
    got = algorithm.coefficients(stats)
    keep = torch.arange(16) != empty
    assert got[empty] == 0
    torch.testing.assert_close(got[keep], algorithm.coefficients(stats.rows(keep)))


def test_zcpo_coefficients_through_the_registry():
    stats = _rollout(1)
    algorithm = build_algorithm({"name": "zcpo", "beta": 2.0})
    expected = zcpo_coefficients(stats.rewards, stats.kl_sum / stats.lengths, stats.group_ids, 2.0)
    torch.testing.assert_close(algorithm.coefficients(stats), expected)
    ablated = build_algorithm(
        {
            "name": "zcpo",
            "beta": 2.0,
            "drift": "k1",
            "length_normalize": False,
            "center": False,
            "gate": False,
            "reward_norm": "std",
        }
    )
    expected = zcpo_coefficients(
        stats.rewards, stats.k1_sum, stats.group_ids, 2.0, reward_norm="std", center=False, gate=False
    )
    torch.testing.assert_close(ablated.coefficients(stats), expected)
    assert (
        algorithm.coefficients(
            ResponseStats(stats.group_ids, stats.rewards.float(), stats.lengths, kl_sum=stats.kl_sum.float())
        ).dtype
        == torch.float32
    )


def test_non_finite_drift_in_stats_names_the_group():
    stats = _rollout(2)
    stats.kl_sum[7] = float("inf")
    with pytest.raises(ValueError, match=f"group id {int(stats.group_ids[7])}"):
        build_algorithm({"name": "zcpo"}).coefficients(stats)


SPLIT_CASES = [
    {"name": "zcpo"},
    {"name": "zcpo", "agg": "seq-mean-token-mean", "clip_c": 3.0},
    {"name": "grpo", "agg": "seq-mean-token-sum", "f1_control": "mask_clipped"},
    {"name": "grpo", "kl_loss": "full"},
    {"name": "rpg"},
    {"name": "rpg", "rpg_reference": "ref", "agg": "seq-mean-token-mean"},
    {"name": "gvpo"},
]


@pytest.mark.parametrize("section", SPLIT_CASES, ids=lambda s: "-".join(str(v) for v in s.values()))
def test_split_over_micro_batches_and_ranks_is_exact(section):
    """Sum of micro-batch losses (2 ranks x 2 micro-batches, groups whole) == unsplit loss, same gradient."""
    stats = _rollout(3)
    stats.lengths[0] = 0
    gen = torch.Generator().manual_seed(4)
    tokens = int(stats.lengths.max())
    mask = torch.arange(tokens)[None, :] < stats.lengths[:, None]
    old = -torch.rand(16, tokens, generator=gen, dtype=F64) * 2
    logprob = (old + 0.4 * torch.randn(16, tokens, generator=gen, dtype=F64)).requires_grad_(True)
    ref = old + 0.2 * torch.randn(16, tokens, generator=gen, dtype=F64)
    kl_leaf = torch.rand(16, tokens, generator=gen, dtype=F64).requires_grad_(True)
    algorithm = build_algorithm(section)
    coefficients = algorithm.coefficients(stats)
    token_weight = None if not algorithm.supports_token_weight else torch.rand(16, tokens, generator=gen, dtype=F64)

    def loss(rows, normalizer):
        return algorithm.loss(
            logprob[rows],
            old[rows],
            mask[rows],
            coefficients[rows],
            normalizer=normalizer,
            ref_logprob=ref[rows],
            current_kl=(kl_leaf * logprob)[rows] if algorithm.needs_current_kl else None,
            token_weight=None if token_weight is None else token_weight[rows],
            group_ids=stats.group_ids[rows] if algorithm.needs_whole_groups else None,
        ).loss

    everything = torch.arange(16)
    full = loss(everything, algorithm.normalizer_count(mask))
    (full_grad,) = torch.autograd.grad(full, logprob)
    groups = [(stats.group_ids == g).nonzero().flatten() for g in (3, 11, 4, 20)]
    splits = [torch.cat(groups[:1]), torch.cat(groups[1:2]), groups[2], groups[3]]  # groups whole (GVPO)
    normalizer = sum(algorithm.normalizer_count(mask[rows]) for rows in splits)
    total = sum(loss(rows, normalizer) for rows in splits)
    (split_grad,) = torch.autograd.grad(total, logprob)
    assert full.abs() > 0 and split_grad.abs().sum() > 0
    torch.testing.assert_close(total, full, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-13, atol=1e-15)


def test_loss_input_checks():
    zcpo = build_algorithm({"name": "zcpo"})
    x = torch.zeros(2, 3, requires_grad=True)
    with pytest.raises(ValueError, match="does not use it"):
        zcpo.loss(x, x.detach(), torch.ones(2, 3), torch.zeros(2), normalizer=6, current_kl=x)
    with pytest.raises(ValueError, match="needs ref_logprob"):
        build_algorithm({"name": "grpo"}).loss(x, x.detach(), torch.ones(2, 3), torch.zeros(2), normalizer=6)
    gvpo = build_algorithm({"name": "gvpo"})
    with pytest.raises(ValueError, match="needs group_ids"):
        gvpo.loss(x, x.detach(), torch.ones(2, 3), torch.zeros(2), normalizer=2)
    with pytest.raises(ValueError, match="token_weight is not supported"):
        gvpo.loss(
            x,
            x.detach(),
            torch.ones(2, 3),
            torch.zeros(2),
            normalizer=2,
            token_weight=torch.ones(2, 3),
            group_ids=torch.zeros(2, dtype=torch.int64),
        )


# --- Appendix G: independent KL reverses weak rewards; ZCPO keeps their direction -------------------------

TAU, EPS_ADV, BETA = 1e-3, 1e-6, 0.04
POLICY = torch.tensor([0.4, 0.3, 0.3], dtype=F64)  # pi_theta = pi_old at the shared prefix
REFERENCE = torch.tensor([0.2, 0.4, 0.4], dtype=F64)
# 16 single-token responses: 7 x (+1), 7 x (-1), the weak positive (token 0), the weak negative (token 1)
TOKENS = torch.tensor([0, 1, 2, 0, 1, 2, 0] + [1, 2, 0, 1, 2, 0, 1] + [0, 1])
REWARDS = torch.tensor([1.0] * 7 + [-1.0] * 7 + [TAU, -TAU], dtype=F64)
WEAK_POSITIVE, WEAK_NEGATIVE = 14, 15


def _update_coefficients(algorithm_section):
    """Per-response update coefficient -dL/dlogprob * normaliser, through the public pipeline and autograd."""
    algorithm = build_algorithm(algorithm_section)
    log_policy, log_reference = POLICY.log(), REFERENCE.log()
    conditional_kl = torch.nn.functional.kl_div(log_reference, log_policy, log_target=True, reduction="sum")
    n = TOKENS.numel()
    stats = ResponseStats(
        group_ids=torch.zeros(n, dtype=torch.int64),
        rewards=REWARDS,
        lengths=torch.ones(n, dtype=torch.int64),
        kl_sum=conditional_kl.expand(n).clone(),
    )
    coefficients = algorithm.coefficients(stats)
    logprob = log_policy[TOKENS][:, None].clone().requires_grad_(True)
    mask = torch.ones(n, 1)
    normalizer = algorithm.normalizer_count(mask)
    out = algorithm.loss(
        logprob, logprob.detach(), mask, coefficients, normalizer=normalizer, ref_logprob=log_reference[TOKENS][:, None]
    )
    (grad,) = torch.autograd.grad(out.loss, logprob)
    return -grad[:, 0] * normalizer


def test_weak_reward_reversal_under_k3_grpo():
    update = _update_coefficients({"name": "grpo", "kl_loss": "k3", "kl_coef": BETA, "eps": EPS_ADV})
    assert update[WEAK_POSITIVE].item() == pytest.approx(-0.0189649, abs=5e-8)
    assert update[WEAK_NEGATIVE].item() == pytest.approx(+0.0122982, abs=5e-8)
    # the reward part alone has the right signs: it is the KL loss that reverses them
    advantage = TAU / (math.sqrt((14 + 2 * TAU**2) / 15) + EPS_ADV)
    reward_only = _update_coefficients({"name": "dapo", "eps": EPS_ADV})
    assert reward_only[WEAK_POSITIVE].item() == pytest.approx(advantage, rel=1e-12)
    assert reward_only[WEAK_NEGATIVE].item() == pytest.approx(-advantage, rel=1e-12)


def test_weak_reward_direction_kept_under_zcpo():
    update = _update_coefficients({"name": "zcpo", "beta": BETA})
    assert update[WEAK_POSITIVE].item() == pytest.approx(+0.001, abs=1e-12)
    assert update[WEAK_NEGATIVE].item() == pytest.approx(-0.001, abs=1e-12)
    assert abs(update.sum().item()) < 1e-12  # zero-sum group


def test_weak_reward_reversal_with_the_bare_public_functions():
    """Same numbers from group_advantages + policy_loss + kl_penalty (API.md names) and autograd."""
    ids = torch.zeros(16, dtype=torch.int64)
    logprob = POLICY.log()[TOKENS][:, None].clone().requires_grad_(True)
    mask = torch.ones(16, 1)
    advantage = group_advantages(REWARDS, ids, norm="std", eps=EPS_ADV)
    kl = kl_penalty(logprob, REFERENCE.log()[TOKENS][:, None], "k3").mean()
    total = policy_loss(logprob, logprob.detach(), advantage, mask)[0] + BETA * kl
    (grad,) = torch.autograd.grad(total, logprob)
    update = -grad[:, 0] * 16
    assert update[WEAK_POSITIVE].item() == pytest.approx(-0.0189649, abs=5e-8)
    assert update[WEAK_NEGATIVE].item() == pytest.approx(+0.0122982, abs=5e-8)


def test_coefficient_metrics_by_hand():
    # group 0 (active): a = (1/3, 1/3, 1/3, -1), K = D~ - 0.2 = (-0.2, -0.1, 0.3, 0), beta = 2:
    # C = (0.7333, 0.5333, -0.2667, -1) -- row 2's drift reverses its positive reward. Group 1 ties,
    # group 2's only response is empty and is left out.
    stats = ResponseStats(
        group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 2]),
        rewards=torch.tensor([1.0, 1.0, 1.0, -1.0, 0.0, 0.0, 1.0], dtype=F64),
        lengths=torch.tensor([1, 1, 1, 1, 2, 2, 0]),
        kl_sum=torch.tensor([0.0, 0.1, 0.5, 0.2, 0.6, 0.6, float("nan")], dtype=F64),
        k1_sum=torch.tensor([0.1, -0.2, 0.3, -0.1, 0.0, 0.2, float("nan")], dtype=F64),
    )
    algorithm = build_algorithm({"name": "zcpo", "beta": 2.0})
    coefficients = algorithm.coefficients(stats)
    torch.testing.assert_close(coefficients[:4], torch.tensor([11 / 15, 8 / 15, -4 / 15, -1.0], dtype=F64))
    metrics = algorithm.coefficient_metrics(stats, coefficients)
    expected = {
        "active_group_fraction": 0.5,
        "coef_abs_mean": (38 / 15) / 6,
        "reward_flip_fraction": 0.25,
        "k1_negative_fraction": 2 / 6,
        "drift_mean": 1.4 / 6,
        "drift_peak_mean": 0.6,
        "drift_peak_max": 0.6,
    }
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-12), name
