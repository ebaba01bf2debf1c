"""A pool of worker processes that run a reward function by dotted path, killing and replacing hung workers."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import math
import multiprocessing
import multiprocessing.connection
import numbers
import threading
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence, Tuple


class RewardFunctionLoadError(RuntimeError):
    """The reward function cannot be imported (a configuration error, fatal for the run)."""


def resolve_function(path: str) -> Callable[..., Any]:
    """Import a callable from ``"pkg.module:function"`` or ``"pkg.module.function"``.

    The part after ``:`` may be an attribute chain (``"pkg.module:Class.method"``).
    Raises :class:`RewardFunctionLoadError` naming the path when it cannot be imported or is not callable.
    """
    if ":" in path:
        module_name, _, attribute = path.partition(":")
    else:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise RewardFunctionLoadError(
            f"reward function path {path!r} must look like 'pkg.module:function' or 'pkg.module.function'"
        )
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise RewardFunctionLoadError(
            f"cannot import module {module_name!r} of reward function {path!r}: {error}"
        ) from error
    for name in attribute.split("."):
        if not hasattr(value, name):
            raise RewardFunctionLoadError(f"reward function {path!r}: {value!r} has no attribute {name!r}")
        value = getattr(value, name)
    if not callable(value):
        raise RewardFunctionLoadError(f"reward function {path!r} is a {type(value).__name__}, not a callable")
    return value


@dataclasses.dataclass
class CallOutcome:
    """The result of one reward call.

    status: "ok" (``value`` is the returned number, possibly NaN), "invalid" (the function returned a
    non-number; ``error`` holds its repr), "error" (it raised; ``error`` holds the traceback), "timeout"
    (its worker was killed) or "died" (its worker process exited during the call).
    """

    status: str
    value: Optional[float] = None
    error: Optional[str] = None


def _worker_main(function_path: str, connection) -> None:
    """Worker process loop: resolve the function, then run chunks (lists of argument tuples) until ``None``,
    sending one ``("result", CallOutcome)`` per call as soon as it finishes, in the chunk's order."""
    try:
        function = resolve_function(function_path)
    except BaseException:
        connection.send(("load_error", traceback.format_exc()))
        return
    connection.send(("ready", None))
    while True:
        try:
            chunk = connection.recv()
        except EOFError:  # the parent went away without close()
            return
        if chunk is None:
            return
        for args in chunk:
            # one message per result (not per chunk): the parent restarts the next call's timeout on it
            connection.send(("result", _run_call(function, args)))


def _run_call(function: Callable[..., Any], args: Tuple[Any, ...]) -> CallOutcome:
    """``function(*args)`` as a :class:`CallOutcome`: "ok", "invalid" (a non-number) or "error" (it raised)."""
    try:
        value = function(*args)
    except BaseException:
        return CallOutcome("error", error=traceback.format_exc())
    if isinstance(value, numbers.Real):
        return CallOutcome("ok", value=float(value))
    return CallOutcome("invalid", error=f"{type(value).__name__} {repr(value)[:200]}")


class _Worker:
    """One worker process, its pipe and the calls sent to it that it has not answered yet."""

    def __init__(self, context, function_path: str, startup_timeout_s: float):
        self.connection, child_connection = context.Pipe()
        # daemon: an abandoned pool never keeps the trainer's process alive
        self.process = context.Process(
            target=_worker_main, args=(function_path, child_connection), daemon=True, name="zcpo-reward-worker"
        )
        self.process.start()
        child_connection.close()
        self.ready = False
        self.startup_deadline = time.monotonic() + startup_timeout_s
        # task ids of the current chunk not answered yet; the first is running, the rest wait behind it
        self.unanswered: collections.deque = collections.deque()
        self.deadline = math.inf  # for the running call

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.connection.close()


