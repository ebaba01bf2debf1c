"""Multi-turn samples: tool tokens (response_mask 0) stay in the sequence but reach no loss, statistic or length."""

import pytest
import torch

from megatron_zcpo.recipe.rollout import rollout_metrics, samples_from_groups
from megatron_zcpo.rollout.engine import Completion
from megatron_zcpo.training.batch import RolloutSample, collate, collate_packed
from megatron_zcpo.training.update import minibatch_normalizer

# Sample 0: policy turn [4, 5], tool turn [6, 7, 8], policy turn [9]; sample 1: one policy turn.
MASK = [1, 1, 0, 0, 0, 1]


def _samples():
    return [
        RolloutSample(
            [1, 2, 3],
            [4, 5, 6, 7, 8, 9],
            group_id=0,
            reward=1.0,
            rollout_logprobs=[-0.1, -0.2, 0.0, 0.0, 0.0, -0.6],
            response_mask=MASK,
        ),
        RolloutSample([10], [11, 12], group_id=0, reward=0.0, rollout_logprobs=[-1.0, -2.0]),
    ]


def _read_back(mb):
    """{sample: [(response token index, target, rollout log-prob)]} through the micro-batch's response positions."""
    targets = mb.targets.reshape(-1)[mb.response_positions]
    out, offset = {}, 0
    for index, length in zip(mb.sample_indices, mb.response_lengths):
        span = slice(offset, offset + length)
        out[index] = [
            (int(t), int(y), round(float(r), 4))
            for t, y, r in zip(mb.response_token_index[span], targets[span], mb.rollout_logprobs[span])
        ]
        offset += length
    return out


EXPECTED = {0: [(0, 4, -0.1), (1, 5, -0.2), (5, 9, -0.6)], 1: [(0, 11, -1.0), (1, 12, -2.0)]}


@pytest.mark.parametrize("cp_size", [1, 2])
def test_only_policy_tokens_hold_response_positions(cp_size):
    samples = _samples()
    assert _read_back(collate(samples, [0, 1])) == EXPECTED
    merged = {0: [], 1: []}
    for rank in range(cp_size):
        mb = collate_packed(samples, [0, 1], rank, cp_size)
        for index, tokens in _read_back(mb).items():
            merged[index] += tokens
        # The model still reads the tool tokens (they are inputs).
        assert {6, 7, 8} <= set(mb.tokens.reshape(-1).tolist()) or cp_size > 1
    assert {i: sorted(v) for i, v in merged.items()} == EXPECTED


def test_lengths_and_normaliser_count_the_policy_tokens():
    samples = _samples()
    assert [s.policy_length for s in samples] == [3, 2]
    assert [s.sequence_length for s in samples] == [8, 2]  # the model sees every token
    assert minibatch_normalizer(samples, [0, 1], "tokens") == 5.0


def test_a_mask_of_the_wrong_length_is_named():
    sample = RolloutSample([1], [2, 3], group_id=0, reward=0.0, response_mask=[1])
    with pytest.raises(ValueError, match="sample 0: response_mask of 1 for 2 tokens"):
        collate([sample], [0])


def test_engine_masks_reach_the_trainer_samples_and_metrics():
    class Result:
        records = [type("Record", (), {"uid": "u0"})()]
        completions = [
            [
                Completion(
                    [1],
                    [4, 5, 6, 7],
                    [-0.1, 0.0, 0.0, -0.4],
                    "stop",
                    2,
                    output_mask=[1, 0, 0, 1],
                    info={"turns": 2, "tool_calls": 1, "tool_errors": 0, "stop_reason": "answer"},
                ),
                Completion(
                    [1],
                    [8],
                    [-0.5],
                    "stop",
                    2,
                    output_mask=[1],
                    info={"turns": 1, "tool_calls": 0, "tool_errors": 0, "stop_reason": "answer"},
                ),
            ]
        ]
        rewards = type(
            "Rewards",
            (),
            {
                "reward": torch.tensor([[1.0, -1.0]]),
                "loss_mask": torch.tensor([[True, True]]),
                "score": torch.tensor([[1.0, -1.0]]),
                "truncated": torch.tensor([[False, False]]),
            },
        )()

    samples = samples_from_groups(Result(), group_offset=0)
    assert samples[0].response_mask == [1, 0, 0, 1] and samples[0].policy_length == 2
    assert samples[0].info["tool_calls"] == 1
    metrics = rollout_metrics(samples)
    assert metrics["rollout/tool_call_fraction"] == 0.5 and metrics["rollout/response_length_mean"] == 1.5
    assert metrics["rollout/tool_tokens_mean"] == 1.0 and metrics["rollout/turns_mean"] == 1.5


