"""Overlapped rollouts: collect step k+1's rollout in a background thread while step k trains.

The engine generates with the weights it holds (one version behind the trainer); the caller pushes
new weights only between two generations (after :meth:`RolloutPrefetch.take`, before the next
:meth:`RolloutPrefetch.launch`), so a generation never sees a half-pushed model. Works with any
engine whose ``generate`` may run in another thread than the one that later pushes weights
(the SGLang client, the embedded engine).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from megatron_zcpo.rollout.engine import RolloutError

Collected = Tuple[list, Dict[str, float]]  # (samples, metrics) of one step's rollout


class RolloutPrefetch:
    """At most one rollout in flight: ``collect(step)`` runs in a daemon thread.

    ``take(step)`` returns step ``step``'s rollout (collecting it now when none is in flight, e.g.
    at the first step) with the seconds the caller waited for it; ``launch(step)`` starts the
    next one. ``engine_wait_s`` is how long the engine sat idle between the end of one
    generation and the start of the next (the weight push and the caller's bookkeeping).
    """

    def __init__(self, collect: Callable[[int], Collected]):
        self._collect = collect
        self._thread: Optional[threading.Thread] = None
        self._step: Optional[int] = None
        self._result: Optional[Collected] = None
        self._error: Optional[BaseException] = None
        self._finished_at: Optional[float] = None
        self.engine_wait_s = 0.0

    @property
    def pending_step(self) -> Optional[int]:
        """The step whose rollout is in flight or ready, or None."""
        return self._step

    def launch(self, step: int) -> None:
        """Start collecting step ``step``'s rollout in the background."""
        if self._step is not None:
            raise RuntimeError(f"rollout of step {self._step} is still pending; take it before launching step {step}")
        started = time.perf_counter()
        self.engine_wait_s = 0.0 if self._finished_at is None else started - self._finished_at
        self._step, self._result, self._error = step, None, None
        self._thread = threading.Thread(target=self._run, args=(step,), name=f"rollout-step-{step}", daemon=True)
        self._thread.start()

    def _run(self, step: int) -> None:
        try:
            self._result = self._collect(step)
        except BaseException as error:
            self._error = error
        finally:
            self._finished_at = time.perf_counter()

    def wait(self) -> Optional[Collected]:
        """Block until the rollout in flight is collected and return it (it stays pending)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error, self._step = self._error, None, None
            raise error
        return self._result

    def take(self, step: int) -> Tuple[Collected, float]:
        """Step ``step``'s rollout and the seconds waited for it; the slot is then free."""
        if self._step is None:
            self.launch(step)
        elif self._step != step:
            raise RuntimeError(f"the rollout in flight is for step {self._step}, not {step}")
        started = time.perf_counter()
        result = self.wait()
        waited = time.perf_counter() - started
        self._step, self._result = None, None
        return result, waited

    def restore(self, step: int, result: Collected) -> None:
        """Make ``result`` (a rollout recorded in a checkpoint) the pending one of step ``step``."""
        if self._step is not None:
            raise RuntimeError(f"rollout of step {self._step} is pending; cannot restore step {step}")
        self._step, self._result = step, result

    def close(self) -> None:
        """Wait for a rollout in flight (a daemon thread must not outlive the engine it uses)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def staleness_metrics(versions: Sequence[Optional[int]], trainer_version: int, max_staleness: int) -> Dict[str, float]:
    """``rollout/staleness_{mean,max}`` of samples generated with weight ``versions`` and trained
    at ``trainer_version``; raises ``RolloutError`` naming the versions when a sample is staler
    than ``max_staleness`` (e.g. a server still serving old weights after a failed push)."""
    if any(v is None for v in versions):
        raise RolloutError("overlapped rollouts need each completion's weight_version; the engine reported none")
    lags = [trainer_version - int(v) for v in versions]
    if max(lags) > max_staleness:
        raise RolloutError(
            f"samples generated with weight versions {sorted(set(versions))} are more than "
            f"rollout.max_staleness={max_staleness} behind the trainer's version {trainer_version}"
        )
    return {"rollout/staleness_mean": sum(lags) / len(lags), "rollout/staleness_max": float(max(lags))}


def in_flight_state(prefetch: RolloutPrefetch) -> Dict[str, Any]:
    """The rollout in flight as checkpoint state ({} when none): waits for it to be collected."""
    if prefetch.pending_step is None:
        return {}
    samples, metrics = prefetch.wait()
    return {"step": prefetch.pending_step, "samples": samples, "metrics": metrics}
