"""The recipe's overlapped rollouts (``rollout.mode=overlap``): step k+1 generates while step k trains."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Dict, Optional

from megatron_zcpo.training.batch import RolloutSample


class OverlappedRollouts:
    """Rank 0 collects step k+1's rollout in a background thread while every rank trains step k;
    the weights after step k are pushed between the two generations, so the rollout of step k+1
    is one version behind (checked against ``rollout.max_staleness``).

    Every rank holds one (the weight push is collective); only rank 0's (``rollout`` given) has a
    prefetch thread. ``in_flight``: the rollout a checkpoint recorded (resumed exactly, not
    regenerated). ``engine``/``stages``/``waits``: what :func:`megatron_zcpo.recipe.weight_push.push_weights` takes.
    """

    def __init__(self, config, rollout, trainer, engine, stages, in_flight: Dict[str, Any], waits=None):
        from megatron_zcpo.rollout.overlap import RolloutPrefetch

        self.config, self.trainer, self.engine, self.stages, self.waits = config, trainer, engine, stages, waits
        self.prefetch = RolloutPrefetch(rollout.collect) if rollout is not None else None
        if self.prefetch is not None and in_flight:
            samples = [RolloutSample(**sample) for sample in in_flight["samples"]]
            self.prefetch.restore(in_flight["step"], (samples, in_flight["metrics"]))
        self.pushed_version = trainer.step  # the run pushed these weights at start-up
        self.push_s = 0.0
        self.dropped_step: Optional[int] = None  # the rollout in flight a stop request ended (rank 0)

    def collect(self, step: int):
        """(samples, metrics) of step ``step`` on rank 0 ((None, {}) elsewhere), with the time
        waited for them and the samples' staleness."""
        from megatron_zcpo.rollout.overlap import staleness_metrics

        if self.prefetch is None:
            return None, {}
        (samples, metrics), waited = self.prefetch.take(step)
        metrics = {**metrics, "time/wait_for_data": waited}
        if samples:
            metrics.update(
                staleness_metrics(
                    [s.info.get("weight_version") for s in samples],
                    self.trainer.step,
                    self.config.rollout.max_staleness,
                )
            )
        return samples, metrics

    def push_current_weights(self) -> None:
        """Push the trainer's weights unless the engine has them (collective; no generation runs)."""
        from megatron_zcpo.recipe.weight_push import push_weights

        started = time.perf_counter()
        if self.pushed_version != self.trainer.step:
            push_weights(self.trainer, self.engine, self.trainer.step, self.stages, self.waits)
            self.pushed_version = self.trainer.step
        self.push_s = time.perf_counter() - started

    def launch(self, step: int) -> Dict[str, float]:
        """Start step ``step``'s rollout (rank 0); the engine's idle time since its last one."""
        if self.prefetch is None:
            return {}
        self.prefetch.launch(step)
        return {"time/engine_wait_for_weights": self.prefetch.engine_wait_s}

    def settle(self) -> None:
        """Before evaluation: let the rollout in flight finish (or drop it, ended by a stop request),
        then push the current weights."""
        if self.prefetch is not None:
            self._unless_dropped(self.prefetch.wait)
        self.push_current_weights()

    def state(self) -> Dict[str, Any]:
        """The rollout in flight, for the checkpoint (rank 0; waits for it). A rollout a stop request ended
        is dropped ({}): its prompts went back to the stream, and the resumed run generates them again
        with the checkpoint's weights (one version newer than the dropped rollout's)."""
        from megatron_zcpo.rollout.overlap import in_flight_state

        prefetch = self.prefetch
        state = (self._unless_dropped(lambda: in_flight_state(prefetch)) or {}) if prefetch is not None else {}
        if state:  # plain values: checkpoints are read with torch.load(weights_only=True)
            state = {**state, "samples": [dataclasses.asdict(sample) for sample in state["samples"]]}
        return state

    def _unless_dropped(self, wait: Callable[[], Any]) -> Any:
        """``wait()``'s result, or None once the rollout in flight it waits for was interrupted (dropped)."""
        from megatron_zcpo.rollout.engine import RolloutInterrupted

        step = self.prefetch.pending_step if self.prefetch is not None else None
        try:
            return wait()
        except RolloutInterrupted:  # (the prefetch forgot it: the next take generates that step anew)
            self.dropped_step = step
            return None

    def close(self) -> None:
        """Wait for a rollout in flight (its thread must not outlive the engine)."""
        if self.prefetch is not None:
            self.prefetch.close()


def overlapped_rollouts(
    config, rollout, trainer, engine, stages, loop_state: Dict[str, Any], waits=None
) -> Optional[OverlappedRollouts]:
    """The run's :class:`OverlappedRollouts` with ``rollout.mode=overlap``, else None."""
    if config.rollout.mode != "overlap":
        return None
    return OverlappedRollouts(config, rollout, trainer, engine, stages, loop_state.get("in_flight", {}), waits)