def test_policy_turns_and_per_turn_experience_metrics():
    from megatron_zcpo.training.experience import experience_metrics, policy_turn_of_tokens
    from megatron_zcpo.training.metrics import MetricAccumulator
    from megatron_zcpo.training.rollout_step import ResponseTokenStats

    mask = torch.tensor([1, 1, 0, 0, 1, 0, 1, 1])
    assert policy_turn_of_tokens(mask).tolist() == [0, 0, 0, 0, 1, 1, 2, 2]
    sample = RolloutSample([1], list(range(8)), group_id=0, reward=1.0, response_mask=mask.tolist())
    policy = torch.tensor([0, 1, 4, 6, 7])  # the response indices of its policy tokens
    kl = torch.tensor([1.0, 3.0, 5.0, 7.0, 9.0])
    stats = ResponseTokenStats(torch.zeros(5), torch.zeros(5), 2 * kl, kl, policy)
    metrics = MetricAccumulator()
    experience_metrics([sample], {0: stats}, metrics)
    means = {name: metrics.sums[name] / metrics.counts[name] for name in metrics.sums}
    assert means["experience/kl_turn1"] == 2.0 and means["experience/kl_turn2"] == 5.0
    assert means["experience/kl_turn3plus"] == 8.0 and means["experience/entropy_turn3plus"] == 16.0
    assert means["experience/kl"] == 5.0


def _broadcast_case(rank, world_size):
    import torch.distributed as dist

    from megatron_zcpo.recipe.rollout import broadcast_samples

    dist.init_process_group("gloo", rank=rank, world_size=world_size)

    samples = _samples() if rank == 0 else None
    received = broadcast_samples(samples)
    return [(list(map(int, s.response_mask)) if s.response_mask is not None else None) for s in received]


def test_masks_reach_every_rank():
    from megatron_zcpo.testing import run_distributed

    assert run_distributed(_broadcast_case, 2) == [[MASK, None]] * 2


def _calibrate_case(rank, world_size):
    from megatron_zcpo.algorithms.registry import build_algorithm
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.training.experience import calibrate
    from megatron_zcpo.training.rollout_step import ResponseTokenStats

    setup_megatron()
    samples = _samples()
    # Per policy token KL 0.3 (sample 0: 3 policy tokens of 6) and 0.1 (sample 1: 2 tokens).
    experience = {
        0: ResponseTokenStats(
            torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.full((3,), 0.3), torch.tensor([0, 1, 5])
        ),
        1: ResponseTokenStats(
            torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.full((2,), 0.1), torch.tensor([0, 1])
        ),
    }
    coefficients, stats = calibrate(samples, experience, build_algorithm({"name": "zcpo", "beta": 1.0}))
    return stats.lengths.tolist(), coefficients.tolist()


def test_length_normalisation_divides_by_the_policy_tokens():
    from megatron_zcpo.testing import run_distributed

    [(lengths, coefficients)] = run_distributed(_calibrate_case, 1)
    assert lengths == [3.0, 2.0]
    # D~ = 0.3 and 0.1 (the mean KL over each response's policy tokens), centred: +-0.1; rewards 1, 0.
    assert coefficients == pytest.approx([1.0 - 0.1, -1.0 + 0.1], abs=1e-6)


def _tail_case(rank, world_size, policy, reference):
    """One ZCPO step (experience, calibration, F1-F7 diagnostics, update) on a rollout, and on the same
    rollout where some responses end with a masked tool turn: a causal model's earlier positions do not
    see those tokens, so every metric and every updated weight must be the same."""
    import random

    from tests.cases import diagnostics_cases, trainer_cases

    plain = trainer_cases.rollout()
    rng = random.Random(5)
    with_tools = []
    for i, s in enumerate(plain):
        tail = [rng.randrange(trainer_cases.MODEL.vocab_size) for _ in range(i % 3 * 2)]
        with_tools.append(
            RolloutSample(
                s.prompt_ids,
                list(s.response_ids) + tail,
                s.group_id,
                s.reward,
                s.trainable,
                response_mask=[1] * len(s.response_ids) + [0] * len(tail),
            )
        )
    out = []
    for samples in (plain, with_tools):
        trainer = trainer_cases.make_trainer(1, 1, policy, reference, "zcpo")
        trainer.diagnostics = diagnostics_cases.diagnostics()
        metrics = trainer.train_step(samples)
        out.append((metrics, trainer.global_state_dict()))
    return out


def test_masked_tool_tail_changes_no_metric_and_no_weight(weights):
    from megatron_zcpo.testing import run_distributed

    [[(plain, plain_weights), (tools, tools_weights)]] = run_distributed(_tail_case, 1, *weights)
    skipped = ("time/", "train/tokens_per_s")
    compared = [k for k in plain if not k.startswith(skipped)]
    assert any(k.startswith("diag/") for k in compared) and "update/policy_loss" in compared
    for key in compared:
        a, b = plain[key], tools[key]
        assert (a != a and b != b) or a == pytest.approx(b, rel=1e-5, abs=1e-7), key
    # Adam moves a weight by ~lr = 1e-3 per step; the longer sequences pack into other micro-batches
    # (another summation order), which moved weights by 3e-7 here. A leak would move them by ~1e-3.
    worst = max(float((value - tools_weights[name]).abs().max()) for name, value in plain_weights.items())
    assert worst < 1e-5
