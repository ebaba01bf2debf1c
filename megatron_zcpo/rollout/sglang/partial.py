"""Partial rollouts on SGLang servers: pause, push, continue; per-token weight versions; submitted requests.

Asynchronous rollouts (``rollout.mode=async``) push weights while requests are in flight. Around
every push the client pauses the servers (``/pause_generation``) in the mode their release has
(:data:`PAUSE_MODES`, read from the wheels, :mod:`megatron_zcpo.rollout.sglang.api`):

- "retract" (SGLang 0.5.23): the server moves the running requests back to its queue and holds
  them with the tokens they have; after ``/continue_generation`` it prefills them again with the
  new weights and continues. The answer's ``meta_info.weight_versions`` spans ({version, start,
  end} over the output tokens) say which version produced which token.
- "abort" (every release; 0.5.3.post3's only one: its ``/pause_generation`` takes no body, aborts
  every request and holds new ones until ``/continue_generation``): each request in flight comes
  back with the tokens it had and finish reason "abort"; the client sends it again once generation
  continues, with the prompt and those tokens as its input ids (token in, token out: never
  re-tokenised) and the rest of its token budget, and lays the answers end to end
  (:func:`join_segments`), each answer's tokens carrying the version it reports.

"in_place" (0.5.23: keep the running requests and their KV cache computed with the old weights) is
not used: the tokens after the push would come from neither version's policy.

A server lost while paused: in "abort" mode the partial response is continued on another server
from the tokens it had; in "retract" mode the tokens were on the lost server and the request starts
again on another one (the client's retry of a failed request).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Dict, Optional, Sequence

from megatron_zcpo.rollout.engine import Completion, SamplingParams

PAUSE_MODES = ("auto", "abort", "retract")
RETRACT_SINCE = "0.5.23"  # the first release read with /pause_generation {mode: retract} and weight_versions spans
_SEGMENT_SEED_STRIDE = 1_000_003  # seeds of a sample's successive segments never meet


def join_segments(prompt: Sequence[int], segments: Sequence[Completion]) -> Completion:
    """One sample from the answers of its requests (a first one and its continuations), laid end to end."""
    last = segments[-1]
    if len(segments) == 1:
        return last
    return Completion(
        prompt_ids=list(prompt),
        output_ids=[t for s in segments for t in s.output_ids],
        output_logprobs=[lp for s in segments for lp in s.output_logprobs],
        finish_reason=last.finish_reason,
        weight_version=last.weight_version,
        info={**last.info, "segments": len(segments)},
        output_versions=[v for s in segments for v in s.token_versions],
    )


def continuation_sampling(sampling: Dict[str, Any], produced: int, segment: int) -> Dict[str, Any]:
    """SGLang ``sampling_params`` of a sample's continuation after ``produced`` tokens (its ``segment``-th
    request): the rest of the budget, and its own seed."""
    from megatron_zcpo.rollout.sglang.api import SEED_LIMIT

    sampling = dict(sampling, max_new_tokens=sampling["max_new_tokens"] - produced)
    if "sampling_seed" in sampling:
        sampling["sampling_seed"] = (sampling["sampling_seed"] + segment * _SEGMENT_SEED_STRIDE) % SEED_LIMIT
    return sampling


class PausableGeneration:
    """Pause / continue of the servers around a push, and :meth:`submit`'s requests; mixed into
    :class:`~megatron_zcpo.rollout.sglang.client.SGLangEngine` (its ``_http``, ``config``, ``_check_open``
    and ``_generate_all``)."""

    def _init_pausable(self) -> None:
        self._pause_epoch = 0  # pauses so far: an "abort" answer to a request sent before the last one is ours
        self._open: Optional[asyncio.Event] = None  # set while generation runs (made on the loop thread)
        self._resolved_pause_mode: Optional[str] = None
        self._submitted: set = set()
        self._submit_limit: Optional[asyncio.Semaphore] = None
        self.paused = False  # this client paused generation (a /health_generate would wait out its 20 s)

    def pause_mode(self) -> str:
        """ "retract" or "abort": the configured ``pause_mode``, "auto" resolved from the servers' release
        (retract where every server in rotation runs :data:`RETRACT_SINCE` or newer)."""
        from megatron_zcpo.rollout.sglang.api import SERVER_INFO_PATHS, release_at_least

        if self._resolved_pause_mode is None:
            mode = self.config.pause_mode
            if mode == "auto":
                infos = self._http.run(self._http.get_from_all_servers(SERVER_INFO_PATHS))
                newest = all(release_at_least(str(info.get("version", "")), RETRACT_SINCE) for info in infos)
                mode = "retract" if newest else "abort"
            self._resolved_pause_mode = mode
        return self._resolved_pause_mode

    def pause_generation(self) -> None:
        """``/pause_generation`` on every server in rotation (before a weight update), in :meth:`pause_mode`;
        no request of this client starts until :meth:`continue_generation`."""
        self._check_open()
        mode = self.pause_mode()
        self._http.run(self._set_open(False))
        # 0.5.3.post3 takes no body and aborts; 0.5.23 needs one (its mode defaults to "abort")
        body = {"mode": "retract"} if mode == "retract" else {}
        self._http.run(self._http.on_servers_in_rotation("POST", "/pause_generation", body))
        self.paused = True

    def continue_generation(self) -> None:
        """``/continue_generation`` on every server in rotation; held and aborted requests go on."""
        self._check_open()
        self._http.run(self._http.on_servers_in_rotation("POST", "/continue_generation", {}))
        self.paused = False
        self._http.run(self._set_open(True))

    async def _set_open(self, is_open: bool) -> None:
        event = self._open_event()
        if is_open:
            event.set()
        else:
            self._pause_epoch += 1
            event.clear()

    def _open_event(self) -> asyncio.Event:
        if self._open is None:  # on the loop thread: the event belongs to its loop
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    async def _wait_until_open(self) -> int:
        """Wait while paused; the pause epoch the request about to be sent belongs to."""
        await self._open_event().wait()
        return self._pause_epoch

    def _paused_since(self, epoch: int) -> bool:
        """Whether a pause came after a request of ``epoch`` was sent (its "abort" answer is then ours)."""
        return epoch != self._pause_epoch or not self._open_event().is_set()

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, n: int = 1) -> concurrent.futures.Future:
        """``n`` samples of one prompt as a future of their Completions (see :meth:`RolloutEngine.submit`);
        at most ``max_concurrency`` requests of all submitted ones run at once. Cancelling the future
        aborts its requests on the servers."""
        self._check_open()
        params.validate()

        async def group():
            if self._submit_limit is None:
                self._submit_limit = asyncio.Semaphore(self.config.max_concurrency)
            [completions] = await self._generate_all([list(prompt_ids)], params, n, limit=self._submit_limit)
            self.rejected_samples += sum("rejected" in c.info for c in completions)
            return completions

        future = self._http.submit(group())
        self._submitted.add(future)
        future.add_done_callback(self._submitted.discard)
        return future

    def abort_requests(self) -> int:
        """Cancel every submitted request in flight (each is aborted on its server); returns how many."""
        pending = [future for future in list(self._submitted) if not future.done()]
        for future in pending:
            future.cancel()
        concurrent.futures.wait(pending, timeout=self.config.connect_timeout_s)
        return len(pending)
