"""The embedded engine's asynchronous requests: a scheduler thread that batches them, holds them across
weight pushes and continues them from the tokens they have (partial rollouts on a CPU).

:class:`AsyncBatcher` is what :meth:`EmbeddedEngine.submit` and the engine's pause / continue / abort
hand their work to; it behaves like an SGLang 0.5.23 server paused in "retract" mode. A request is
one prompt's ``n`` samples. The thread decodes batches of the rows (samples) of the requests
waiting, and resolves a request's future as soon as its last row has finished. Between two decode
steps it stops a batch for :meth:`pause` (the rows keep the tokens they have; their KV cache is
dropped), or when new requests wait and half the batch's rows have finished (so finished rows stop
costing decode steps). A stopped row is continued in a later batch, prefilled from its prompt and
the ids it has produced (token in, token out), with the weights the engine holds then: every token
records the weight version that produced it and the log-prob it was drawn with.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from megatron_zcpo.rollout.engine import Completion, RolloutError, SamplingParams


@dataclass
class _Row:
    """One sample of a request as it grows."""

    request: _Request
    ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    finish: Optional[str] = None  # "stop" | "length" | "abort" once finished


@dataclass
class _Request:
    """One prompt's ``n`` samples and the future their completions resolve."""

    prompt: List[int]
    params: SamplingParams
    budget: int  # new tokens per sample: max_new_tokens, cut to the model's context
    future: concurrent.futures.Future
    rows: List[_Row] = field(default_factory=list)

    def completions(self) -> List[Completion]:
        return [
            Completion(
                prompt_ids=list(self.prompt),
                output_ids=list(row.ids),
                output_logprobs=list(row.logprobs),
                finish_reason=row.finish or "abort",
                weight_version=row.versions[-1] if row.versions else None,
                output_versions=list(row.versions),
            )
            for row in self.rows
        ]


def _sampling_key(params: SamplingParams) -> tuple:
    """What rows of one batch must share (each row keeps its own budget)."""
    return (params.temperature, params.top_p, params.top_k, params.stop_token_ids)


