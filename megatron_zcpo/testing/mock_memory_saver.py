"""The mock SGLang server's memory saver (``--enable-memory-saver``): release/resume by tag, a per-GPU ledger,
``/update_weights_from_tensor``, pause/continue, and the faults colocated runs meet.

Mixed into :class:`megatron_zcpo.testing.mock_server.MockSGLangServer`. Behaviour follows SGLang
0.5.3.post3 and 0.5.23 (see :mod:`megatron_zcpo.rollout.sglang.api`): tags per release (no tags:
all of them), a resume of a tag that is not released fails, ``/update_weights_from_tensor`` reads
blob k of ``serialized_named_tensors`` (flattened buckets or a list of (name, tensor)) as TP rank k
on ``gpus[k]`` does, seeing the server's GPUs (:mod:`megatron_zcpo.testing.fake_cuda_ipc`): a handle
of a GPU the server cannot see kills it, as SGLang's ``Invalid device_uuid`` does, and one of
another of its GPUs is recorded in ``foreign_opens``.
Where SGLang would silently corrupt memory the mock fails the request with 400 and the reason
(:class:`~megatron_zcpo.rollout.memory.MemoryPhaseError`): a generate or a weight update while
the memory it needs is released or generation is paused, a ``/continue_generation`` while the
memory a generation needs is released, a release while requests run, a release or resume out of
order, a generate after a release of the weights erased the parameters no push carries
(``static_scales``: FP8's activation scales; SGLang keeps only buffers across a release, 0.5.23
``managers/scheduler_components/weight_updater.py:478``, unless launched with
``--enable-weights-cpu-backup``). SGLang's health checks generate a token (``/health``, ``/health_generate``, both releases):
on released memory the mock dies (``crashed``), as the server would, and while paused it answers
503, as the server does after its 20 s. Without ``memory_saver`` SGLang's releases answer 200 and free
nothing (its no-op adapter): so does the mock, and ``/get_server_info`` says
``enable_memory_saver: false``. Faults (``faults[path]``): "late_release" (the release answers,
the memory is freed ``release_lag_s`` later), "502" (answered before anything happens), "die"
(the server stops answering anything from this request on: died mid-update).
"""

from __future__ import annotations

import pickle
import threading
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_zcpo.rollout.memory import NEEDS, WEIGHTS, EngineMemory, MemoryLedger, MemoryPhaseError
from megatron_zcpo.rollout.sglang.api import MEMORY_TAGS_BY_RELEASE

MEMORY_FAULTS = ("late_release", "502", "die")


