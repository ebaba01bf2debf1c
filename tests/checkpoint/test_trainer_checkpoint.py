"""Training checkpoints: exact resume (also at another layout), atomicity, refusal of another model."""

import dataclasses

import pytest
import torch

from megatron_zcpo.checkpoint.io import find_latest, list_checkpoints
from megatron_zcpo.testing import DistributedTestFailure, run_distributed
from tests.cases import trainer_cases

ROLLOUT_SEEDS = (0, 1, 2)


def run_steps(
    rank, world, tp, pp, weights, seeds, save_root=None, resume_from=None, distributed_optimizer=True, **options
):
    """Train on ``seeds``' rollouts (``options``: more make_trainer arguments), saving or resuming."""
    trainer = trainer_cases.make_trainer(tp, pp, *weights, distributed_optimizer=distributed_optimizer, **options)
    if resume_from is not None:
        state = trainer.load(find_latest(resume_from))
        assert state["loop"] == {"next_seed": seeds[0]}
    losses = []
    for seed in seeds:
        losses.append(trainer.train_step(trainer_cases.rollout(seed=seed))["update/loss"])
        if save_root is not None:
            trainer.save(save_root, {"loop": {"next_seed": seed + 1}}, keep_last=1)
    return {"losses": losses, "params": trainer.global_state_dict(), "step": trainer.step}


def load_other_model(rank, world, weights, root):
    from megatron_zcpo.algorithms import AlgorithmConfig
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.training.config import ParallelConfig, TrainConfig
    from megatron_zcpo.training.trainer import PolicyTrainer

    setup_megatron(seed=1)
    other = dataclasses.replace(trainer_cases.MODEL, num_layers=3, rope_theta=500000.0)
    trainer = PolicyTrainer(other, AlgorithmConfig(name="zcpo"), TrainConfig(), ParallelConfig())
    trainer.load(find_latest(root))


@pytest.fixture(scope="module")
def uninterrupted(weights):
    return run_distributed(run_steps, 2, 2, 1, weights, ROLLOUT_SEEDS)[0]


@pytest.mark.parametrize("resume_tp,resume_world", [(2, 2), (1, 2)], ids=["same-layout", "TP2-to-DP2"])
def test_resume_reproduces_uninterrupted_run(tmp_path, weights, uninterrupted, resume_tp, resume_world):
    first = run_distributed(run_steps, 2, 2, 1, weights, ROLLOUT_SEEDS[:2], save_root=str(tmp_path))[0]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"]  # keep_last=1
    assert (tmp_path / "latest").read_text() == "step_00000002"
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    resumed = run_distributed(
        run_steps, resume_world, resume_tp, 1, weights, ROLLOUT_SEEDS[2:], resume_from=str(tmp_path)
    )[0]
    assert first["losses"] == pytest.approx(uninterrupted["losses"][:2], abs=1e-6)
    assert resumed["step"] == 3
    assert resumed["losses"][0] == pytest.approx(uninterrupted["losses"][2], abs=1e-5)
    for name, value in uninterrupted["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, atol=1e-5, rtol=0, msg=name)


def test_checkpoint_of_another_model_is_refused(tmp_path, weights):
    run_distributed(
        run_steps, 1, 1, 1, weights, ROLLOUT_SEEDS[:1], save_root=str(tmp_path), distributed_optimizer=False
    )
    with pytest.raises(DistributedTestFailure) as failure:
        run_distributed(load_other_model, 1, weights, str(tmp_path))
    message = str(failure.value)
    assert "CheckpointMismatchError" in message
    assert "num_layers: checkpoint 2 vs run 3" in message and "rope_theta" in message


def test_incomplete_checkpoint_is_ignored(tmp_path):
    (tmp_path / "step_00000005.tmp" / "weights").mkdir(parents=True)
    (tmp_path / "step_00000004").mkdir()  # no trainer_state.pt: a crash before completion
    assert find_latest(tmp_path) is None
    (tmp_path / "step_00000003").mkdir()
    torch.save({}, tmp_path / "step_00000003" / "trainer_state.pt")
    assert find_latest(tmp_path).name == "step_00000003"
