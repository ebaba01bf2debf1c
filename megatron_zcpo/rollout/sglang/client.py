"""Rollouts from SGLang servers over HTTP: async /generate with retries, health, served weight versions.

Speaks the native HTTP API of SGLang 0.5.3.post3 (the pinned release) and 0.5.23 (the newest
checked); every endpoint, field and status code used here is listed, per release, in
:mod:`megatron_zcpo.rollout.sglang.api`:
- ``POST /generate`` {rid, input_ids, sampling_params, return_logprob, stream: false} ->
  {text, output_ids, meta_info: {finish_reason: {type: "stop"|"length"|"abort", ...},
  output_token_logprobs: [[logprob, token_id, text|null], ...], weight_version, ...}};
- ``GET /health_generate`` (200 once the server generates), ``GET /get_server_info`` (tp_size;
  ``/server_info`` where it is gone), ``POST /flush_cache`` (400 while requests run),
  ``POST /abort_request`` {rid | abort_all};
- ``GET /get_model_info`` -> {weight_version, ...} (``/model_info`` where it is gone);
- ``POST /init_weights_update_group`` {master_address, master_port, rank_offset, world_size,
  group_name, backend}, ``POST /update_weights_from_distributed`` {names, dtypes, shapes,
  group_name, flush_cache, weight_version} (the tensors then arrive by broadcast from rank 0, in
  order), ``POST /destroy_weights_update_group`` {group_name};
- ``POST /update_weights_from_disk`` {model_path, weight_version};
- ``load_format: "flattened_bucket"`` in /update_weights_from_distributed: the bucket arrives as one
  uint8 broadcast (SGLang with sgl-project/sglang#13824, merged 2025-11-24; not in v0.5.3);
- ``POST /begin_weight_update`` {} and ``POST /end_weight_update`` {} around every push to servers
  reporting SGLang 0.5.21 or newer (they refuse distributed updates outside such a session);
- ``POST /load_lora_adapter`` {lora_name, lora_path} and ``POST /unload_lora_adapter`` {lora_name}
  (``model.lora.push: adapter``, :meth:`SGLangEngine.update_adapter`), then ``lora_path`` (the
  adapter's name) in every ``/generate``;
- ``POST /pause_generation`` and ``POST /continue_generation`` around a push while requests run
  (asynchronous rollouts: :mod:`megatron_zcpo.rollout.sglang.partial`).
Each returns {success, message} with 200, or 400 with the reason. The HTTP plumbing lives in
:mod:`megatron_zcpo.rollout.sglang.http`, a request's body and answer in
:mod:`megatron_zcpo.rollout.sglang.generate_io`, the weight transports in
:mod:`megatron_zcpo.rollout.sglang.update_weight`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_zcpo.rollout.engine import (
    Completion,
    RolloutEngine,
    RolloutError,
    SamplingParams,
    validate_prompts,
)
from megatron_zcpo.rollout.output_checks import rejected_completion, rejected_messages
from megatron_zcpo.rollout.sglang.api import MODEL_INFO_PATHS, ROUTER_READY_PATH
from megatron_zcpo.rollout.sglang.config import SGLangEngineConfig
from megatron_zcpo.rollout.sglang.generate_io import (
    completion_from_sglang,
    parse_weight_version,
    request_seed,
    sglang_sampling_params,
)
from megatron_zcpo.rollout.sglang.http import RETRYABLE, SGLangHTTP, SGLangHTTPError
from megatron_zcpo.rollout.sglang.interrupt import InterruptibleGeneration
from megatron_zcpo.rollout.sglang.memory_saver import MemorySaverClient
from megatron_zcpo.rollout.sglang.partial import PausableGeneration, continuation_sampling, join_segments
from megatron_zcpo.rollout.sglang.server_pool import ServersLostError
from megatron_zcpo.rollout.sglang.update_weight import weight_update_for
from megatron_zcpo.rollout.sglang.update_weight.lora_adapter import LoraAdapterUpdate

logger = logging.getLogger(__name__)


class SGLangEngine(InterruptibleGeneration, PausableGeneration, MemorySaverClient, RolloutEngine):
    """The trainer's handle on a set of SGLang servers (launched by :mod:`sglang_server`, or given).

    ``on_shutdown`` runs at :meth:`shutdown` (e.g. the launcher's termination of the servers).
    """

    def __init__(self, config: SGLangEngineConfig, *, on_shutdown: Optional[Callable[[], None]] = None):
        config.validate()
        self.config = config
        self._on_shutdown = on_shutdown
        self._http = SGLangHTTP(config)
        self._weights = weight_update_for(self._http, config)
        self._adapter: Optional[LoraAdapterUpdate] = None  # model.lora.push=adapter: made by the first push
        self._closed = False
        self.rejected_samples = 0  # answers rejected by the output checks, over the engine's life
        self._memory_tags: Optional[Tuple[str, ...]] = None  # the servers' memory-saver tags, asked once
        self._released: Dict[str, set] = {}  # url -> memory-saver tags it released (colocated placement)
        self._returning: set = set()  # lost servers found generating in the generate phase
        self._init_pausable()
        self._init_interruptible()

    # -- generation ----------------------------------------------------------------------------

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1, affinity=None
    ) -> List[List[Completion]]:
        """Sample ``n`` responses per prompt, one /generate request per sample, concurrently.

        Without a router, request j of prompt i goes to the in-rotation server ``affinity[i]`` modulo
        their count when ``affinity`` is given (every turn of a multi-turn trajectory on one server,
        whose prefix cache holds its earlier turns), else round-robin; a router places requests
        itself (sglang-router's cache-aware policy sends a request where its prefix is cached).

        With ``params.seed`` set and ``config.sampling_seeds`` on, sample j of prompt i gets
        ``sampling_seed = (seed + i*n + j) mod 2**31`` (:func:`request_seed`).
        With ``config.return_routed_experts`` the requests go to the servers directly, even with a
        router: the routers drop ``return_routed_experts`` from the bodies they forward.
        A request that still fails after its retries is sent to another server in rotation (the
        failed one leaves it); one that fails on every server (or through the router on every
        attempt), or is refused (4xx), becomes a rejected sample: its group is dropped, bounded by
        ``max_rejected_fraction``. When too few servers remain, or the call exceeds
        ``rollout_timeout_s``, the other requests are cancelled and aborted on the servers, and
        ``RolloutError`` names the failure. :meth:`interrupt_generation` ends the call the same way, with
        :class:`~megatron_zcpo.rollout.engine.RolloutInterrupted` (:mod:`megatron_zcpo.rollout.sglang.interrupt`).
        """
        self._check_open()
        params.validate()
        validate_prompts(prompts, n)
        groups = self._http.run(self._unless_interrupted(self._generate_with_deadline(prompts, params, n, affinity)))
        rejected = rejected_messages(groups)
        self.rejected_samples += len(rejected)
        for message in rejected:
            logger.warning("rejected a sample: %s", message)
        if len(rejected) > self.config.max_rejected_fraction * len(prompts) * n:
            raise RolloutError(
                f"{len(rejected)} of {len(prompts) * n} samples rejected, more than "
                f"rollout.sglang.client.max_rejected_fraction = {self.config.max_rejected_fraction}: "
                + "; ".join(rejected[:5])
            )
        return groups

    async def _generate_with_deadline(
        self, prompts, params: SamplingParams, n: int, affinity
    ) -> List[List[Completion]]:
        try:
            return await asyncio.wait_for(
                self._generate_all(prompts, params, n, affinity), self.config.rollout_timeout_s
            )
        except TimeoutError:
            raise RolloutError(
                f"the rollout of {len(prompts) * n} samples did not finish within "
                f"rollout.sglang.client.rollout_timeout_s = {self.config.rollout_timeout_s} s"
            ) from None

    async def _generate_all(
        self, prompts, params: SamplingParams, n: int, affinity=None, limit: Optional[asyncio.Semaphore] = None
    ) -> List[List[Completion]]:
        """Every sample of ``prompts``, at most ``max_concurrency`` requests at once (or ``limit``'s)."""
        limit = limit or asyncio.Semaphore(self.config.max_concurrency)
        given_up = asyncio.Event()  # set by the first request that fails: queued ones do not start
        tasks = []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                index = i * n + j
                seed = (
                    request_seed(params.seed, index) if params.seed is not None and self.config.sampling_seeds else None
                )
                sampling = sglang_sampling_params(params, seed)
                server_key = index if affinity is None else int(affinity[i])
                tasks.append(
                    asyncio.ensure_future(self._generate_one(index, prompt, sampling, limit, given_up, server_key))
                )
        try:
            completions = await asyncio.gather(*tasks)
        except BaseException:
            given_up.set()
            for task in tasks:
                # A task this call's own cancellation reached is already ending, its abort on the server in
                # flight: a second cancel would abandon that abort (gather ends at the first cancelled task).
                if not task.cancelling():
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    async def _generate_one(
        self,
        index: int,
        prompt,
        sampling: Dict[str, Any],
        limit: asyncio.Semaphore,
        given_up: asyncio.Event,
        server_key: int,
    ) -> Optional[Completion]:
        """Sample ``index``: its /generate request, sent again from the tokens it has each time a pause of
        ours aborted it (:mod:`megatron_zcpo.rollout.sglang.partial`), the answers laid end to end."""
        segments: List[Completion] = []
        while True:
            produced = [t for segment in segments for t in segment.output_ids]
            answer = await self._generate_segment(
                index,
                [*prompt, *produced],
                continuation_sampling(sampling, len(produced), len(segments)) if segments else sampling,
                limit,
                given_up,
                server_key,
            )
            if answer is None:
                return None
            segment, epoch = answer
            if "rejected" in segment.info:
                return rejected_completion(prompt, segment.info["rejected"], segment.info)
            segments.append(segment)
            remaining = sampling["max_new_tokens"] - len(produced) - len(segment.output_ids)
            if segment.finish_reason == "abort" and self._paused_since(epoch):
                if remaining > 0:
                    continue
                segment.finish_reason = "length"  # aborted exactly at its budget
            return join_segments(prompt, segments)

    async def _generate_segment(
        self,
        index: int,
        input_ids,
        sampling: Dict[str, Any],
        limit: asyncio.Semaphore,
        given_up: asyncio.Event,
        server_key: int,
    ) -> Optional[Tuple[Completion, int]]:
        """One /generate request of sample ``index`` once generation is not paused: its Completion (a
        rejected one when lost) and the pause epoch it was sent in; None when the call gave up first."""
        async with limit:
            epoch = await self._wait_until_open()
            if given_up.is_set():  # the call failed: this request never starts (and raises nothing that
                return None  # could reach the caller before the failure's own error)
            payload = {
                "rid": uuid.uuid4().hex,
                "input_ids": [int(t) for t in input_ids],
                "sampling_params": sampling,
                "return_logprob": True,
                "stream": False,
            }
            if self.config.return_routed_experts:
                payload["return_routed_experts"] = True  # SGLang >= 0.5.7 with --enable-return-routed-experts
            served = self._adapter.current if self._adapter is not None else None
            if served is not None:  # the current LoRA adapter, never an older one
                payload["lora_path"] = served.name

            async def fresh_request_id():
                # The timed-out or dropped attempt may still run on the server: drop it, retry anew.
                await self._http.abort_quietly(payload["rid"])
                payload["rid"] = uuid.uuid4().hex

            try:
                url, response = await self._request_on_a_server(index, payload, fresh_request_id, server_key)
            except ServersLostError:
                given_up.set()
                await asyncio.shield(self._http.abort_quietly(payload["rid"]))
                raise
            except RolloutError as error:  # lost (retries spent, or refused): costs this prompt's group
                await asyncio.shield(self._http.abort_quietly(payload["rid"]))
                return rejected_completion(input_ids, f"request {index} lost: {error}", {"rid": payload["rid"]}), epoch
            except BaseException:
                given_up.set()
                await asyncio.shield(self._http.abort_quietly(payload["rid"]))
                raise
        if isinstance(response, list):  # a batch answer; we send one prompt per request
            response = response[0]
        completion = completion_from_sglang(input_ids, response, vocab_size=self.config.vocab_size, server=url)
        if served is not None:  # the base's served version stays SGLang's initial one: the adapter's is the policy's
            completion.weight_version, completion.output_versions = served.version, None
        return completion, epoch

    async def _request_on_a_server(self, index: int, payload, before_retry, server_key: int) -> Tuple[str, Any]:
        """(url, answer) of /generate request ``index``: moved to another server while servers are lost.

        Without a router, the server that failed the request's retries leaves the rotation and the
        next in-rotation server gets it. Through a router, a failed request has every server
        health-checked (the unhealthy ones leave the rotation) and goes to the router again. Raises
        :class:`ServersLostError` below ``min_healthy``, ``RolloutError`` when every attempt
        failed; a 4xx answer is not retried (:class:`SGLangHTTPError`).
        """
        pool, last_error, router = self._http.pool, None, self.generation_router
        for _ in range(len(pool.urls) + 1):
            url = router or pool.pick(server_key)
            try:
                return url, await self._http.request("POST", url + "/generate", payload, before_retry=before_retry)
            except SGLangHTTPError:
                raise
            except RolloutError as err:
                await before_retry()
                if router is None:
                    try:
                        pool.take_out(url, str(err))
                    except ServersLostError:
                        if not await self._resync_returning_servers():
                            raise
                    continue
                healthy = await self._health(pool.in_rotation())
                for server, ok in zip(pool.in_rotation(), healthy):
                    if not ok:
                        pool.take_out(server, f"unhealthy after {err}")
                last_error = err
        raise RolloutError(f"request {index} failed through the router on every attempt: {last_error}")

    @property
    def generation_router(self) -> Optional[str]:
        """The router /generate requests go through, or None (round robin over the servers): None with
        ``return_routed_experts``, which sglang-router 0.2.0 and 0.3.2 drop from the bodies they rebuild."""
        return None if self.config.return_routed_experts else self.config.router_url

    async def _resync_returning_servers(self) -> bool:
        """Below ``min_healthy`` mid-rollout: lost servers that are healthy again are re-synced to the
        current weights, if the transport can (disk), and rejoin. Returns whether enough servers are back."""
        pool = self._http.pool
        lost = list(pool.lost)
        transport = self._adapter if self._adapter is not None else self._weights
        for url, healthy in zip(lost, await self._health(lost)):
            try:
                if healthy and await transport.resync(url):
                    pool.bring_back(url)
            except RolloutError as err:
                logger.warning("re-syncing %s failed: %s", url, err)
        return len(pool.in_rotation()) >= pool.min_healthy

    # -- health, start-up checks, cache, versions -----------------------------------------------

    def check_servers(self, max_prompt_length: int, max_new_tokens: int, lora=None):
        """The start-up check of :func:`megatron_zcpo.rollout.sglang.server_checks.check_servers`: the API key,
        every server's context length against ``max_prompt_length + max_new_tokens``, seeds, load
        format and LoRA serving (``lora``: the run's ``model.lora``). Returns the servers'
        :class:`~megatron_zcpo.rollout.sglang.server_checks.ServerFacts`."""
        from megatron_zcpo.rollout.sglang.server_checks import check_servers

        self._check_open()
        return check_servers(self._http, self.config, max_prompt_length, max_new_tokens, lora)

    def wait_until_healthy(
        self, timeout_s: Optional[float] = None, poll_s: float = 2.0, is_alive: Optional[Callable[[], bool]] = None
    ) -> None:
        """Block until every server answers ``/health_generate`` and the router ``/readiness`` with 200
        (sglang-router 0.2.0 answers its own ``/health_generate`` with 503, whatever its workers).

        ``is_alive`` (e.g. "the launched processes still run") is checked between polls; raises
        ``RolloutError`` when it turns False or after ``timeout_s`` (default: the config's
        ``startup_timeout_s``), naming the servers not ready.
        """
        self._check_open()
        timeout_s = self.config.startup_timeout_s if timeout_s is None else timeout_s
        urls = list(self.config.server_urls) + ([self.config.router_url] if self.generation_router else [])
        deadline = time.monotonic() + timeout_s
        waiting = urls
        while True:
            waiting = [url for url, ok in zip(waiting, self._http.run(self._health(waiting))) if not ok]
            if not waiting:
                return
            if is_alive is not None and not is_alive():
                raise RolloutError(f"SGLang processes exited before {waiting} became healthy")
            if time.monotonic() > deadline:
                raise RolloutError(f"SGLang servers {waiting} not healthy after {timeout_s:.0f}s")
            time.sleep(poll_s)

    async def _health(self, urls: Sequence[str]) -> List[bool]:
        async def healthy(url):
            path = ROUTER_READY_PATH if url == self.config.router_url else "/health_generate"
            try:
                await self._http.request_once("GET", url + path, None, timeout=self.config.connect_timeout_s)
                return True
            except (RolloutError,) + RETRYABLE:
                return False

        return await asyncio.gather(*(healthy(url) for url in urls))

    def flush_cache(self) -> None:
        """Empty the prefix cache of every server in rotation.

        SGLang refuses (400) while requests run; between rollouts those can only be requests whose
        abort was lost, so a refusal aborts everything on that server and asks again, up to
        ``max_retries`` times with backoff. A server that does not answer leaves the rotation.
        """
        self._check_open()
        self._http.run(self._flush_all())

    async def _flush_all(self) -> None:
        async def flush(url):
            for attempt in range(self.config.max_retries + 1):
                try:
                    return await self._http.request("POST", url + "/flush_cache")
                except SGLangHTTPError as err:
                    if err.status != 400 or attempt == self.config.max_retries:
                        raise
                    logger.warning("%s refused to flush its cache (%s): aborting its requests and retrying", url, err)
                    await self._http.request("POST", url + "/abort_request", {"abort_all": True})
                    await asyncio.sleep(min(self.config.backoff_max_s, self.config.backoff_s * 2**attempt))

        pool = self._http.pool
        urls = pool.in_rotation()
        for url, answer in zip(urls, await asyncio.gather(*(flush(url) for url in urls), return_exceptions=True)):
            if isinstance(answer, SGLangHTTPError) or not isinstance(answer, RolloutError):
                if isinstance(answer, BaseException):
                    raise answer
                continue
            pool.take_out(url, f"/flush_cache failed: {answer}")

    def served_weight_versions(self) -> Dict[str, int]:
        """{server url: the weight version it serves}, for the servers in rotation."""
        self._check_open()
        return self._http.run(self._served_versions())

    async def _served_versions(self) -> Dict[str, int]:
        pool = self._http.pool

        # /get_model_info carries weight_version in 0.5.3.post3 and (deprecated) in 0.5.23, whose
        # /get_weight_version is gone; /model_info is its newer name.
        async def version(url):
            return parse_weight_version((await self._http.get_first_served(url, MODEL_INFO_PATHS))["weight_version"])

        urls = pool.in_rotation()
        versions = {}
        for url, answer in zip(urls, await asyncio.gather(*(version(url) for url in urls), return_exceptions=True)):
            if isinstance(answer, RolloutError) and not isinstance(answer, SGLangHTTPError):
                pool.take_out(url, f"weight version check failed: {answer}")
            elif isinstance(answer, BaseException):
                raise answer
            else:
                versions[url] = answer
        return versions

    def weight_version(self) -> int:
        """The version all servers serve (with a LoRA adapter pushed: the adapter's); raises ``RolloutError``
        naming them when they disagree."""
        if self._adapter is not None and self._adapter.current is not None:
            return self._adapter.current.version
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
        every server's cache is flushed and its served version must equal ``version`` (else it
        leaves the rotation); servers out of rotation that are healthy again are included first.
        Under
        pipeline parallelism each stage pushes its share with :meth:`push_part` (an engine per
        stage, distinct ``group_name``) and one engine then calls :meth:`commit_weights` (see
        :func:`megatron_zcpo.recipe.weight_push.push_weights`).
        """
        self._check_open()
        self._bring_back_returning_servers()
        self._weights.push(self._quantized(named_hf_tensors), version)
        self._flush_and_verify(version)

    def update_adapter(
        self, named_peft_tensors: Iterable[Tuple[str, torch.Tensor]], adapter_config: dict, version: int
    ) -> int:
        """Serve a LoRA adapter (PEFT names, ``adapter_config.json`` as a dict) as ``version`` on every server
        (:class:`~megatron_zcpo.rollout.sglang.update_weight.lora_adapter.LoraAdapterUpdate`: a new name per
        version, the older ones unloaded); every later request names it, and its completions carry
        ``version``. Servers out of rotation that are healthy again are included first. Returns the bytes
        written for the servers."""
        self._check_open()
        self._bring_back_returning_servers()
        if self._adapter is None:
            self._adapter = LoraAdapterUpdate(self._http, self.config)
        written = self._adapter.push(named_peft_tensors, adapter_config, version)
        self.flush_cache()
        return written

    def push_part(
        self, named_hf_tensors: Iterable[Tuple[str, torch.Tensor]], version: int, file_prefix: str = "model"
    ) -> Optional[Dict[str, str]]:
        """Push one share of the weights (a pipeline stage's) without changing the served version.

        "distributed": broadcast in buckets through this engine's group; returns None. "disk":
        write the share as ``<file_prefix>-*.safetensors`` into version ``version``'s directory
        and return its weight map {name: file} for :meth:`commit_weights`.
        """
        self._check_open()
        self._bring_back_returning_servers()
        return self._weights.push_part(self._quantized(named_hf_tensors), version, file_prefix)

    # -- the per-GPU push (weight_sync "tensor", colocated: update_weight/tensor_ipc.py's push_from_every_gpu) --

    def begin_tensor_push(self) -> List[int]:
        """Open a per-GPU push (returning servers rejoin first); the GPU slots whose blobs it needs."""
        self._check_open()
        self._bring_back_returning_servers()
        return self._tensor_transport().begin()

    def post_tensor_bucket(self, blobs: Dict[int, str], version: Optional[int], nbytes: int, tensors: int) -> None:
        """One bucket, serialised on each GPU slot (``blobs``); ``version`` with the last."""
        self._tensor_transport().post(blobs, version, nbytes, tensors)

    def finish_tensor_push(self, version: int) -> None:
        """Close the push, then flush every cache and verify that the servers serve ``version``."""
        self._tensor_transport().end()
        self._flush_and_verify(version)

    def abort_tensor_push(self) -> None:
        """Close a failed push's sessions, as far as the servers answer."""
        self._tensor_transport().end(ok=False)

    def _tensor_transport(self):
        from megatron_zcpo.rollout.sglang.update_weight import TensorIPCWeightUpdate

        if not isinstance(self._weights, TensorIPCWeightUpdate):
            raise RolloutError(f"a per-GPU push needs weight_sync='tensor', not {self.config.weight_sync!r}")
        return self._weights

    def rotation_for_push(self) -> List[str]:
        """The servers a push by shares goes to: those in rotation, after the lost ones that answer their
        health check again rejoined (the push re-syncs them). Rank 0 hands it to every share's lead."""
        self._check_open()
        self._bring_back_returning_servers()
        return self._http.pool.in_rotation()

    def follow_rotation(self, rotation: Sequence[str]) -> None:
        """Push to exactly ``rotation`` (rank 0's :meth:`rotation_for_push`): a share's lead never pushes
        to a server rank 0 took out, and includes the ones it brought back."""
        self._check_open()
        self._http.pool.follow(rotation, "out of rank 0's rotation")

    def commit_weights(self, version: int, weight_maps: Sequence[Optional[Dict[str, str]]] = ()) -> None:
        """Serve ``version`` once every share is pushed ("disk": index the shares' files and reload;
        "distributed": every share's last bucket carried it), then flush every cache and verify the version."""
        self._check_open()
        self._weights.commit(version, weight_maps)
        self._flush_and_verify(version)

    @property
    def pushed(self) -> Dict[str, int]:
        """Totals of this engine's weight pushes: bytes, tensors and buckets sent."""
        return self._weights.pushed

    def _quantized(self, named_hf_tensors):
        stream = iter(named_hf_tensors)
        if self.config.quantization == "fp8":
            from megatron_zcpo.rollout.quantization import quantize_fp8_hf_weights

            stream = quantize_fp8_hf_weights(stream)
        return stream

    def _flush_and_verify(self, version: int) -> None:
        self.flush_cache()
        for url, served in self.served_weight_versions().items():
            if served != int(version):  # never serve stale weights
                self._http.pool.take_out(url, f"serves weight version {served} after the push of version {version}")

    def _bring_back_returning_servers(self) -> None:
        """Servers out of rotation that answer their health check again rejoin it for this push
        (which then re-syncs them to the current weights before they get any request). With
        generation paused (colocated placement's update phase) no server can generate: those that
        :meth:`check_returning_servers` found healthy in the generate phase rejoin instead."""
        pool = self._http.pool
        lost = list(pool.lost)
        if self.paused:
            healthy_ones = [url for url in lost if url in self._returning]
        elif lost:
            healthy_ones = [url for url, healthy in zip(lost, self._http.run(self._health(lost))) if healthy]
        else:
            healthy_ones = []
        for url in healthy_ones:
            pool.bring_back(url)
            self._returning.discard(url)

    # -- lifecycle -----------------------------------------------------------------------------

    def abort_all(self) -> None:
        """Abort every request running on the servers."""
        self._check_open()
        self._http.run(self._http.on_all_servers("POST", "/abort_request", {"abort_all": True}, retry=False))

    def _check_open(self) -> None:
        if self._closed:
            raise RolloutError("the SGLang engine was shut down")

    def shutdown(self) -> None:
        """Leave the weight-update group, close the HTTP session and stop launched servers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._weights.close()
        except RolloutError as err:
            logger.warning("leaving the weight-update group failed: %s", err)
        finally:
            self._http.close()
            if self._on_shutdown is not None:
                self._on_shutdown()