class MemorySaverEndpoints:
    """State and handlers of the memory saver; :meth:`_init_memory_saver` from the server's constructor."""

    def _init_memory_saver(
        self,
        memory_saver: bool,
        gpus: Sequence[int],
        memory_sizes: Optional[Dict[str, int]],
        ledger: Optional[MemoryLedger],
        release_lag_s: float,
    ) -> None:
        self.memory_saver, self.release_lag_s, self.paused, self.dead = memory_saver, release_lag_s, False, False
        self.foreign_opens: List[Tuple[int, int]] = []  # (TP rank, the other GPU whose memory it opened)
        tags = MEMORY_TAGS_BY_RELEASE[self.release]
        self.memory = EngineMemory(
            f"sglang:{self.port or id(self)}",
            gpus,
            memory_sizes or {tag: 1 for tag in tags},
            ledger or MemoryLedger(max(gpus) + 1),
            tags=tags,
        )
        self._handlers.update(
            {
                "/release_memory_occupation": self._release_memory,
                "/resume_memory_occupation": self._resume_memory,
                "/update_weights_from_tensor": self._update_from_tensor,
                "/pause_generation": self._pause,
                "/continue_generation": self._continue,
            }
        )

    def memory_refusal(self, action: str) -> Optional[str]:
        """Why ``action`` ("generate", "update_weights") must fail now, or None."""
        if action == "generate" and self.paused:
            return "generate while generation is paused (/continue_generation first)"
        if not self.memory_saver:
            return None
        try:
            self.memory.require(action)
        except MemoryPhaseError as err:
            return str(err)
        lost = sorted(name for name, scale in self.static_scales.items() if scale.isnan().any())
        if action == "generate" and lost:
            return f"generate with {lost} lost at a release of the weights (no --enable-weights-cpu-backup)"
        return None

    @staticmethod
    def _refuse(message: str):
        from aiohttp import web

        return web.json_response({"error": {"message": message, "type": "Bad Request", "code": 400}}, status=400)

    async def _release_memory(self, request):
        from aiohttp import web

        body = (await request.json() if request.body_exists else None) or {}
        if self.running_rids:  # 0.5.23 asserts it; 0.5.3.post3 would free the KV pool under them
            return self._refuse("release_memory_occupation should be called only when server is idle.")
        if self.memory_saver:
            try:
                released = self.memory.release(body.get("tags"), late=request.get("fault") == "late_release")
            except MemoryPhaseError as err:
                return self._refuse(str(err))
            if WEIGHTS in released and not self.weights_cpu_backup:  # SGLang stashes the buffers only
                for scale in self.static_scales.values():
                    scale.fill_(float("nan"))
            if self.memory.pending:
                threading.Timer(self.release_lag_s, self.memory.free_pending).start()
        return web.json_response(None)

    async def _resume_memory(self, request):
        from aiohttp import web

        body = (await request.json() if request.body_exists else None) or {}
        if self.memory_saver:
            try:
                self.memory.resume(body.get("tags"))
            except MemoryPhaseError as err:
                return self._refuse(str(err))
        return web.json_response(None)

    async def _pause(self, request):
        from aiohttp import web

        self.paused = True
        self.running_rids.clear()  # 0.5.3.post3 aborts what runs
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    def health_generation(self, request) -> int:
        """The status of SGLang's generating health check (``/health``, ``/health_generate``): 503 while
        generation is paused (it waits 20 s for a token that never comes); on released memory the token
        runs on freed memory and the server dies; else 200."""
        released = self._released_for_generation()
        if released and not self.paused:
            self.crashed = f"{request.path} generated a token while {released} released (illegal memory access)"
            request.transport.close()
            raise ConnectionResetError(self.crashed)
        return 503 if self.paused else 200

    def _released_for_generation(self) -> list:
        """The released tags a generation would use (none without the memory saver)."""
        if not self.memory_saver:
            return []
        return [tag for tag in NEEDS["generate"] if tag in self.memory.tags and tag in self.memory.released]

    async def _continue(self, request):
        from aiohttp import web

        released = self._released_for_generation()
        if released:  # SGLang would let the parked and the next requests run on the freed memory
            return self._refuse(f"continue_generation while {released} released: requests would run on freed memory")
        self.paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _update_from_tensor(self, request):
        body = await request.json()
        refusal = self.memory_refusal("update_weights")
        if refusal:
            return self._result(False, refusal)
        if self.sessions and not self.session_open:  # SGLang >= 0.5.21's weight_updater.py
            return self._result(
                False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
            )
        blobs = body["serialized_named_tensors"]
        if len(blobs) != self.tp_size:  # one blob per TP rank
            return self._result(False, f"serialized_named_tensors has {len(blobs)} blobs for tp_size {self.tp_size}")
        from megatron_zcpo.testing.fake_cuda_ipc import HandleError

        try:
            received = [self._open_blob(rank, blob) for rank, blob in enumerate(blobs)]
        except HandleError as err:  # SGLang raises in its scheduler, uncaught: the server dies
            self.crashed = f"/update_weights_from_tensor: {err}"
            request.transport.close()
            raise ConnectionResetError(self.crashed) from None
        except (ValueError, pickle.UnpicklingError, EOFError) as err:
            return self._result(False, f"Failed to update weights: {err!r}")

        def load():
            if body.get("load_format") == "flattened_bucket":
                flats = [payload["flattened_tensor"] for payload in received]
                if any(not flat.equal(flats[0]) for flat in flats):
                    raise ValueError("the TP ranks' blobs hold different buckets")
                tensors = [
                    (meta.name, flats[0][meta.start_idx : meta.end_idx].reshape(meta.shape).to(meta.dtype))
                    for meta in received[0]["metadata"]
                ]
            else:
                tensors = received[0]
            self._load(tensors, body.get("weight_version"))

        try:
            await self._one_at_a_time(request.path, None, load)
        except (KeyError, ValueError, AttributeError) as err:
            return self._result(False, f"Failed to update weights: {err!r}")
        return self._result(True, "Success")

    def _open_blob(self, tp_rank: int, blob: str):
        """What TP rank ``tp_rank`` (on ``gpus[tp_rank]``, seeing this server's GPUs) unpickles from ``blob``;
        a handle it opens on another of the server's GPUs than its own is recorded in ``foreign_opens``
        (SGLang takes it, with a second CUDA context on that GPU)."""
        from megatron_zcpo.testing.fake_cuda_ipc import fake_device_uuid, load_blob

        received = load_blob(blob, [fake_device_uuid(gpu) for gpu in self.memory.gpus])
        flat = received.get("flattened_tensor") if isinstance(received, dict) else None
        opened = getattr(flat, "fake_device", tp_rank)
        if opened != tp_rank:
            self.foreign_opens.append((tp_rank, self.memory.gpus[opened]))
        return received
