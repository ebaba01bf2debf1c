"""Within one train_step the same samples and indices are collated once; the step's result is unchanged."""

import torch

from megatron_zcpo.testing import run_distributed
from tests.cases import trainer_cases


def _step_counting_collations(rank, world, policy, reference, mini_batches, reuse):
    """(collations, metrics without timings, updated weights, whether the step left its micro-batches behind)."""
    import gc
    import weakref

    from megatron_zcpo.training import batch

    trainer = trainer_cases.make_trainer(1, 1, policy, reference, mini_batches=mini_batches)
    collate, calls, steps = batch.collate_micro_batches, [], []

    def counting(samples, indices, layout):
        calls.append(list(indices))
        return collate(samples, indices, layout)

    batch.collate_micro_batches = counting
    if not reuse:  # every use collates afresh, as before the reuse
        batch.StepMicroBatches.__call__ = lambda self, indices: counting(self.samples, indices, self.layout)
    start_step = trainer.start_step

    def tracked_start_step(samples):
        step = start_step(samples)
        steps.append(weakref.ref(step.micro_batches))
        return step

    trainer.start_step = tracked_start_step
    metrics = trainer.train_step(trainer_cases.rollout())
    metrics = {k: v for k, v in metrics.items() if not k.startswith("time/") and k != "train/tokens_per_s"}
    gc.collect()
    return len(calls), metrics, trainer.global_state_dict(), steps[0]() is not None


def test_experience_and_single_minibatch_update_share_their_micro_batches(weights):
    (reused,) = run_distributed(_step_counting_collations, 1, *weights, 1, True)
    (fresh,) = run_distributed(_step_counting_collations, 1, *weights, 1, False)
    assert reused[0] == 1 and fresh[0] == 2  # experience + update of the one mini-batch
    assert reused[1] == fresh[1]
    assert all(torch.equal(reused[2][name], fresh[2][name]) for name in fresh[2])
    assert not reused[3]  # the step's micro-batches are released with it


def test_each_minibatch_collates_its_own_share(weights):
    collations, *_, left_behind = run_distributed(_step_counting_collations, 1, *weights, 2, True)[0]
    assert collations == 3 and not left_behind  # all of this rank's samples, then each mini-batch's share
