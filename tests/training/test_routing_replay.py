"""Routing replay of MoE models (train.routing_replay): R2 and R3 both ways, the engine mismatch metric, the engine side."""

import pytest
import torch

from megatron_zcpo.testing import run_distributed
from tests.cases import routing_cases, trainer_cases

NOISE = 0.5  # added to the routers between the experience pass and the update: many tokens change experts


@pytest.fixture(scope="module")
def moe_weights():
    from tests.megatron.test_moe_layouts import _moe_weights

    return run_distributed(_moe_weights, 1)[0]


@pytest.fixture(scope="module")
def recorded(moe_weights):
    """R2 with perturbed routers: the update routes as the experience pass recorded."""
    return run_distributed(routing_cases.routing_step, 1, 1, moe_weights, "experience", None, NOISE)[0]


def test_r2_update_routes_exactly_as_recorded_despite_a_perturbed_router(recorded):
    metrics = recorded["metrics"]
    assert metrics["routing/update_pair_mismatch"] == 0.0  # every (token, layer) used the recorded experts
    assert metrics["routing/update_router_drift"] > 0.1  # ... which the perturbed router would not have chosen
    samples = trainer_cases.rollout()
    assert sorted(recorded["routing"]) == list(range(len(samples)))
    for index, routing in recorded["routing"].items():
        assert routing.shape == (samples[index].sequence_length, 2 * 2)  # 2 layers x top-2
        assert routing.min() >= 0 and routing.max() < 4


def test_without_replay_the_perturbed_router_changes_the_routing(moe_weights, recorded):
    """Mode none, the R2 run's routing attached as the engine's: the experience pass routes exactly
    like it (same weights: mismatch 0), the perturbed update does not."""
    result = run_distributed(routing_cases.routing_step, 1, 1, moe_weights, "none", recorded["routing"], NOISE)[0]
    metrics = result["metrics"]
    assert metrics["routing/rollout_pair_mismatch"] == 0.0 and metrics["routing/rollout_token_mismatch"] == 0.0
    assert metrics["routing/update_pair_mismatch"] > 0.1
    assert metrics["routing/update_pair_mismatch"] == metrics["routing/update_router_drift"]  # used = own choice


def test_r3_replays_the_engine_routing_under_sequence_parallelism(moe_weights, recorded):
    """TP2 + SP (each rank routes half of every micro-batch): the engine's routing, scrambled on a
    known share of tokens, is what the experience and update passes use; the metric finds the share."""
    engine, scrambled, total = {}, 0, 0
    for index, routing in recorded["routing"].items():
        routing = routing.clone()
        flip = torch.arange(routing.shape[0]) % 3 == 0  # every third token: experts e -> (e + 1) % 4
        routing[flip] = (routing[flip] + 1) % 4
        engine[index], scrambled, total = routing, scrambled + int(flip.sum()), total + routing.shape[0]
    results = run_distributed(routing_cases.routing_step, 2, 2, moe_weights, "rollout", engine, NOISE)
    for result in results:
        metrics = result["metrics"]
        assert metrics["routing/rollout_token_mismatch"] == pytest.approx(scrambled / total, abs=0.02)
        assert metrics["routing/update_pair_mismatch"] == 0.0
        assert metrics["routing/update_router_drift"] > 0.1


def test_r3_without_engine_routing_is_refused(moe_weights):
    from megatron_zcpo.testing import DistributedTestFailure

    with pytest.raises(DistributedTestFailure, match="carries no routed experts"):
        run_distributed(routing_cases.routing_step, 1, 1, moe_weights, "rollout")


def test_engine_routing_matches_the_trainer_and_travels_through_the_mock_server(moe_weights):
    """The embedded engine records routed experts in SGLang's layout; the mock server of the newest
    release returns them (the pinned one refuses the field); the trainer, at the same weights, routes
    the sampled tokens the same way."""
    prompts = [[5, 17, 42], [7, 7, 120, 3, 9]]
    direct, served = run_distributed(routing_cases.engine_completions, 1, moe_weights, prompts)[0]
    newest, pinned = served.values()
    assert "return_routed_experts" in pinned  # 0.5.3.post3 does not know it: 400
    samples = []
    for group, (completions, via_server) in enumerate(zip(direct, newest)):
        for completion, other in zip(completions, via_server):
            tokens = len(completion.prompt_ids) + len(completion.output_ids) - 1
            assert completion.routed_experts.shape == (tokens, 2 * 2)
            if other.output_ids == completion.output_ids:
                assert torch.equal(other.routed_experts, completion.routed_experts)
            from megatron_zcpo.training.batch import RolloutSample

            samples.append(
                RolloutSample(
                    completion.prompt_ids,
                    completion.output_ids,
                    group,
                    float(len(samples) % 2),
                    routed_experts=completion.routed_experts,
                )
            )
    engine = {i: s.routed_experts for i, s in enumerate(samples)}
    result = run_distributed(_routing_of_samples, 1, moe_weights, samples, engine)[0]
    assert result["routing/rollout_token_mismatch"] < 0.05  # transformers vs megatron-core at fp32


def _routing_of_samples(rank, world, weights, samples, engine):
    trainer = trainer_cases.make_trainer(1, 1, *weights, model=routing_cases.MOE)
    for index, routing in engine.items():
        samples[index].routed_experts = routing
    return trainer.train_step(samples)


@pytest.mark.parametrize(
    "packing,cp,sp", [("thd", 1, 1), ("padded", 1, 1), ("thd", 2, 1), ("thd", 1, 2), ("padded", 1, 2)]
)
def test_router_token_map_names_every_token_once(packing, cp, sp):
    """Over the context- and sequence-parallel ranks of a micro-batch, every (sample, position) of
    the samples' inputs appears exactly once in router order, and nothing else but padding."""
    from megatron_zcpo.training.batch import collate, collate_packed
    from megatron_zcpo.training.routing_replay import router_token_map

    samples = trainer_cases.rollout()
    indices = [0, 3, 4, 9]
    lengths = [s.sequence_length for s in samples]
    seen = []
    for cp_rank in range(cp):
        mb = (
            collate(samples, indices, sp_size=sp)
            if packing == "padded"
            else collate_packed(samples, indices, cp_rank, cp, sp_size=sp)
        )
        for sp_rank in range(sp):
            owner, position = router_token_map(mb, lengths, sp_rank, sp)
            assert owner.numel() == mb.tokens.numel() // sp
            seen += [(o, p) for o, p in zip(owner.tolist(), position.tolist()) if o >= 0]
    expected = [(i, p) for i in indices for p in range(lengths[i])]
    assert sorted(seen) == sorted(expected)