class RewardWorkerPool:
    """Runs ``function(*args)`` for many argument tuples in ``num_workers`` processes, each call bounded
    by ``timeout_s``.

    A call that raises, returns a non-number, overruns its timeout (the worker is killed) or kills its
    worker yields a :class:`CallOutcome` saying so; killed or dead workers are replaced, so the pool
    survives any reward function. Timeouts are enforced by the calling thread with
    ``multiprocessing.connection.wait`` (no signals), so ``map`` works from any thread; calls from several
    threads at once (an asynchronous rollout's producer beside an evaluation) run one ``map`` after the other.
    The function is imported here first, so a bad path fails at construction.

    Calls go to a worker in chunks of up to ``max_chunk_size`` (one message each way per call costs two
    process wake-ups, far more than a microsecond reward); the worker streams back one result per call,
    and each call still gets its own ``timeout_s``, counted from the previous result of its chunk. Calls
    of a chunk left unanswered when its worker is killed or dies run again, first, on a new worker.
    ``max_chunk_size=1`` sends one call per message.
    """

    def __init__(
        self,
        function_path: str,
        num_workers: int,
        timeout_s: float,
        start_method: str = "forkserver",
        startup_timeout_s: float = 120.0,
        max_chunk_size: int = 64,
    ):
        resolve_function(function_path)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if max_chunk_size < 1:
            raise ValueError(f"max_chunk_size must be >= 1, got {max_chunk_size}")
        self.function_path = function_path
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.max_chunk_size = max_chunk_size
        self.restarts = 0
        self._context = multiprocessing.get_context(start_method)
        self._workers: List[_Worker] = [self._start_worker() for _ in range(num_workers)]
        self._one_map_at_a_time = threading.Lock()  # the workers' pipes carry one map's calls

    def _start_worker(self) -> _Worker:
        return _Worker(self._context, self.function_path, self.startup_timeout_s)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = self._start_worker()
        self.restarts += 1

    def map(self, calls: Sequence[Tuple[Any, ...]]) -> List[CallOutcome]:
        """Run the function once per argument tuple; returns one :class:`CallOutcome` per call, in order."""
        with self._one_map_at_a_time:
            return self._map(calls)

    def _map(self, calls: Sequence[Tuple[Any, ...]]) -> List[CallOutcome]:
        if not self._workers:
            raise RuntimeError("RewardWorkerPool.map called after close()")
        for worker in list(self._workers):
            if worker.unanswered:  # still busy from a map that was interrupted: its answers are stale
                self._replace(worker)
        outcomes: List[Optional[CallOutcome]] = [None] * len(calls)
        pending = collections.deque(range(len(calls)))
        while pending or any(worker.unanswered for worker in self._workers):
            for worker in list(self._workers):
                if worker.ready and not worker.unanswered and pending:
                    self._dispatch(worker, pending, calls)
            now = time.monotonic()
            waiting = [w for w in self._workers if w.unanswered or not w.ready]
            next_deadline = min(w.deadline if w.ready else w.startup_deadline for w in waiting)
            multiprocessing.connection.wait(
                [w.connection for w in waiting] + [w.process.sentinel for w in waiting],
                timeout=max(0.0, next_deadline - now),
            )
            for worker in list(self._workers):
                self._collect(worker, outcomes, pending)
        return outcomes  # type: ignore[return-value]

    def _chunk_size(self, num_pending: int) -> int:
        """Calls for the next chunk: a quarter of each worker's share of what is left, so the last chunks
        shrink and the workers finish together, capped at ``max_chunk_size`` (already 1/64 of the
        per-message cost; bigger chunks only make larger messages and more calls to rerun after a kill)."""
        return max(1, min(self.max_chunk_size, math.ceil(num_pending / (4 * len(self._workers)))))

    def _dispatch(self, worker: _Worker, pending: collections.deque, calls: Sequence[Tuple[Any, ...]]) -> None:
        chunk = [pending.popleft() for _ in range(self._chunk_size(len(pending)))]
        try:
            worker.connection.send([tuple(calls[task_id]) for task_id in chunk])
        except OSError:
            # the worker died while idle: no call of the chunk ran, so they all go back to the queue's front
            pending.extendleft(reversed(chunk))
            self._replace(worker)
            return
        worker.unanswered.extend(chunk)
        worker.deadline = time.monotonic() + self.timeout_s

    def _collect(self, worker: _Worker, outcomes: List[Optional[CallOutcome]], pending: collections.deque) -> None:
        """Take every result and readiness message waiting, or handle a dead or overdue worker."""
        if self._take_messages(worker, outcomes):
            return  # a dead worker is noticed on a later pass, once its pipe is empty
        if not worker.process.is_alive():
            self._take_messages(worker, outcomes)  # what it sent between the poll and its exit
            if worker.unanswered:
                self._fail_running_call(
                    worker,
                    outcomes,
                    pending,
                    CallOutcome(
                        "died", error=f"reward worker exited with code {worker.process.exitcode} during the call"
                    ),
                )
            elif not worker.ready:
                self.close()
                raise RewardFunctionLoadError(
                    f"reward worker for {self.function_path!r} exited with code {worker.process.exitcode} "
                    "before it was ready"
                )
            self._replace(worker)
            return
        now = time.monotonic()
        if worker.unanswered and now >= worker.deadline:
            self._fail_running_call(
                worker,
                outcomes,
                pending,
                CallOutcome("timeout", error=f"no result within {self.timeout_s:g} s; worker killed"),
            )
            self._replace(worker)
        elif not worker.ready and now >= worker.startup_deadline:
            self.close()
            raise RewardFunctionLoadError(
                f"reward worker for {self.function_path!r} did not start within {self.startup_timeout_s:g} s"
            )

    def _take_messages(self, worker: _Worker, outcomes: List[Optional[CallOutcome]]) -> bool:
        """Read every message waiting from ``worker``; returns whether there was any."""
        received = False
        while worker.connection.poll():
            try:
                kind, payload = worker.connection.recv()
            except (EOFError, ConnectionResetError):
                break
            received = True
            if kind == "ready":
                worker.ready = True
            elif kind == "load_error":
                self.close()
                raise RewardFunctionLoadError(f"reward worker could not load {self.function_path!r}:\n{payload}")
            else:
                outcomes[worker.unanswered.popleft()] = payload
                # the worker starts the chunk's next call right after sending this result
                worker.deadline = time.monotonic() + self.timeout_s if worker.unanswered else math.inf
        return received

    @staticmethod
    def _fail_running_call(
        worker: _Worker, outcomes: List[Optional[CallOutcome]], pending: collections.deque, outcome: CallOutcome
    ) -> None:
        """Give the worker's running call ``outcome``; the chunk's calls behind it never ran (or their answers
        are lost with the worker), so they go back to the queue's front, in order, for the next worker."""
        outcomes[worker.unanswered.popleft()] = outcome
        pending.extendleft(reversed(worker.unanswered))
        worker.unanswered.clear()

    def close(self) -> None:
        """Stop all workers: idle ones exit cleanly, busy ones are killed. Idempotent."""
        workers, self._workers = self._workers, []
        for worker in workers:
            if worker.unanswered:
                worker.kill()
                continue
            # a worker still starting reads this right after its readiness message; OSError: it already exited
            with contextlib.suppress(OSError):
                worker.connection.send(None)
        for worker in workers:
            if not worker.unanswered:
                worker.process.join(timeout=5.0)
                if worker.process.is_alive():
                    worker.kill()
                else:
                    worker.connection.close()

    def __enter__(self) -> RewardWorkerPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
