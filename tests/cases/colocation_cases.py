"""Multi-rank cases of colocated placement: the trainer's state offloaded and onloaded between steps."""

from tests.cases.trainer_cases import MODEL, QWEN3_MOE, rollout


def _trainer(tp, bf16, distributed_optimizer, ep=1):
    """A ZCPO trainer of the tiny dense model, or at ``ep`` > 1 of the tiny Qwen3-MoE (its experts split
    over the expert-parallel ranks, megatron-core DDP's expert buffers beside the dense ones)."""
    from megatron_zcpo.algorithms import AlgorithmConfig
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.training.config import OptimizerSettings, ParallelConfig, TrainConfig
    from megatron_zcpo.training.trainer import PolicyTrainer

    setup_megatron(tensor_parallel=tp, seed=1, expert_parallel=ep)
    return PolicyTrainer(
        QWEN3_MOE if ep > 1 else MODEL,
        AlgorithmConfig(name="zcpo"),
        TrainConfig(bf16=bf16, mini_batches=2, optimizer=OptimizerSettings(lr=1e-3, warmup_steps=0)),
        ParallelConfig(tensor=tp, distributed_optimizer=distributed_optimizer, expert=ep),
    )


def _rollout(seed, ep):
    return rollout(seed=seed, vocab=(QWEN3_MOE if ep > 1 else MODEL).vocab_size)


def _snapshot(trainer):
    """Every tensor of the training state, cloned: parameters, main grads, optimizer params and state."""
    tensors = [p.detach().clone() for p in trainer.policy.parameters()]
    tensors += [p.main_grad.clone() for p in trainer.policy.parameters() if getattr(p, "main_grad", None) is not None]
    chained = getattr(trainer.optimizer, "chained_optimizers", None) or [trainer.optimizer]
    for opt in chained:
        inner = opt.optimizer
        tensors += [p.detach().clone() for g in inner.param_groups for p in g["params"]]
        tensors += [v.clone() for s in inner.state.values() for v in s.values() if hasattr(v, "clone")]
    return tensors


def offload_round_trip(rank, world, tp, bf16, distributed_optimizer, ep=1):
    """Train a step, offload every part (device storages must be empty), onload: the state is bit-exact
    and the next step's metrics equal those of a trainer that never offloaded. Returns the checks."""
    from megatron_zcpo.megatron.offload import TRAINING_PARTS, TrainingStateOffload

    trainer = _trainer(tp, bf16, distributed_optimizer, ep)
    trainer.train_step(_rollout(0, ep))
    before = _snapshot(trainer)
    offload = TrainingStateOffload(trainer.policy, trainer.optimizer, pin=False)
    total = offload.nbytes()
    freed = offload.offload(TRAINING_PARTS)
    emptied = all(p.untyped_storage().nbytes() == 0 for p in trainer.policy.parameters())
    restored = offload.onload(TRAINING_PARTS)
    after = _snapshot(trainer)
    exact = len(before) == len(after) and all(a.dtype == b.dtype and a.equal(b) for a, b in zip(before, after))
    offload.offload(["optimizer", "grads"])  # the colocated order: optimizer and grads go first
    offload.offload(["params"])
    offload.onload(TRAINING_PARTS)
    second = trainer.train_step(_rollout(1, ep))
    return {"freed": freed, "total": total, "restored": restored, "emptied": emptied, "exact": exact, "next": second}


def plain_two_steps(rank, world, tp, bf16, distributed_optimizer, ep=1):
    """The second step's metrics of a trainer that never offloads (the reference of offload_round_trip)."""
    trainer = _trainer(tp, bf16, distributed_optimizer, ep)
    trainer.train_step(_rollout(0, ep))
    return trainer.train_step(_rollout(1, ep))


def _stop_after_first_step():
    """A PreemptionGuard whose step-boundary check reports SIGUSR1 once the first step is done (no stop
    during set-up, the rollout or the update: no request is received)."""
    from megatron_zcpo.training.preemption import PreemptionGuard

    class StopAfterFirstStep(PreemptionGuard):
        calls = 0

        def should_stop(self):
            self.calls += 1
            return "SIGUSR1" if self.calls == 2 else None

    return StopAfterFirstStep()


def preempted_run(rank, world, path):
    """``zcpo train``'s run of the config at ``path``, preempted after its first step; the step it stopped at."""
    from megatron_zcpo.recipe.config import load_run_config
    from megatron_zcpo.recipe.training import run_training
    from megatron_zcpo.training.preemption import Preempted

    try:
        run_training(load_run_config(str(path)), _stop_after_first_step())
    except Preempted as stop:
        return stop.step
    return None
