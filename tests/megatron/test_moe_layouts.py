"""Mixture-of-experts training through megatron-core's MoE layers: EP2, TP2xEP2 and PP2xEP2 equal EP1; exact resume."""

import pytest
import torch

from megatron_zcpo.testing import run_distributed
from tests.cases import trainer_cases
from tests.checkpoint.test_trainer_checkpoint import run_steps
from tests.training.test_trainer_layouts import _assert_same_step

MOE = trainer_cases.QWEN3_MOE


def _moe_weights(rank, world):
    return trainer_cases.weights(21, MOE), trainer_cases.weights(22, MOE)


@pytest.fixture(scope="module")
def moe_weights():
    return run_distributed(_moe_weights, 1)[0]


@pytest.fixture(scope="module")
def single(moe_weights):
    return run_distributed(trainer_cases.one_update, 1, 1, 1, *moe_weights, model=MOE)[0]


def test_single_process_moe_step_is_meaningful(single, moe_weights):
    assert single["metrics"]["experience/kl"] > 1e-3
    expert = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert (single["params"][expert] - moe_weights[0][expert]).abs().max() > 1e-4  # the experts train
    assert (
        single["params"]["decoder.layers.0.mlp.router.weight"] - moe_weights[0]["decoder.layers.0.mlp.router.weight"]
    ).abs().max() > 1e-4


@pytest.mark.parametrize(
    "tp,pp,ep,world,options",
    [
        pytest.param(1, 1, 2, 2, {}, id="EP2"),
        # The experts over the two TP ranks (ETP1, as slime's tp4/ep8/etp1); MoE under TP needs SP.
        pytest.param(2, 1, 2, 2, {"etp": 1, "sequence_parallel": True}, id="TP2xEP2"),
        pytest.param(1, 2, 2, 4, {}, id="PP2xEP2"),
    ],
)
def test_expert_parallel_layouts_match_ep1(single, moe_weights, tp, pp, ep, world, options):
    results = run_distributed(trainer_cases.one_update, world, tp, pp, *moe_weights, model=MOE, ep=ep, **options)
    _assert_same_step(results, single)


def test_moe_run_resumes_exactly(tmp_path, moe_weights):
    """Two steps at EP2 == one step, a checkpoint, and one step resumed (experts, their chained
    distributed-optimizer state, scheduler); resuming that checkpoint at EP1 is refused by name."""
    from megatron_zcpo.testing import DistributedTestFailure

    uninterrupted = run_distributed(run_steps, 2, 1, 1, moe_weights, (0, 1), ep=2, model=MOE)[0]
    run_distributed(run_steps, 2, 1, 1, moe_weights, (0,), save_root=str(tmp_path), ep=2, model=MOE)
    resumed = run_distributed(run_steps, 2, 1, 1, moe_weights, (1,), resume_from=str(tmp_path), ep=2, model=MOE)[0]
    assert resumed["step"] == 2
    assert resumed["losses"][0] == pytest.approx(uninterrupted["losses"][1], abs=1e-6)
    for name, value in uninterrupted["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, atol=1e-6, rtol=0, msg=name)
    with pytest.raises(DistributedTestFailure, match="cannot resume at parallel.expert=1"):
        run_distributed(run_steps, 1, 1, 1, moe_weights, (1,), resume_from=str(tmp_path), model=MOE)


def _router_after_one_update(rank, world, weights, aux_loss_coeff):
    from megatron_zcpo.training.config import MoETraining

    trainer = trainer_cases.make_trainer(
        1, 1, *weights, model=MOE, train_overrides={"moe": MoETraining(aux_loss_coeff=aux_loss_coeff)}
    )
    trainer.train_step(trainer_cases.rollout())
    return trainer.global_state_dict()["decoder.layers.0.mlp.router.weight"]


def test_load_balancing_loss_reaches_the_router_only_when_asked(moe_weights, single):
    """train.moe.aux_loss_coeff > 0 adds megatron's load-balancing gradient to the router (the
    default 0, ``single``'s, trains it by the policy loss alone)."""
    name = "decoder.layers.0.mlp.router.weight"
    balanced = run_distributed(_router_after_one_update, 1, moe_weights, 0.5)[0]
    assert (balanced - single["params"][name]).abs().max() > 1e-6


def test_moe_settings_are_checked_at_start_up():
    from megatron_zcpo.training.config import MoETraining, ParallelConfig, TrainConfig, check_experts

    train = TrainConfig()
    with pytest.raises(ValueError, match="parallel.sequence_parallel"):
        check_experts(MOE, ParallelConfig(tensor=2, expert=2), train, diagnostics=False)
    with pytest.raises(ValueError, match="diagnostics"):
        check_experts(MOE, ParallelConfig(expert=2), train, diagnostics=True)
    with pytest.raises(ValueError, match="has no experts"):
        check_experts(trainer_cases.MODEL, ParallelConfig(expert=2), train, diagnostics=False)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        check_experts(
            trainer_cases.MODEL, ParallelConfig(), TrainConfig(routing_replay="experience"), diagnostics=False
        )
    with pytest.raises(ValueError, match="train.recompute='full'"):
        check_experts(MOE, ParallelConfig(), TrainConfig(routing_replay="rollout", recompute="full"), diagnostics=False)
    with pytest.raises(ValueError, match="train.moe.aux_loss_coeff"):
        MoETraining(aux_loss_coeff=-1.0).validate()
