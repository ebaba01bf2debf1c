"""Non-finite losses/gradients on one rank skip that optimizer step on every rank; too many in a row stop the run."""

import math

import pytest
import torch

from megatron_zcpo.testing import run_distributed
from tests.cases import trainer_cases


def _optimizer_state(trainer):
    return {
        key: value.clone()
        for index, state in trainer.optimizer.optimizer.state.items()
        for key, value in ((f"{index}.{k}", v) for k, v in state.items())
        if torch.is_tensor(value)
    }


def _poison_gradients_on_rank_1(trainer):
    """A tensor hook on a TP-sharded weight: rank 1's gradient shard becomes NaN, rank 0's stays finite."""
    from megatron_zcpo.utils.runtime import unwrap

    weight = dict(unwrap(trainer.policy).named_parameters())["decoder.layers.0.mlp.linear_fc1.weight"]
    return weight.register_hook(lambda grad: grad * float("nan"))


def _poison_first_loss(trainer):
    """The next loss evaluated on this rank is NaN (micro-batch 0 of the next mini-batch)."""
    original = trainer.algorithm_loss
    calls = []

    def poisoned(inputs):
        result = original(inputs)
        if not calls:
            result.loss = result.loss * float("nan")
        calls.append(1)
        return result

    trainer.algorithm_loss = poisoned


def nonfinite_steps(rank, world, policy, reference):
    import torch.distributed as dist

    from megatron_zcpo.training.update import NonFiniteUpdateError

    trainer = trainer_cases.make_trainer(2, 1, policy, reference, mini_batches=2)
    trainer.train_config.max_skipped_steps = 3
    out = {}
    # Step 0: a NaN loss in rank 1's first micro-batch of mini-batch 0 -> that step skipped, mini-batch 1 steps.
    before = trainer.global_state_dict()
    if rank == 1:
        _poison_first_loss(trainer)
    metrics = trainer.train_step(trainer_cases.rollout(seed=0))
    out["loss_fault"] = {
        "skipped": metrics["update/skipped_steps"],
        "messages": list(trainer.skipped),
        "changed": any(not torch.equal(before[n], v) for n, v in trainer.global_state_dict().items()),
        "finite": all(torch.isfinite(v).all() for v in trainer.global_state_dict().values()),
    }
    # Step 1: NaN gradients (finite loss) on rank 1 only, in both mini-batches -> nothing changes anywhere.
    before, state_before = trainer.global_state_dict(), _optimizer_state(trainer)
    hook = _poison_gradients_on_rank_1(trainer) if rank == 1 else None
    metrics = trainer.train_step(trainer_cases.rollout(seed=1))
    after = trainer.global_state_dict()
    out["grad_fault"] = {
        "skipped": metrics["update/skipped_steps"],
        "messages": list(trainer.skipped),
        "step": trainer.step,
        "unchanged": all(torch.equal(before[n], after[n]) for n in before),
        "optimizer_unchanged": all(torch.equal(state_before[k], v) for k, v in _optimizer_state(trainer).items()),
    }
    # Step 2: a third consecutive skip stops the run (train.max_skipped_steps = 3) on every rank.
    try:
        trainer.train_step(trainer_cases.rollout(seed=2))
        out["stopped"] = None
    except NonFiniteUpdateError as error:
        out["stopped"] = str(error)
    if hook is not None:
        hook.remove()
    # And the ranks still agree on everything after the skips (no rank stepped alone).
    dist.barrier()
    metrics = trainer.train_step(trainer_cases.rollout(seed=3))
    out["after"] = {"skipped": metrics["update/skipped_steps"], "grad_norm": metrics["update/grad_norm"]}
    return out


def test_nonfinite_values_on_one_tp_rank_skip_the_step_everywhere(weights):
    results = run_distributed(nonfinite_steps, 2, *weights)
    first = results[0]
    assert results[1]["loss_fault"]["messages"] == first["loss_fault"]["messages"]
    assert first["loss_fault"]["skipped"] == 1.0
    assert first["loss_fault"]["messages"] == [
        "step 0, mini-batch 0: optimizer step skipped on every rank "
        # the NaN reaches rank 0's gradient shards through the tensor-parallel backward
        "(rank 0: non-finite gradient; rank 1: non-finite loss in micro-batch 0)"
    ]
    assert first["loss_fault"]["changed"] and first["loss_fault"]["finite"]  # mini-batch 1 stepped
    grad = first["grad_fault"]
    assert grad["skipped"] == 2.0 and grad["step"] == 2
    assert grad["messages"] == [
        f"step 1, mini-batch {m}: optimizer step skipped on every rank (rank 1: non-finite gradient)" for m in (0, 1)
    ]
    assert grad["unchanged"] and grad["optimizer_unchanged"]
    assert results[1]["grad_fault"]["unchanged"] and results[1]["grad_fault"]["optimizer_unchanged"]
    for result in results:
        assert result["stopped"].startswith(
            "3 consecutive optimizer steps skipped for non-finite values "
            "(train.max_skipped_steps = 3); last: step 2, mini-batch 0"
        )
    assert first["after"]["skipped"] == 0.0 and math.isfinite(first["after"]["grad_norm"])


def test_max_skipped_steps_must_be_positive():
    from megatron_zcpo.training.config import TrainConfig

    with pytest.raises(ValueError, match="train.max_skipped_steps must be >= 1, got 0"):
        TrainConfig(max_skipped_steps=0).validate()
