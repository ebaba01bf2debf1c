"""A pool of worker processes that run a reward function by dotted path, killing and replacing hung workers."""

from __future__ import annotations

import collections
import dataclasses
import importlib
import math
import multiprocessing
import multiprocessing.connection
import numbers
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
    """Worker process loop: resolve the function, then answer ``(task_id, args)`` requests until ``None``."""
    try:
        function = resolve_function(function_path)
    except BaseException:
        connection.send(("load_error", traceback.format_exc()))
        return
    connection.send(("ready", None))
    while True:
        try:
            request = connection.recv()
        except EOFError:  # the parent went away without close()
            return
        if request is None:
            return
        task_id, args = request
        try:
            value = function(*args)
        except BaseException:  # noqa: BLE001 - any failure of user code is reported, never fatal to the worker
            connection.send(("result", (task_id, CallOutcome("error", error=traceback.format_exc()))))
            continue
        if isinstance(value, numbers.Real):
            outcome = CallOutcome("ok", value=float(value))
        else:
            outcome = CallOutcome("invalid", error=f"{type(value).__name__} {repr(value)[:200]}")
        connection.send(("result", (task_id, outcome)))


class _Worker:
    """One worker process, its pipe and the call it is running."""

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
        self.task: Optional[int] = None
        self.deadline = math.inf

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
    ``multiprocessing.connection.wait`` (no signals), so ``map`` works from any thread.
    The function is imported here first, so a bad path fails at construction.
    """

    def __init__(
        self,
        function_path: str,
        num_workers: int,
        timeout_s: float,
        start_method: str = "forkserver",
        startup_timeout_s: float = 120.0,
    ):
        resolve_function(function_path)
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.function_path = function_path
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.restarts = 0
        self._context = multiprocessing.get_context(start_method)
        self._workers: List[_Worker] = [self._start_worker() for _ in range(num_workers)]

    def _start_worker(self) -> _Worker:
        return _Worker(self._context, self.function_path, self.startup_timeout_s)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = self._start_worker()
        self.restarts += 1

    def map(self, calls: Sequence[Tuple[Any, ...]]) -> List[CallOutcome]:
        """Run the function once per argument tuple; returns one :class:`CallOutcome` per call, in order."""
        if not self._workers:
            raise RuntimeError("RewardWorkerPool.map called after close()")
        for worker in list(self._workers):
            if worker.task is not None:  # still busy from a map that was interrupted: its answer is stale
                self._replace(worker)
        outcomes: List[Optional[CallOutcome]] = [None] * len(calls)
        pending = collections.deque(range(len(calls)))
        while pending or any(worker.task is not None for worker in self._workers):
            for worker in list(self._workers):
                if worker.ready and worker.task is None and pending:
                    self._dispatch(worker, pending, calls)
            now = time.monotonic()
            waiting = [w for w in self._workers if w.task is not None or not w.ready]
            next_deadline = min(w.deadline if w.ready else w.startup_deadline for w in waiting)
            multiprocessing.connection.wait(
                [w.connection for w in waiting] + [w.process.sentinel for w in waiting],
                timeout=max(0.0, next_deadline - now),
            )
            for worker in list(self._workers):
                self._collect(worker, outcomes)
        return outcomes  # type: ignore[return-value]

    def _dispatch(self, worker: _Worker, pending: collections.deque, calls: Sequence[Tuple[Any, ...]]) -> None:
        task_id = pending.popleft()
        try:
            worker.connection.send((task_id, tuple(calls[task_id])))
        except OSError:
            # the worker died while idle: the call never ran, so it goes back to the queue
            pending.appendleft(task_id)
            self._replace(worker)
            return
        worker.task = task_id
        worker.deadline = time.monotonic() + self.timeout_s

    def _collect(self, worker: _Worker, outcomes: List[Optional[CallOutcome]]) -> None:
        """Take a finished result, a readiness message, or handle a dead or overdue worker."""
        message = None
        if worker.connection.poll():
            try:
                message = worker.connection.recv()
            except (EOFError, ConnectionResetError):
                message = None
        if message is not None:
            kind, payload = message
            if kind == "ready":
                worker.ready = True
            elif kind == "load_error":
                self.close()
                raise RewardFunctionLoadError(f"reward worker could not load {self.function_path!r}:\n{payload}")
            else:
                task_id, outcome = payload
                outcomes[task_id] = outcome
                worker.task = None
                worker.deadline = math.inf
            return
        if not worker.process.is_alive():
            if worker.task is not None:
                outcomes[worker.task] = CallOutcome(
                    "died", error=f"reward worker exited with code {worker.process.exitcode} during the call"
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
        if worker.task is not None and now >= worker.deadline:
            outcomes[worker.task] = CallOutcome("timeout", error=f"no result within {self.timeout_s:g} s; worker killed")
            self._replace(worker)
        elif not worker.ready and now >= worker.startup_deadline:
            self.close()
            raise RewardFunctionLoadError(
                f"reward worker for {self.function_path!r} did not start within {self.startup_timeout_s:g} s"
            )

    def close(self) -> None:
        """Stop all workers: idle ones exit cleanly, busy ones are killed. Idempotent."""
        workers, self._workers = self._workers, []
        for worker in workers:
            if worker.task is not None:
                worker.kill()
                continue
            try:  # a worker still starting reads this right after its readiness message
                worker.connection.send(None)
            except OSError:  # it already exited
                pass
        for worker in workers:
            if worker.task is None:
                worker.process.join(timeout=5.0)
                if worker.process.is_alive():
                    worker.kill()
                else:
                    worker.connection.close()

    def __enter__(self) -> "RewardWorkerPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
