"""The mock SGLang server's continuous batching: /generate on the backend's asynchronous requests, and
/pause_generation in the modes of SGLang 0.5.3.post3 and 0.5.23 (read from their wheels).

Mixed into :class:`megatron_zcpo.testing.mock_server.MockSGLangServer` with ``continuous=True``; the
backend must take :meth:`~megatron_zcpo.rollout.engine.RolloutEngine.submit` (the embedded engine). As
both releases do (``tokenizer_manager``'s ``is_pause_cond``), a /generate that arrives while paused is
held until /continue_generation. Pause modes (:mod:`megatron_zcpo.rollout.sglang.partial`): 0.5.3.post3
takes no body and aborts every request ("abort"); 0.5.23 takes ``mode`` "abort" (its default),
"retract" (requests are held with their tokens and continue after /continue_generation with the
weights loaded meanwhile) or "in_place" (refused here: the client never sends it). An aborted request
answers 200 with the tokens it has and finish reason "abort". 0.5.23's answers carry
``meta_info.weight_versions`` spans; a cache flush while paused in "retract" mode succeeds (its
scheduler ignores the held requests), otherwise it is refused while requests run.
"""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Optional

from megatron_zcpo.rollout.sglang.api import PINNED_RELEASE


class ContinuousBatchingEndpoints:
    """State and handlers of continuous batching; :meth:`_init_continuous` from the server's constructor."""

    def _init_continuous(self, continuous: bool) -> None:
        self.continuous = continuous
        self.pause_modes: List[str] = []  # the mode of every /pause_generation served (tests)
        self._pause_mode: Optional[str] = None
        self._open: Optional[asyncio.Event] = None
        self._in_flight: Dict[str, Any] = {}  # rid -> the backend's future
        if continuous:
            self._handlers.update(
                {"/pause_generation": self._pause_continuous, "/continue_generation": self._continue_continuous}
            )

    def _open_event(self) -> asyncio.Event:
        if self._open is None:  # made on the server's loop
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    async def _complete_continuously(self, prompts, params, rid: str):
        """The backend's [[Completion]] of ``prompts`` (one sample each) as asynchronous requests, once not paused."""
        await self._open_event().wait()
        futures = [self.backend.submit(prompt, params, 1) for prompt in prompts]
        for index, future in enumerate(futures):
            self._in_flight[f"{rid}#{index}"] = future
        try:
            return [await asyncio.wrap_future(future) for future in futures]
        finally:
            for index in range(len(futures)):
                self._in_flight.pop(f"{rid}#{index}", None)

    def _abort_continuous(self, rid: Optional[str]) -> None:
        """End the requests of ``rid`` (None: all) with the tokens they have."""
        if rid is None:
            self.backend.abort_requests()
            return
        futures = [f for key, f in self._in_flight.items() if key.split("#")[0] == rid]
        if futures:
            self.backend.abort_requests(futures)

    def flush_refused(self) -> bool:
        """Whether /flush_cache must answer 400: requests run, unless held by a "retract" pause."""
        return bool(self.running_rids) and not (self.paused and self._pause_mode == "retract")

    async def _pause_continuous(self, request):
        from aiohttp import web

        try:
            body = await request.json()  # (read before by the dispatcher: aiohttp keeps it)
        except ValueError:
            body = None  # 0.5.3.post3's bodiless request
        mode = "abort" if self.release == PINNED_RELEASE else (body or {}).get("mode", "abort")
        if mode not in ("abort", "retract"):
            return web.json_response({"error": {"message": f"mock: pause mode {mode!r}"}}, status=400)
        self.pause_modes.append(mode)
        self.paused, self._pause_mode = True, mode
        self._open_event().clear()
        if mode == "abort":
            await self._blocking(self.backend.abort_requests)
        else:
            await self._blocking(self.backend.pause_generation)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue_continuous(self, request):
        from aiohttp import web

        if self._pause_mode == "retract":
            await self._blocking(self.backend.continue_generation)
        self.paused, self._pause_mode = False, None
        self._open_event().set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})
