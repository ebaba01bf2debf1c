"""Rollouts from SGLang servers over HTTP: async /generate with retries, weight pushes, versions.

Follows the native HTTP API of SGLang v0.5.3 (python/sglang/srt/entrypoints/http_server.py,
managers/io_struct.py, sampling/sampling_params.py):
- ``POST /generate`` {rid, input_ids, sampling_params, return_logprob, stream: false} ->
  {text, output_ids, meta_info: {finish_reason: {type: "stop"|"length"|"abort", ...},
  output_token_logprobs: [[logprob, token_id, text|null], ...], weight_version, ...}};
- ``GET /health_generate`` (200 once the server generates), ``GET /get_server_info`` (tp_size),
  ``POST /flush_cache`` (400 while requests run), ``POST /abort_request`` {rid | abort_all};
- ``GET /get_weight_version`` -> {weight_version} (newer releases moved it to ``GET /model_info``);
- ``POST /init_weights_update_group`` {master_address, master_port, rank_offset, world_size,
  group_name, backend}, ``POST /update_weights_from_distributed`` {names, dtypes, shapes,
  group_name, flush_cache, weight_version} (the tensors then arrive by broadcast from rank 0, in
  order), ``POST /destroy_weights_update_group`` {group_name};
- ``POST /update_weights_from_disk`` {model_path, weight_version}.
Each returns {success, message} with 200, or 400 with the reason.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import logging
import os
import random
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import aiohttp
import torch

from megatron_zcpo.megatron.initialize import free_port
from megatron_zcpo.rollout.engine import (
    Completion,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    validate_prompts,
)
from megatron_zcpo.rollout.weight_sync import (
    bucket_tensors,
    dtype_name,
    init_custom_process_group,
    start_broadcast,
)

logger = logging.getLogger(__name__)

WEIGHT_SYNC_METHODS = ("distributed", "disk")


@dataclass
class SGLangEngineConfig:
    """Where the SGLang servers are and how to talk to them.

    ``server_urls``: every server (one per inference TP group); weight pushes, cache flushes and
    version checks go to each. ``router_url``: generate through the sglang router when given,
    else round-robin over the servers. Requests: at most ``max_concurrency`` in flight, each
    with ``request_timeout_s``; connection errors, timeouts and 5xx answers are retried
    ``max_retries`` times with exponential backoff from ``backoff_s`` up to ``backoff_max_s``.
    Weight push: ``weight_sync`` "distributed" (NCCL broadcast in buckets of ``bucket_bytes``
    through a weight-update group named ``group_name``; this host is reachable from the servers
    at ``master_address``) or "disk" (safetensors under ``weight_dir``, a directory the servers
    can read). ``quantization`` "fp8" pushes modelopt FP8 weights (servers launched with
    modelopt FP8 quantisation; turn the trainer's importance-sampling correction on).
    ``sampling_seeds``: forward ``SamplingParams.seed`` as SGLang's per-request ``sampling_seed``
    (SGLang honours it only with ``--sampling-backend pytorch``; its default flashinfer sampler
    rejects it), else seeds are not sent and SGLang sampling is not reproducible.
    """

    server_urls: List[str]
    router_url: Optional[str] = None
    max_concurrency: int = 256
    request_timeout_s: float = 3600.0
    connect_timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    weight_sync: str = "distributed"
    bucket_bytes: int = 512 * 2**20
    group_name: str = "zcpo_weights"
    group_backend: str = "nccl"
    group_timeout_s: float = 1800.0
    master_address: Optional[str] = None
    master_port: Optional[int] = None
    weight_dir: Optional[str] = None
    update_timeout_s: float = 1800.0
    quantization: Optional[str] = None
    sampling_seeds: bool = False

    def validate(self, prefix: str = "rollout.sglang") -> None:
        """Raise ``ValueError`` naming the offending key."""
        if not self.server_urls:
            raise ValueError(f"{prefix}.server_urls is empty")
        if self.weight_sync not in WEIGHT_SYNC_METHODS:
            raise ValueError(f"{prefix}.weight_sync={self.weight_sync!r}: choose from {WEIGHT_SYNC_METHODS}")
        if self.weight_sync == "disk" and not self.weight_dir:
            raise ValueError(f"{prefix}.weight_dir must be set (a directory the servers can read) for weight_sync='disk'")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"{prefix}.quantization must be null or 'fp8', got {self.quantization!r}")
        for key in ("max_concurrency", "request_timeout_s", "bucket_bytes", "update_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{prefix}.{key} must be positive, got {getattr(self, key)}")
        if self.max_retries < 0:
            raise ValueError(f"{prefix}.max_retries must be >= 0, got {self.max_retries}")


class SGLangHTTPError(RolloutError):
    """An SGLang server answered a request with a 4xx status (not retried)."""

    def __init__(self, method: str, url: str, status: int, body: str):
        super().__init__(f"{method} {url} -> HTTP {status}: {body[:500]}")
        self.status = status


class _ServerError(Exception):
    """A 5xx answer: retried like a dropped connection."""


# asyncio.TimeoutError is TimeoutError from Python 3.11 on; aiohttp raises the former.
_RETRYABLE = (_ServerError, TimeoutError, asyncio.TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)


def sglang_sampling_params(params: SamplingParams, seed: Optional[int] = None) -> Dict[str, Any]:
    """SGLang's ``sampling_params`` for ``params`` (``seed`` becomes ``sampling_seed``)."""
    sampling = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,
        "max_new_tokens": params.max_new_tokens,
        "stop_token_ids": list(params.stop_token_ids),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if seed is not None:
        sampling["sampling_seed"] = int(seed)
    return sampling


def parse_weight_version(value: Any) -> int:
    """A served weight version as an int; SGLang's initial "default" (or anything non-numeric) is -1."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def completion_from_sglang(prompt_ids: Sequence[int], response: Dict[str, Any]) -> Completion:
    """A :class:`Completion` from one /generate answer; raises ``RolloutError`` on a malformed one."""
    try:
        meta = response["meta_info"]
        output_ids = [int(t) for t in response["output_ids"]]
        entries = meta["output_token_logprobs"]
        finish = meta["finish_reason"]
    except (KeyError, TypeError) as err:
        raise RolloutError(f"malformed /generate response (missing {err}): {str(response)[:300]}") from None
    logprobs = [float(entry[0]) for entry in entries]
    if [int(entry[1]) for entry in entries] != output_ids:
        raise RolloutError(
            f"/generate response {meta.get('id')}: output_token_logprobs do not match output_ids "
            f"({len(entries)} log-probs for {len(output_ids)} tokens)"
        )
    reason = finish.get("type") if isinstance(finish, dict) else finish
    if reason not in ("stop", "length", "abort"):
        raise RolloutError(f"/generate response {meta.get('id')}: unknown finish_reason {finish!r}")
    version = meta.get("weight_version")
    return Completion(
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=reason,
        weight_version=None if version is None else parse_weight_version(version),
        info={"rid": meta.get("id"), "cached_tokens": meta.get("cached_tokens")},
    )


class _LoopThread:
    """An asyncio loop in a daemon thread, so synchronous callers can run coroutines on it.

    A caller interrupted while waiting (KeyboardInterrupt, timeout) cancels its coroutine, whose
    cleanup (aborting requests) then runs on the loop.
    """

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine):
        future = self.submit(coroutine)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


class SGLangEngine(RolloutEngine):
    """The trainer's handle on a set of SGLang servers (launched by :mod:`sglang_server`, or given).

    ``on_shutdown`` runs at :meth:`shutdown` (e.g. the launcher's termination of the servers).
    """

    def __init__(self, config: SGLangEngineConfig, *, on_shutdown: Optional[Callable[[], None]] = None):
        config.validate()
        self.config = config
        self._on_shutdown = on_shutdown
        self._loop = _LoopThread("sglang-client")
        self._session = None
        self._group = None
        self._last_weight_dir: Optional[str] = None
        self._closed = False

    # -- HTTP ----------------------------------------------------------------------------------

    async def _get_session(self):
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.config.max_concurrency + 8, force_close=False)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def _request_once(self, method: str, url: str, payload, timeout: float):
        session = await self._get_session()
        client_timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=self.config.connect_timeout_s)
        async with session.request(method, url, json=payload, timeout=client_timeout) as response:
            body = await response.read()
            text = body.decode("utf-8", errors="replace")
            if response.status >= 500:
                raise _ServerError(f"HTTP {response.status}: {text[:300]}")
            if response.status >= 400:
                raise SGLangHTTPError(method, url, response.status, text)
            if response.content_type == "application/json":
                return await response.json()
            return text

    async def _request(
        self,
        method: str,
        url: str,
        payload=None,
        *,
        timeout: Optional[float] = None,
        retry: bool = True,
        before_retry: Optional[Callable[[], Any]] = None,
    ):
        """One request with retries on connection errors, timeouts and 5xx; raises ``RolloutError``."""
        attempts = 1 + (self.config.max_retries if retry else 0)
        last_error: BaseException = RolloutError("no attempt made")
        for attempt in range(attempts):
            try:
                return await self._request_once(method, url, payload, timeout or self.config.request_timeout_s)
            except _RETRYABLE as err:
                last_error = err
                if attempt + 1 == attempts:
                    break
                delay = min(self.config.backoff_max_s, self.config.backoff_s * 2**attempt)
                delay *= 0.5 + random.random() / 2  # jitter: retries from many requests do not align
                logger.warning("%s %s failed (%r); retry %d/%d in %.2fs", method, url, err, attempt + 1, attempts - 1, delay)
                if before_retry is not None:
                    await before_retry()
                await asyncio.sleep(delay)
        raise RolloutError(f"{method} {url} failed after {attempts} attempt(s): {last_error!r}") from last_error

    async def _on_all_servers(self, method: str, path: str, payload=None, *, payloads: Optional[Sequence] = None,
                              **kwargs) -> List[Any]:
        """The same request (or server i gets ``payloads[i]``) on every server, concurrently."""
        payloads = payloads if payloads is not None else [payload] * len(self.config.server_urls)
        return await asyncio.gather(*(
            self._request(method, url + path, body, **kwargs) for url, body in zip(self.config.server_urls, payloads)
        ))

    async def _abort_quietly(self, rid: str) -> None:
        """Best effort: tell every server to drop request ``rid`` (it runs on one of them)."""
        async def abort(url):
            try:
                await self._request_once("POST", url + "/abort_request", {"rid": rid}, timeout=5.0)
            except Exception as err:  # noqa: BLE001 - the request is being given up anyway
                logger.debug("abort of %s on %s failed: %r", rid, url, err)

        await asyncio.gather(*(abort(url) for url in self.config.server_urls))

    # -- generation ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1) -> List[List[Completion]]:
        """Sample ``n`` responses per prompt, one /generate request per sample, concurrently.

        With ``params.seed`` set and ``config.sampling_seeds`` on, sample j of prompt i gets
        ``sampling_seed = seed + i*n + j``.
        A request that still fails after its retries aborts the whole call: the other requests
        are cancelled and aborted on the servers, and ``RolloutError`` names the failure.
        """
        self._check_open()
        params.validate()
        validate_prompts(prompts, n)
        return self._loop.run(self._generate_all(prompts, params, n))

    async def _generate_all(self, prompts, params: SamplingParams, n: int) -> List[List[Completion]]:
        limit = asyncio.Semaphore(self.config.max_concurrency)
        given_up = asyncio.Event()  # set by the first request that fails: queued ones do not start
        targets = [self.config.router_url] if self.config.router_url else self.config.server_urls
        tasks = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                index = i * n + j
                seed = params.seed + index if params.seed is not None and self.config.sampling_seeds else None
                sampling = sglang_sampling_params(params, seed)
                tasks.append(asyncio.ensure_future(
                    self._generate_one(targets[index % len(targets)], prompt, sampling, limit, given_up)
                ))
        try:
            completions = await asyncio.gather(*tasks)
        except BaseException:
            given_up.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]

    async def _generate_one(self, url: str, prompt, sampling: Dict[str, Any], limit: asyncio.Semaphore,
                            given_up: asyncio.Event) -> Completion:
        async with limit:
            if given_up.is_set():
                raise asyncio.CancelledError
            payload = {
                "rid": uuid.uuid4().hex,
                "input_ids": [int(t) for t in prompt],
                "sampling_params": sampling,
                "return_logprob": True,
                "stream": False,
            }

            async def fresh_request_id():
                # The timed-out or dropped attempt may still run on the server: drop it, retry anew.
                await self._abort_quietly(payload["rid"])
                payload["rid"] = uuid.uuid4().hex

            try:
                response = await self._request("POST", url + "/generate", payload, before_retry=fresh_request_id)
            except BaseException:
                given_up.set()
                await asyncio.shield(self._abort_quietly(payload["rid"]))
                raise
        if isinstance(response, list):  # a batch answer; we send one prompt per request
            response = response[0]
        return completion_from_sglang(prompt, response)

    # -- health, cache, versions ----------------------------------------------------------------

    def wait_until_healthy(self, timeout_s: float = 900.0, poll_s: float = 2.0, is_alive: Optional[Callable[[], bool]] = None) -> None:
        """Block until every server (and the router) answers ``/health_generate`` with 200.

        ``is_alive`` (e.g. "the launched processes still run") is checked between polls; raises
        ``RolloutError`` when it turns False or after ``timeout_s``, naming the servers not ready.
        """
        self._check_open()
        urls = list(self.config.server_urls) + ([self.config.router_url] if self.config.router_url else [])
        deadline = time.monotonic() + timeout_s
        waiting = urls
        while True:
            waiting = [url for url, ok in zip(waiting, self._loop.run(self._health(waiting))) if not ok]
            if not waiting:
                return
            if is_alive is not None and not is_alive():
                raise RolloutError(f"SGLang processes exited before {waiting} became healthy")
            if time.monotonic() > deadline:
                raise RolloutError(f"SGLang servers {waiting} not healthy after {timeout_s:.0f}s")
            time.sleep(poll_s)

    async def _health(self, urls: Sequence[str]) -> List[bool]:
        async def healthy(url):
            try:
                await self._request_once("GET", url + "/health_generate", None, timeout=self.config.connect_timeout_s)
                return True
            except (RolloutError,) + _RETRYABLE:
                return False

        return await asyncio.gather(*(healthy(url) for url in urls))

    def flush_cache(self) -> None:
        """Empty every server's prefix cache (SGLang refuses, with 400, while requests run)."""
        self._check_open()
        self._loop.run(self._on_all_servers("POST", "/flush_cache"))

    def served_weight_versions(self) -> Dict[str, int]:
        """{server url: the weight version it serves}."""
        self._check_open()
        return dict(zip(self.config.server_urls, self._loop.run(self._served_versions())))

    async def _served_versions(self) -> List[int]:
        async def version(url):
            try:
                answer = await self._request("GET", url + "/get_weight_version")
            except SGLangHTTPError as err:
                if err.status != 404:
                    raise
                answer = await self._request("GET", url + "/model_info")
            return parse_weight_version(answer["weight_version"])

        return await asyncio.gather(*(version(url) for url in self.config.server_urls))

    def weight_version(self) -> int:
        """The version all servers serve; raises ``RolloutError`` naming them when they disagree."""
        versions = self.served_weight_versions()
        if len(set(versions.values())) > 1:
            raise RolloutError(f"SGLang servers serve different weight versions: {versions}")
        return next(iter(versions.values()))

    # -- weight push ---------------------------------------------------------------------------

    def update_weights(self, named_hf_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """Push a stream of (Hugging Face name, tensor) to every server, then flush and verify.

        "distributed": buckets of metadata go to ``/update_weights_from_distributed`` while this
        process broadcasts the tensors (rank 0 of the weight-update group, joined on first use);
        the last bucket carries ``version``. "disk": the stream is written as safetensors under
        ``weight_dir`` and the servers reload it with ``/update_weights_from_disk``. Afterwards
        every server's cache is flushed and its served version must equal ``version``.
        Under pipeline parallelism each stage pushes its own tensors with its own engine (distinct
        ``group_name`` / ``weight_dir``).
        """
        self._check_open()
        stream = iter(named_hf_tensors)
        if self.config.quantization == "fp8":
            from megatron_zcpo.rollout.quantization import quantize_fp8_hf_weights

            stream = quantize_fp8_hf_weights(stream)
        if self.config.weight_sync == "disk":
            self._push_from_disk(stream, version)
        else:
            self._push_distributed(stream, version)
        self.flush_cache()
        served = self.served_weight_versions()
        stale = {url: v for url, v in served.items() if v != int(version)}
        if stale:
            raise RolloutError(f"after pushing weight version {version}, servers still serve {stale}")

    def _push_from_disk(self, stream, version: int) -> None:
        directory = os.path.join(self.config.weight_dir, f"{self.config.group_name}-v{int(version)}")
        from megatron_zcpo.convert.hf_checkpoint import write_safetensors_shards

        write_safetensors_shards(directory, stream)
        payload = {"model_path": directory, "weight_version": str(int(version))}
        self._loop.run(self._on_all_servers("POST", "/update_weights_from_disk", payload, timeout=self.config.update_timeout_s))
        if self._last_weight_dir and self._last_weight_dir != directory:
            shutil.rmtree(self._last_weight_dir, ignore_errors=True)
        self._last_weight_dir = directory

    def _push_distributed(self, stream, version: int) -> None:
        if self._group is None:
            self._init_weight_update_group()
        buckets = bucket_tensors(stream, self.config.bucket_bytes)
        bucket = next(buckets, None)
        if bucket is None:
            raise ValueError("update_weights got an empty weight stream")
        while bucket is not None:
            following = next(buckets, None)  # look ahead: the last bucket carries the new version
            request = {
                "names": [name for name, _ in bucket],
                "dtypes": [dtype_name(tensor.dtype) for _, tensor in bucket],
                "shapes": [list(tensor.shape) for _, tensor in bucket],
                "group_name": self.config.group_name,
                "flush_cache": False,
                "weight_version": None if following is not None else str(int(version)),
            }
            answer = self._loop.submit(self._on_all_servers(
                "POST", "/update_weights_from_distributed", request, retry=False, timeout=self.config.update_timeout_s
            ))
            self._wait_alongside(start_broadcast(bucket, self._group), answer, f"bucket {request['names'][:3]}...")
            bucket = following

    def _wait_alongside(self, works, answer: concurrent.futures.Future, what: str) -> None:
        """Wait for collective ``works`` while the servers' HTTP ``answer`` is pending.

        A server that refuses the request never joins the collective: raise at once (the group is
        then unusable and dropped) instead of blocking until the group's timeout.
        """
        while not all(work.is_completed() for work in works):
            if answer.done() and answer.exception() is not None:
                self._group = None
                raise RolloutError(f"weight update of {what} refused: {answer.exception()}") from answer.exception()
            time.sleep(0.001)
        for work in works:
            work.wait()
        answer.result()

    def _init_weight_update_group(self) -> None:
        infos = self._loop.run(self._on_all_servers("GET", "/get_server_info"))
        tp_sizes = [int(info.get("tp_size", 1)) for info in infos]
        world_size = 1 + sum(tp_sizes)
        address = self.config.master_address or socket.gethostbyname(socket.gethostname())
        port = self.config.master_port or free_port()
        requests = [
            {
                "master_address": address, "master_port": port, "rank_offset": 1 + sum(tp_sizes[:i]),
                "world_size": world_size, "group_name": self.config.group_name, "backend": self.config.group_backend,
            }
            for i in range(len(tp_sizes))
        ]
        answer = self._loop.submit(self._on_all_servers(
            "POST", "/init_weights_update_group", payloads=requests, retry=False, timeout=self.config.group_timeout_s
        ))
        joined: Dict[str, Any] = {}

        def join():
            try:
                joined["group"] = init_custom_process_group(
                    self.config.group_backend, address, port, 0, world_size, self.config.group_name,
                    timeout=datetime.timedelta(seconds=self.config.group_timeout_s),
                )
            except BaseException as err:  # noqa: BLE001 - reported to the waiting thread
                joined["error"] = err

        thread = threading.Thread(target=join, name="weight-update-group", daemon=True)
        thread.start()
        while thread.is_alive():
            if answer.done() and answer.exception() is not None:
                raise RolloutError(f"servers refused the weight-update group: {answer.exception()}") from answer.exception()
            thread.join(timeout=0.01)
        if "error" in joined:
            raise RolloutError(f"joining the weight-update group at {address}:{port} failed: {joined['error']!r}")
        answer.result()
        self._group = joined["group"]

    # -- lifecycle -----------------------------------------------------------------------------

    def abort_all(self) -> None:
        """Abort every request running on the servers."""
        self._check_open()
        self._loop.run(self._on_all_servers("POST", "/abort_request", {"abort_all": True}, retry=False))

    def _check_open(self) -> None:
        if self._closed:
            raise RolloutError("the SGLang engine was shut down")

    def shutdown(self) -> None:
        """Leave the weight-update group, close the HTTP session and stop launched servers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._group is not None:
                self._loop.run(self._on_all_servers(
                    "POST", "/destroy_weights_update_group", {"group_name": self.config.group_name}, retry=False, timeout=30.0
                ))
                import torch.distributed as dist

                dist.destroy_process_group(self._group)
                self._group = None
        except RolloutError as err:
            logger.warning("leaving the weight-update group failed: %s", err)
        finally:
            if self._session is not None:
                self._loop.run(self._session.close())
            self._loop.close()
            if self._on_shutdown is not None:
                self._on_shutdown()

