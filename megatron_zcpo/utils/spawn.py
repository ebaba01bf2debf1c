"""Run a function in N local gloo processes and collect per-rank results (tests, benchmarks, convert/verify)."""

from __future__ import annotations

import io
import multiprocessing
import os
import queue as queue_module
import sys
import time
import traceback
from typing import Any, Callable, Iterable, List, Optional

import torch

from megatron_zcpo.utils.runtime import free_port

# Ranks are forked from a fork server that imported these once: spawning re-imported torch and
# megatron-core in every rank (~4 s of CPU each, most of a small multi-rank test). Importing starts no
# threads and touches no device, so forking afterwards is safe.
_RANK_PRELOAD = ["torch", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer"]


def preload_in_ranks(modules: Iterable[str]) -> None:
    """Add modules the fork server imports before it forks ranks (takes effect before the first run only)."""
    _RANK_PRELOAD.extend(name for name in modules if name not in _RANK_PRELOAD)


def rank_context():
    """The multiprocessing context ranks start from: a fork server with :func:`preload_in_ranks`' modules
    imported once (for raw rank processes a caller starts and stops itself)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_PRELOAD)
    return ctx


class DistributedRunFailure(AssertionError):
    """A rank raised, crashed or timed out; the message carries that rank's traceback."""


def _serialize(value: Any) -> bytes:
    # torch.save, not the queue's own pickler: torch registers shared-memory reductions on
    # multiprocessing's pickler, and those need the child alive until the parent reads.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _deserialize(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)


def _child(fn, rank, world_size, port, args, kwargs, parent, env, results):
    # What spawn gave a rank: the caller's environment, directory and import path now, not the fork
    # server's from when it started (a test may have changed them since).
    os.environ.clear()
    os.environ.update(parent["environ"])
    os.chdir(parent["cwd"])
    sys.path[:] = parent["path"]
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # N ranks share a couple of cores: oversubscription only slows them
    try:
        value = fn(rank, world_size, *args, **kwargs)
        results.put((rank, True, _serialize(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: Optional[dict] = None,
    **kwargs: Any,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` in ``world_size`` processes forked from a fork server.

    Each process gets torchrun-style environment variables (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT on a free local port), so ``setup_megatron()`` inside ``fn`` joins one gloo group.
    ``fn`` must be importable (a module-level function). Returns the list of per-rank return
    values (moved through ``torch.save``). Raises :class:`DistributedRunFailure` with the failing
    rank's traceback if any rank raises, dies, or the whole run exceeds ``timeout`` seconds; the
    other ranks are then terminated.
    """
    __tracebackhide__ = True  # pytest: show the rank's traceback, not this function's frames

    ctx = rank_context()
    results = ctx.Queue()
    port = free_port()
    parent = {"environ": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path)}
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, args, kwargs, parent, dict(env or {}), results),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict = {}
    deadline = time.monotonic() + timeout
    failure: Optional[str] = None
    try:
        while len(collected) < world_size and failure is None:
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
                if dead:
                    failure = f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                elif time.monotonic() > deadline:
                    waiting = [r for r in range(world_size) if r not in collected]
                    failure = f"timed out after {timeout:.0f}s waiting for ranks {waiting}"
                continue
            if ok:
                collected[rank] = _deserialize(payload)
            else:
                failure = f"rank {rank} of {world_size} failed:\n{payload}"
    finally:
        for proc in procs:
            proc.join(timeout=10 if failure is None else 0.5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    if failure is not None:
        raise DistributedRunFailure(failure)
    return [collected[rank] for rank in range(world_size)]
