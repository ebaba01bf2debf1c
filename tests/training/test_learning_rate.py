"""The LR schedule: the first rollout trains at a non-zero warm-up LR, and train/lr is the LR applied."""

import pytest

from megatron_zcpo.testing import run_distributed
from tests.cases import trainer_cases

LR, WARMUP = 1e-3, 4


def _warmup_steps(rank, world, policy, reference, schedule):
    """Three rollout steps with warm-up: per step the logged LR, the LRs optimizer.step saw, and how far
    the parameters moved."""
    from megatron_zcpo.algorithms import AlgorithmConfig
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.training.config import OptimizerSettings, ParallelConfig, TrainConfig
    from megatron_zcpo.training.trainer import PolicyTrainer

    setup_megatron(seed=9)
    trainer = PolicyTrainer(
        trainer_cases.MODEL,
        AlgorithmConfig(name="zcpo"),
        TrainConfig(
            steps=6,
            mini_batches=1,
            optimizer=OptimizerSettings(
                lr=LR, warmup_steps=WARMUP, schedule=schedule, weight_decay=0.0, adam_eps=1e-12
            ),
        ),
        ParallelConfig(),
        initial_weights=policy,
        reference_weights=reference,
    )
    seen = []
    step = trainer.optimizer.step

    def recording_step():
        seen.append([group["lr"] for group in trainer.optimizer.param_groups])
        return step()

    trainer.optimizer.step = recording_step
    steps = []
    for seed in range(3):
        before = trainer.global_state_dict()
        logged = trainer.train_step(trainer_cases.rollout(seed=seed))["train/lr"]
        after = trainer.global_state_dict()
        moved = max((after[name] - value).abs().max().item() for name, value in before.items())
        steps.append({"logged": logged, "applied": seen.pop(), "moved": moved})
    return steps


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_first_rollout_trains_at_the_logged_warmup_lr(weights, schedule):
    steps = run_distributed(_warmup_steps, 1, *weights, schedule)[0]
    for k, step in enumerate(steps):
        expected = LR * (k + 1) / WARMUP  # megatron's warm-up at scheduler step k + 1
        assert step["logged"] == pytest.approx(expected, rel=1e-12)
        assert all(lr == step["logged"] for lr in step["applied"])  # every param group, at optimizer.step
        assert step["moved"] > 0.5 * step["logged"], (k, step)
    # Adam's first move is lr * g/|g| (bias-corrected): exactly the applied LR on most parameters.
    assert steps[0]["moved"] == pytest.approx(steps[0]["logged"], rel=1e-3)
