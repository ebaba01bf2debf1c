"""The recipe's asynchronous rollouts (``rollout.mode=async``): the producer generates all the time, every step
takes complete groups, and the weights are pushed after every step without draining the engine."""

from __future__ import annotations

import time
from typing import Any, Dict, Optional


class AsynchronousRollouts:
    """Every rank holds one (the push is collective); rank 0's (``rollout`` given) runs the producer
    (:class:`~megatron_zcpo.rollout.async_rollout.AsyncRollout`) from the checkpoint's ``state`` ({}: a
    fresh run). ``engine``/``stages``/``waits``: what :func:`megatron_zcpo.recipe.weight_push.push_weights` takes."""

    def __init__(self, config, rollout, trainer, engine, stages, state: Dict[str, Any], waits=None):
        from megatron_zcpo.rollout.async_rollout import AsyncRollout

        self.config, self.rollout, self.trainer, self.engine, self.stages, self.waits = (
            config,
            rollout,
            trainer,
            engine,
            stages,
            waits,
        )
        self.producer: Optional[AsyncRollout] = None
        self.push_s = 0.0
        if rollout is None:
            return
        settings = config.rollout
        self.producer = AsyncRollout(
            engine,
            rollout.dataset,
            rollout.score,
            rollout.params,
            samples_per_prompt=settings.samples_per_prompt,
            prompts_per_step=settings.prompts_per_step,
            max_staleness=settings.max_staleness,
            on_stale=settings.on_stale,
            dynamic_sampling=settings.dynamic_sampling,
            seed=settings.seed,
            version=trainer.step,
        )
        rollout.scorer.start_tally()
        self.rejected_before = getattr(engine, "rejected_samples", 0)
        self.producer.start(state or None)

    def collect(self, step: int):
        """(samples, metrics) of step ``step`` on rank 0 ((None, {}) elsewhere): the oldest complete groups
        the producer holds, as trainer samples, once a step's worth exists. A stop request (the rollout's
        ``stop_requested``) while waiting for them raises ``RolloutInterrupted``, nothing taken."""
        from megatron_zcpo.recipe.rollout import rollout_metrics, samples_from_groups
        from megatron_zcpo.rollout.dynamic_sampling import DynamicSamplingResult

        if self.producer is None:
            return None, {}
        taken = self.producer.take(self.trainer.step, self.rollout.stop_requested)
        scorer = self.rollout.scorer
        metrics = {**taken.metrics, **scorer.check_failure_rate(f"step {step}'s groups")}
        scorer.start_tally()
        rejected = getattr(self.engine, "rejected_samples", 0)
        metrics["rollout/rejected_samples"] = float(rejected - self.rejected_before)
        self.rejected_before = rejected
        result = DynamicSamplingResult(taken.records, taken.completions, taken.rewards, {})
        samples = samples_from_groups(result, group_offset=step * 10**6)
        metrics.update(taken.rewards.metrics())
        if samples:
            metrics.update(rollout_metrics(samples))
        return samples, metrics

    def push(self, version: int) -> None:
        """Push the trainer's weights as ``version`` without draining (collective): rank 0 pauses the
        engine, whose requests in flight hold, and continues it once every share is in."""
        from megatron_zcpo.recipe.weight_push import push_weights

        started = time.perf_counter()
        if self.producer is not None:
            # lost SGLang servers that generate again rejoin at this push: asked before the pause, as a
            # /health_generate while paused waits out SGLang's 20 s (the embedded engine has none)
            check_returning = getattr(self.engine, "check_returning_servers", None)
            if check_returning is not None:
                check_returning()
            self.engine.pause_generation()
        push_weights(self.trainer, self.engine, version, self.stages, self.waits)
        if self.producer is not None:
            self.engine.continue_generation()
            self.producer.on_push(version)
        self.push_s = time.perf_counter() - started

    def state(self) -> Dict[str, Any]:
        """The producer's checkpoint state (rank 0), the data position included."""
        return self.producer.state() if self.producer is not None else {}

    def close(self) -> None:
        """Stop the producer and end the requests in flight."""
        if self.producer is not None:
            self.producer.close()


def asynchronous_rollouts(
    config, rollout, trainer, engine, stages, loop_state: Dict[str, Any], waits=None
) -> Optional[AsynchronousRollouts]:
    """The run's :class:`AsynchronousRollouts` with ``rollout.mode=async``, else None."""
    if config.rollout.mode != "async":
        return None
    return AsynchronousRollouts(config, rollout, trainer, engine, stages, loop_state.get("async", {}), waits)