class AsyncBatcher:
    """The scheduler thread of one :class:`~megatron_zcpo.rollout.embedded.EmbeddedEngine` (see the module
    docstring; a cancelled future's request is dropped at the next batch). ``engine``: its ``_prefill``, ``_decode_step``, ``max_batch_size``, ``model_config``
    and served ``weight_version()``; ``generator``: the torch.Generator every draw takes from;
    ``sample``: (logits [B, V], params, generator) -> (tokens [B], log-probs [B]), the engine's sampler."""

    def __init__(self, engine, generator: torch.Generator, sample: Callable):
        self.engine = engine
        self.generator = generator
        self.sample = sample
        self._requests: List[_Request] = []  # in flight, in submission order
        self._condition = threading.Condition()
        self._pauses = 0  # pause() calls not yet resumed (they nest: a weight load inside a pause)
        self._decoding = False  # a batch is running (a pause waits for it to stop)
        self._interrupt = threading.Event()  # stop the running batch at the next decode step
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self.batches = 0  # batches decoded (tests, benchmarks)
        self.decode_steps = 0

    # -- the caller's side ---------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], params: SamplingParams, n: int) -> concurrent.futures.Future:
        """Queue one prompt's ``n`` samples; the future resolves with their Completions."""
        context = self.engine.model_config.max_position_embeddings
        request = _Request(
            list(prompt), params, min(params.max_new_tokens, context - len(prompt)), concurrent.futures.Future()
        )
        request.rows = [_Row(request) for _ in range(n)]
        with self._condition:
            if self._closed:
                raise RolloutError("the embedded engine was shut down")
            self._requests.append(request)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="embedded-async", daemon=True)
                self._thread.start()
            self._condition.notify_all()
        return request.future

    def pause(self) -> None:
        """Hold every request once the running batch has stopped (returns then: no forward runs).
        Pauses nest: requests continue after as many :meth:`resume` calls."""
        with self._condition:
            self._pauses += 1
            self._interrupt.set()
            self._condition.wait_for(lambda: not self._decoding)

    def resume(self) -> None:
        """Let the requests continue (with whatever weights the engine holds now)."""
        with self._condition:
            self._pauses = max(0, self._pauses - 1)
            self._condition.notify_all()

    def abort(self, futures: Optional[Sequence[concurrent.futures.Future]] = None) -> int:
        """End requests in flight now (every one, or those of ``futures``): their futures resolve with the
        tokens they have, unfinished samples as "abort". Returns how many ended."""
        with self._condition:
            self._pauses += 1  # no new batch may start before the ended requests are out
            self._interrupt.set()
            self._condition.wait_for(lambda: not self._decoding)
            ended = [r for r in self._requests if futures is None or any(r.future is f for f in futures)]
            self._requests = [r for r in self._requests if r not in ended]
            self._pauses -= 1
            self._condition.notify_all()
        for request in ended:
            if not request.future.cancelled():
                request.future.set_result(request.completions())
        return len(ended)

    def close(self) -> None:
        """Abort what is in flight and stop the thread."""
        with self._condition:
            self._closed = True
        self.abort()
        with self._condition:
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)

    # -- the scheduler thread ------------------------------------------------------------------

    def _next_batch(self) -> List[_Row]:
        """Unfinished rows of the requests in flight, oldest request first, sharing the first one's
        sampling settings, at most ``max_batch_size``; waits while paused or idle. [] once closed."""
        with self._condition:
            while True:
                self._condition.wait_for(lambda: self._closed or (not self._pauses and self._requests))
                if self._closed:
                    return []
                self._requests = [r for r in self._requests if not r.future.cancelled()]  # given up by their caller
                if self._requests:
                    break
            self._interrupt.clear()
            key = _sampling_key(self._requests[0].params)
            rows = [
                row
                for request in self._requests
                if _sampling_key(request.params) == key
                for row in request.rows
                if row.finish is None
            ]
            self._decoding = True
            return rows[: self.engine.max_batch_size]

    def _loop(self) -> None:
        while True:
            rows = self._next_batch()
            if not rows:
                return
            try:
                self._decode(rows)
            except BaseException as error:  # every request in flight fails with it
                with self._condition:
                    failed, self._requests = self._requests, []
                for request in failed:
                    request.future.set_exception(error)
            finally:
                with self._condition:
                    self._decoding = False
                    self._condition.notify_all()

    @torch.inference_mode()
    def _decode(self, rows: List[_Row]) -> None:
        """Decode ``rows`` until they finish, a pause, or a re-batch (module docstring)."""
        engine = self.engine
        inputs = [row.request.prompt + row.ids for row in rows]
        owners, previous = [], None  # fresh samples of one request share their prefill
        for index, (row, tokens) in enumerate(zip(rows, inputs)):
            same = previous is not None and previous[0] is row.request and previous[1] == tokens
            owners.append(owners[-1] if same else index)
            previous = (row.request, tokens)
        params = rows[0].request.params
        stop_ids = torch.tensor(params.stop_token_ids or [-1], dtype=torch.long)
        version = engine.weight_version()
        logits, cache, attention_mask, next_position, _, _ = engine._prefill(inputs, owners)
        self.batches += 1
        while True:
            tokens, logprobs = (t.cpu() for t in self.sample(logits, params, self.generator))
            stopped = torch.isin(tokens, stop_ids).tolist()
            for i, row in enumerate(rows):
                if row.finish is not None:
                    continue
                row.ids.append(int(tokens[i]))
                row.logprobs.append(float(logprobs[i]))
                row.versions.append(version)
                if stopped[i]:
                    row.finish = "stop"
                elif len(row.ids) >= row.request.budget:
                    row.finish = "length"
            self.decode_steps += 1
            self._resolve_finished()
            finished = sum(row.finish is not None for row in rows)
            if finished == len(rows) or self._interrupt.is_set() or (finished * 2 >= len(rows) and self._waiting(rows)):
                return
            logits, cache, attention_mask, next_position = engine._decode_step(
                tokens, attention_mask, next_position, cache
            )

    def _waiting(self, rows: List[_Row]) -> bool:
        """Whether rows of requests in flight wait outside this batch."""
        with self._condition:
            running = {id(row) for row in rows}
            return any(
                row.finish is None and id(row) not in running for request in self._requests for row in request.rows
            )

    def _resolve_finished(self) -> None:
        with self._condition:
            done = [r for r in self._requests if all(row.finish is not None for row in r.rows)]
            self._requests = [r for r in self._requests if r not in done]
        for request in done:
            if not request.future.cancelled():
                request.future.set_result(request.completions())
