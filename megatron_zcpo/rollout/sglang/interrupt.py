"""Interrupting the SGLang client's generate() call from another thread (a stop request during a step's rollout).

:class:`InterruptibleGeneration` is a mixin of :class:`~megatron_zcpo.rollout.sglang.client.SGLangEngine`:
``interrupt_generation()`` (any thread) wakes the call's coroutine on the client's loop, which cancels
its requests; each cancelled request is aborted on its server (``POST /abort_request`` {rid}, the path a
timed-out request takes), so the servers stop generating too, and the call raises
:class:`~megatron_zcpo.rollout.engine.RolloutInterrupted` once those aborts were answered (5 s at most each).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Awaitable, Set, TypeVar

from megatron_zcpo.rollout.engine import RolloutInterrupted

Result = TypeVar("Result")


class InterruptibleGeneration:
    """Mixin over an engine with ``_http`` (:class:`~megatron_zcpo.rollout.sglang.http.SGLangHTTP`);
    call :meth:`_init_interruptible` in ``__init__`` and run each generate() coroutine through
    :meth:`_unless_interrupted`."""

    def _init_interruptible(self) -> None:
        self._interrupted = threading.Event()  # the source of truth, read by calls that start later
        self._interrupt_waiters: Set[asyncio.Event] = set()  # (loop thread) one per call in progress

    def interrupt_generation(self) -> None:
        """From any thread: the generate() call in progress cancels its requests (each aborted on its
        server) and raises :class:`RolloutInterrupted`; so does every later call until :meth:`clear_interrupt`."""
        self._interrupted.set()
        self._http.call_soon(self._wake_interrupted)  # type: ignore[attr-defined]

    def clear_interrupt(self) -> None:
        self._interrupted.clear()

    def _wake_interrupted(self) -> None:  # on the loop thread
        for waiter in self._interrupt_waiters:
            waiter.set()

    async def _unless_interrupted(self, work: Awaitable[Result]) -> Result:
        """``work``'s result; when :meth:`interrupt_generation` comes first (or came already), ``work`` is
        cancelled, its cleanup (the aborts on the servers) awaited, and :class:`RolloutInterrupted` raised."""
        waiter = asyncio.Event()
        if self._interrupted.is_set():
            waiter.set()
        # (registered before the next await: a wake-up scheduled after the check above finds it)
        self._interrupt_waiters.add(waiter)
        task = asyncio.ensure_future(work)
        interrupted = asyncio.ensure_future(waiter.wait())
        first_interrupted = False
        try:
            await asyncio.wait({task, interrupted}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._interrupt_waiters.discard(waiter)
            interrupted.cancel()
            if not task.done():  # interrupted, or the caller's own cancellation: end the requests first
                first_interrupted = waiter.is_set()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if first_interrupted:
            raise RolloutInterrupted("the SGLang client's generation was interrupted (a stop request)")
        return task.result()
